"""Command line of train-dpo, generated: every TrainConfig field is an option, and so is every
`transformers.TrainingArguments` field it does not define (new transformers options appear by themselves). Both
spellings work (--learning-rate, --learning_rate). --config takes a YAML or JSON file of the same keys, or a TRL
`DPOConfig` / `trl dpo` YAML; options given on the command line override the file."""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from runtime import kl_control
from runtime.cli import (GroupedCommand, command_text, exit_without_teardown, given_values, number_text, shell_word,
                         quiet_libraries, run_cli, typed_options)
from runtime.locations import Location, record_sources
from runtime.options import TRL_ALIASES, dataclass_options, spec_options
from runtime.terminal import echo

from .config import TrainConfig
from .config_file import RENAMED, load_config_file
from .lora import LoraOptions
from .loss_config import unread_message, unread_options
from .options import LORA, OURS, REQUIRED, TRAINER, TRAINER_SPECS


def resolve_config(config_file: str | None, given: dict) -> TrainConfig:
    from_file = load_config_file(config_file) if config_file else {}
    command_line = given_values(given)
    values = from_file | command_line
    missing = [f"--{k.replace('_', '-')}" for k in REQUIRED if not values.get(k)]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (on the command line or in --config)")
    _check_unread_options(config_file, from_file, command_line)
    trainer = {k: values.pop(k) for k in list(values) if k in TRAINER}
    lora = {k: values.pop(k) for k in list(values) if k in LORA}
    cfg = TrainConfig(**values, training_args=trainer, lora=LoraOptions(**lora), config_file=config_file)
    # a place not there names the file and the key as the file wrote it
    record_sources(cfg, config_file, set(from_file) - set(command_line), getattr(from_file, "written", {}),
                   typed_options())
    try:
        cfg.loss_config()  # the loss's own rules beyond each option's domain (label_smoothing < 0.5)
    except ValueError as e:
        raise click.UsageError(f"loss options: {e}") from None
    return cfg


def _check_unread_options(config_file: str | None, from_file: dict, command_line: dict) -> None:
    """A loss option the chosen loss does not read, or a KL option nothing this run uses reads, is refused
    (dpo/loss_config.py's and runtime/kl_control.py's tables): given on the command line, whatever its value; in a
    config file, unless it holds the default (a DPOConfig written by TRL carries every key)."""
    loss_type = command_line.get("loss_type", from_file.get("loss_type", OURS["loss_type"].default))
    for name in unread_options(loss_type, command_line):
        raise click.UsageError(unread_message(loss_type, name, number_text(command_line[name]), f"--{name.replace('_', '-')}"))
    for name in unread_options(loss_type, from_file):
        if name not in command_line and from_file[name] != OURS[name].default:
            raise click.UsageError(unread_message(loss_type, name, number_text(from_file[name]), f"{config_file}: {name}"))
    values = from_file | command_line
    # the KL options by the same rule: read by what switches them on (runtime/kl_control.py's READ_BY)
    in_file = [name for name in from_file
               if name in kl_control.READ_BY and name not in command_line and from_file[name] != OURS[name].default]
    for given, where in ((list(command_line), "--{}"), (in_file, f"{config_file}: {{}}")):
        for name, reader in kl_control.unread_options(values, given):
            shown = where.format(name.replace("_", "-") if where.startswith("--") else name)
            raise click.UsageError(f"{shown} {number_text(values[name])}: only {reader} reads it, which this run does not use, so "
                                   f"it would be ignored; drop it, or add what reads it")


def summary_text(s: dict) -> str:
    """The closing lines: what was trained and where each output is; a verification figure only where a cache was
    verified (not with a live reference), a plot line only where a plot was written (not with --no-plot), the merged
    model where one was written; the train loss of the whole run (across a resume); the checkpoint
    --load-best-model-at-end kept; a note where the cache's precision differs from the policy's."""
    acc = s["eval"].get("eval_rewards/accuracies")
    out = Path(s["output_dir"])
    verified = f" (verification {s['verify_s']:.1f} s)" if s.get("reference", "cache") == "cache" else ""
    loss = f"train loss {s['train_loss']:.4f}" + (
        f" (all {s['steps']} steps; resumed at step {s['resumed_from']})" if s.get("resumed_from") else "")
    best = s.get("best_checkpoint")
    kept = ""
    if best:
        kept = (f" (--load-best-model-at-end: the weights of {Path(best['path']).name}, best {best['metric']} "
                f"{best['value']:.4f})" if best["path"] else " (--load-best-model-at-end: no evaluation chose a "
                "checkpoint, so the last step's weights)")
    w = shell_word  # every path as a shell takes it back (a space in a folder's name)
    plot = f"\n  plot:       {w(out / 'metrics.png')}" if (out / "metrics.png").is_file() else ""
    merged = f"\n  merged:     {w(Path(s['merged_dir']).absolute())}" if s.get("merged_dir") else ""
    return (
        f"trained {s['steps']} step{'s' * (s['steps'] != 1)} in {s['train_s']:.1f} s{verified}; {loss}"
        + (f"; eval reward accuracy {acc:.3f} (share of eval pairs whose implicit reward beta*log(pi/ref) "
           "ranks chosen above rejected)" if acc is not None else "")
        + f"\n  checkpoint: {w(out)}{kept}{merged}\n  metrics:    {w(out / 'metrics.jsonl')}{plot}"
        f"\n  manifest:   {w(out / 'run-manifest.json')}"
        + (f"\n  card:       {w(out / 'README.md')}" if (out / "README.md").is_file() else "")
        + _precision_text(s.get("precision"))
    )


