"""Command line of train-dpo. Every TrainConfig field is an option (`--learning-rate`, `--max-steps`, ...) and a key
of the optional --config file (YAML or JSON); options given on the command line override the file."""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from pathlib import Path

import click

from runtime.cli import quiet_libraries, run_cli
from schemas.encoding import CHAT_TEMPLATE_MODES, TRUNCATION_MODES

from .losses import LOSS_TYPES
from .recipe import TrainConfig

HELP = {
    "model": "Policy checkpoint to start from (in standard DPO also the reference the cache was computed with).",
    "data": "Training preference data (file, folder or save_to_disk folder), encoded exactly as the cache was.",
    "output_dir": "Where checkpoints, metrics.jsonl, metrics.png and run-manifest.json go.",
    "ref_cache": "Cache written by precompute-ref; verified before use.",
    "ref_model": "Reference checkpoint: with --ref-cache it is only hashed (never loaded); without, live-reference mode.",
    "ref_model_hash": "Model hash the cache must carry, when the reference differs from --model and is not at hand.",
    "split": "Split of --data to train on.",
    "eval_data": "Evaluation preference data.",
    "eval_split": "Split of --eval-data.",
    "eval_ref_cache": "Cache holding the eval rows [default: --ref-cache].",
    "max_length": f"Must agree with the cache's value [default: the cache's].",
    "truncation_mode": f"One of {', '.join(TRUNCATION_MODES)}; must agree with the cache [default: the cache's].",
    "chat_template": f"One of {', '.join(CHAT_TEMPLATE_MODES)}; must agree with the cache [default: the cache's].",
    "on_bad_row": "error or skip rows the encoder rejects.",
    "fast_verify": "Skip the shard file sha256 check (stamps, rows and values are still verified).",
    "beta": "DPO beta (strength of the pull towards the reference).",
    "loss_type": f"One of {', '.join(LOSS_TYPES)}.",
    "label_smoothing": "Label noise e for sigmoid (cDPO) and robust losses.",
    "rpo_alpha": "Weight of the SFT (NLL) term on chosen completions (RPO); 0 disables it.",
    "ld_alpha": "LD-DPO: weight of tokens past the shorter completion's length; 1 disables it.",
    "fsdp": "FSDP mode for transformers.TrainingArguments, e.g. 'full_shard auto_wrap' (under torchrun).",
    "fsdp_config": "FSDP config JSON file (transformers.TrainingArguments.fsdp_config).",
    "deepspeed": "DeepSpeed config JSON file (needs the deepspeed package; under torchrun or deepspeed).",
    "report_to": "Comma-separated trackers (tensorboard, wandb, ...) or none.",
    "trust_remote_code": "Allow custom model code from checkpoint folders.",
    "plot": "Write metrics.png at the end.",
    "batch_layout": "auto, padded or prefix_shared (each prompt once per pair, pairs packed, tree mask; auto takes it "
                    "when it is less work and matches the plain forward on a probe).",
    "config": "YAML or JSON file with any of these options (snake_case or kebab-case keys).",
}
CHOICES = {"loss_type": LOSS_TYPES, "truncation_mode": TRUNCATION_MODES, "chat_template": CHAT_TEMPLATE_MODES,
           "on_bad_row": ("error", "skip"), "batch_layout": ("auto", "padded", "prefix_shared")}
REQUIRED = ("model", "data", "output_dir")


def _click_type(field: dataclasses.Field):
    if field.name in CHOICES:
        return click.Choice(CHOICES[field.name])
    hint = str(field.type)
    if field.name.endswith(("_dir", "_cache", "_data")) or field.name in ("model", "data", "ref_model"):
        return click.Path()
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if hint.startswith(name):
            return kind
    return str


def config_options(f):
    """One click option per TrainConfig field, default None so file values and real defaults can be merged."""
    for field in reversed(dataclasses.fields(TrainConfig)):
        flag = "--" + field.name.replace("_", "-")
        default = "" if field.name in REQUIRED else f" [default: {field.default}]"
        text = HELP.get(field.name, f"transformers.TrainingArguments.{field.name}.") + default
        if _click_type(field) is bool:
            f = click.option(f"{flag}/--no-{flag[2:]}", field.name, default=None, help=text)(f)
        else:
            f = click.option(flag, field.name, type=_click_type(field), default=None, help=text)(f)
    return f


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
    data = {k.replace("-", "_"): v for k, v in data.items()}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise click.UsageError(f"{path}: unknown option(s) {', '.join(unknown)}")
    # Convert and check values as the command line does: YAML 1.1 reads `1e-6` as a string, and a wrong type or an
    # unknown choice should be a usage error here, not a TypeError deep inside training.
    for key, value in data.items():
        if value is not None:
            try:
                data[key] = click.types.convert_type(_click_type(fields[key])).convert(value, None, None)
            except click.BadParameter as e:
                raise click.UsageError(f"{path}: {key}: {e.message}") from None
    return data


def resolve_config(config_file: str | None, given: dict) -> TrainConfig:
    values = load_config_file(config_file) if config_file else {}
    values.update({k: v for k, v in given.items() if v is not None})
    missing = [f"--{k.replace('_', '-')}" for k in REQUIRED if not values.get(k)]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (on the command line or in --config)")
    return TrainConfig(**values)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), help=HELP["config"])
@config_options
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(config_file, debug, **given):
    """Train a policy with DPO against a verified reference cache (the reference model is never loaded), or
    against a live reference with --ref-model and no --ref-cache."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def body():
        from .recipe import run_train

        quiet_libraries()
        cfg = resolve_config(config_file, given)
        s = run_train(cfg, log=lambda m: click.echo(m, err=True))
        acc = s["eval"].get("eval_rewards/accuracies")
        start = s.get("eval_start", {}).get("eval_logps/accuracies")
        out = Path(s["output_dir"])
        click.echo(
            f"trained {s['steps']} steps in {s['train_s']:.1f} s (verification {s['verify_s']:.1f} s); "
            f"train loss {s['train_loss']:.4f}" + (f"; eval preference accuracy {acc:.3f}" if acc is not None else "")
            + (f" (at the start the policy preferred chosen on {start:.3f} of eval pairs)" if start is not None else "")
            + f"\n  checkpoint: {out}\n  metrics:    {out / 'metrics.jsonl'}\n  plot:       {out / 'metrics.png'}"
            f"\n  manifest:   {out / 'run-manifest.json'}"
        )

    run_cli(body, debug)


if __name__ == "__main__":
    main()
