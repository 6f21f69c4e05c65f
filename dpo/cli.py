"""Command line of train-dpo, generated: every TrainConfig field is an option, and so is every
`transformers.TrainingArguments` field it does not define (new transformers options appear by themselves). Both
spellings work (--learning-rate, --learning_rate). --config takes a YAML or JSON file of the same keys, or a TRL
`DPOConfig` / `trl dpo` YAML; options given on the command line override the file."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import click
import transformers

from runtime.cli import GroupedCommand, exit_without_teardown, click_type, dataclass_options, given_values, quiet_libraries, run_cli

from .lora import LoraOptions
from .recipe import TrainConfig

LORA = {f.name: f for f in dataclasses.fields(LoraOptions)}
OURS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.metadata.get("cli") is not False} | LORA
# TrainingArguments fields that are not options: ours under the same name, the ones the recipe must set itself,
# and `debug` (our --debug shows tracebacks).
NOT_TRAINER_OPTIONS = set(OURS) | {"remove_unused_columns", "debug"}
TRAINER = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)
           if f.init and f.name not in NOT_TRAINER_OPTIONS and not f.name.startswith("_")}
REQUIRED = tuple(name for name, f in OURS.items() if f.metadata.get("required"))
# `trl dpo` YAML keys (its ScriptArguments / ModelConfig) that name one of our options
TRL_ALIASES = {"model_name_or_path": "model", "dataset_name": "data", "dataset_train_split": "split",
               "dataset_test_split": "eval_split"}


def _value_type(name: str):
    import typing

    if name in OURS:
        f = OURS[name]
        if "choices" in f.metadata:
            return click.Choice([str(c) for c in f.metadata["choices"]]), False
        return click_type(typing.get_type_hints(LoraOptions if name in LORA else TrainConfig)[name])
    return click_type(typing.get_type_hints(transformers.TrainingArguments)[name])


def _convert(path: str, key: str, value):
    """A file value converted and checked as the command line does (YAML 1.1 reads `1e-6` as a string)."""
    kind, multiple = _value_type(key)
    if value is None:
        return None
    if value is False and (key.endswith("_strategy") or isinstance(kind, click.Choice) and "no" in kind.choices):
        value = "no"  # YAML 1.1 reads an unquoted `eval_strategy: no` as false
    try:
        if multiple:
            values = value if isinstance(value, list) else [value]
            return [click.types.convert_type(kind).convert(v, None, None) for v in values]
        if isinstance(value, (dict, list)) and kind is str:
            return value  # a dict/list-valued TrainingArguments option (fsdp_config, lr_scheduler_kwargs, ...)
        return click.types.convert_type(kind).convert(value, None, None)
    except click.BadParameter as e:
        raise click.UsageError(f"{path}: {key}: {e.message}") from None


def _from_trl(path: str, data: dict) -> dict:
    """Map TRL's spellings onto ours; refuse DPOConfig keys we do not support unless they hold TRL's default."""
    data = {TRL_ALIASES.get(k, k): v for k, v in data.items()}
    for key in ("loss_type", "ld_alpha"):  # TRL 1.16 takes lists (one loss, or several with loss_weights)
        if isinstance(data.get(key), list) and len(data[key]) == 1:
            data[key] = data[key][0]
    unknown = sorted(set(data) - set(OURS) - set(TRAINER))
    if not unknown:
        return data
    try:
        from trl import DPOConfig

        defaults = {f.name: f.default for f in dataclasses.fields(DPOConfig) if f.default is not dataclasses.MISSING}
    except ImportError:
        defaults = {}
    inert = [k for k in unknown if k in defaults and data[k] == defaults[k]]
    unsupported = [k for k in unknown if k not in inert]
    if unsupported:
        raise click.UsageError(
            f"{path}: unknown option(s) {', '.join(unsupported)} (refcache does not support these DPOConfig / trl "
            "keys, or they are misspelt; see `train-dpo --help` and README 'Coming from TRL')")
    click.echo(f"note: {path}: ignoring DPOConfig keys at TRL's default: {', '.join(inert)}", err=True)
    return {k: v for k, v in data.items() if k not in inert}


def load_config_file(path: str) -> dict:
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:  # ValueError: JSON errors and UnicodeDecodeError
        detail = " ".join(str(e).split())
        raise click.UsageError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'} ({detail})") from None
    if not isinstance(data, dict):
        raise click.UsageError(f"{path}: expected a mapping of option names to values")
    data = _from_trl(path, {k.replace("-", "_"): v for k, v in data.items()})
    return {key: _convert(path, key, value) for key, value in data.items() if value is not None}


def resolve_config(config_file: str | None, given: dict) -> TrainConfig:
    values = load_config_file(config_file) if config_file else {}
    values.update(given_values(given))
    missing = [f"--{k.replace('_', '-')}" for k in REQUIRED if not values.get(k)]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (on the command line or in --config)")
    trainer = {k: values.pop(k) for k in list(values) if k in TRAINER}
    lora = {k: values.pop(k) for k in list(values) if k in LORA}
    return TrainConfig(**values, training_args=trainer, lora=LoraOptions(**lora), config_file=config_file)


def summary_text(s: dict) -> str:
    acc = s["eval"].get("eval_rewards/accuracies")
    out = Path(s["output_dir"])
    return (
        f"trained {s['steps']} steps in {s['train_s']:.1f} s (verification {s['verify_s']:.1f} s); "
        f"train loss {s['train_loss']:.4f}"
        + (f"; eval reward accuracy {acc:.3f} (share of eval pairs whose implicit reward beta*log(pi/ref) "
           "ranks chosen above rejected)" if acc is not None else "")
        + f"\n  checkpoint: {out}\n  metrics:    {out / 'metrics.jsonl'}\n  plot:       {out / 'metrics.png'}"
        f"\n  manifest:   {out / 'run-manifest.json'}"
    )


@click.command(cls=GroupedCommand, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False),
              help="YAML or JSON file of these options (snake_case or kebab-case keys), or a TRL DPOConfig / "
                   "`trl dpo` YAML; the command line overrides it.")
@dataclass_options(TrainConfig, enforce_required=False)
@dataclass_options(LoraOptions)
@dataclass_options(transformers.TrainingArguments, group="Training (every other transformers.TrainingArguments)",
                   skip=NOT_TRAINER_OPTIONS)
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(config_file, debug, **given):
    """Train a policy with DPO against a verified reference cache (the reference model is never loaded), or
    against a live reference with --ref-model and no --ref-cache."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    resolved = []

    def body():
        from .recipe import run_train

        quiet_libraries()
        resolved.append(resolve_config(config_file, given))
        summary = run_train(resolved[0], log=lambda m: click.echo(m, err=True))
        from runtime.distributed import Dist

        if Dist.joined().rank == 0:  # one summary per job, not one per torchrun process
            click.echo(summary_text(summary))

    run_cli(body, debug, next_step=lambda: next_step(resolved[0] if resolved else None, config_file, given),
            writes_to=lambda: resolved[0].output_dir if resolved else None)


def command_line(config_file, given: dict, **changes) -> str:
    """The train-dpo command line of these options (`given`: click's values; `changes`: options to set, None to
    drop one)."""
    import shlex

    values = {**given_values(given), **changes}
    words = ["train-dpo"] + (["--config", config_file] if config_file else [])
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag[2:]}")
        else:
            for v in value if isinstance(value, list) else [value]:
                words += [flag, str(v)]
    return " ".join(shlex.quote(w) for w in words)


def next_step(cfg, config_file, given: dict) -> str:
    """After Ctrl-C (or a full disk): the command that resumes this run from its latest complete checkpoint, or,
    with none saved yet, the one that starts it again."""
    from .resume import resumable

    if cfg is None or cfg.run_id is None:  # --output-dir not written yet
        return "nothing was saved to --output-dir yet; re-run the same command"
    latest = resumable(Path(cfg.output_dir), cfg.run_id)
    # a value from --config is overridden on the command line; one given there is replaced
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