def _precision_text(note: dict | None) -> str:
    if not note:
        return ""
    text = (f"\nnote: the cache's reference log-probs are {note['cache_dtype']} and the policy computes in "
            f"{note['policy_dtype']}, so they differ by rounding even where the policy is the reference")
    if "step_1_loss" not in note:
        return text
    expected = note["loss_at_reference"]
    if expected is None:  # (an RPO term: no data-free value to compare with)
        return text + f" (step 1's mean per-token log-ratio {note['step_1_logratio']:.2e}, not 0)"
    shown = f"{expected:.6f}"
    named = " = ln 2" if shown == f"{math.log(2):.6f}" else ""  # a label for the digits shown, not a tolerance
    return text + f": step 1's loss is {note['step_1_loss']:.6f}, not {shown}{named}"


# options of TRL / transformers or of precompute-ref that train-dpo has not: what to give instead (runtime.cli.Command)
ELSEWHERE = {"--" + k.replace("_", "-"): f"{why}: give --{now.replace('_', '-')} instead" for k, (now, why) in RENAMED.items()}
ELSEWHERE["--out"] = "train-dpo writes to --output-dir DIR (--out is precompute-ref's, for the cache)"


@click.command(cls=GroupedCommand, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
               elsewhere=ELSEWHERE)
@click.option("--config", "config_file", type=Location("input", local=click.Path(exists=True, dir_okay=False)),
              help="YAML or JSON file of these options (snake_case or kebab-case keys), or a TRL DPOConfig / "
                   "`trl dpo` YAML; the command line overrides it.")
@dataclass_options(TrainConfig, enforce_required=False, aliases=TRL_ALIASES)
@dataclass_options(LoraOptions)
@spec_options(TRAINER_SPECS)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(config_file, debug, **given):
    """Train a policy with DPO against a verified reference cache (the reference model is never loaded), or
    against a live reference with --ref-model and no --ref-cache."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    resolved = []

    def body():
        from .recipe import run_train

        resolved.append(resolve_config(config_file, given))  # a refused command line needs no model library
        quiet_libraries()
        summary = run_train(resolved[0], log=lambda m: echo(m, err=True))
        from runtime.distributed import Dist

        if Dist.joined().rank == 0:  # one summary per job, not one per torchrun process
            echo(summary_text(summary))

    run_cli(body, debug, next_step=lambda: next_step(resolved[0] if resolved else None, config_file, given),
            writes_to=lambda: resolved[0].output_dir if resolved else None)


def command_line(config_file, given: dict, **changes) -> str:
    """The train-dpo command line of these options (`given`: click's values; `changes`: options to set, None to
    drop one)."""
    return command_text("train-dpo", {**given_values(given), **changes},
                        ("--config", config_file) if config_file else ())


def next_step(cfg, config_file, given: dict) -> str:
    """After Ctrl-C (or a full disk): the command that resumes this run from its latest complete checkpoint, or,
    with none saved yet, the one that starts it again."""
    from .outdir import at_last_step
    from .resume import resumable

    if cfg is None or cfg.run_id is None:  # --output-dir not written yet
        return "nothing was saved to --output-dir yet; re-run the same command"
    latest = resumable(Path(cfg.output_dir), cfg.run_id)
    # a value from --config is overridden on the command line; one given there is replaced
    if latest and at_last_step(latest[-1], cfg.max_steps) is not None:  # only the final save was cut
        return (f"{latest[-1].name} holds the run's last step ({cfg.max_steps} of --max-steps {cfg.max_steps}); only "
                "the final save was interrupted, so there is nothing to resume: its weights are the run's final "
                "model's (load them from there)")
    if latest:
        again = command_line(config_file, given, resume_from_checkpoint=str(latest[-1]),
                             overwrite_output_dir=False if cfg.overwrite_output_dir else None)
        return f"{latest[-1].name} is the latest complete checkpoint; resume from it with\n  {again}"
    again = command_line(config_file, given, overwrite_output_dir=True,
                         resume_from_checkpoint="false" if cfg.resume_from_checkpoint else None)
    return (f"no checkpoint was saved yet, so there is nothing to resume; start again into the same --output-dir "
            f"with\n  {again}")


def process_main():
    """The console script and `python -m dpo.cli`: the command as the whole process, without the interpreter's
    teardown at exit (runtime.cli.exit_without_teardown)."""
    exit_without_teardown(main)


if __name__ == "__main__":
    process_main()
