"""Command line of train-dpo, generated: every TrainConfig field is an option, and so is every
`transformers.TrainingArguments` field it does not define (new transformers options appear by themselves). Both
spellings work (--learning-rate, --learning_rate). --config takes a YAML or JSON file of the same keys, or a TRL
`DPOConfig` / `trl dpo` YAML; options given on the command line override the file."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import click

from runtime import kl_control
from runtime.cli import (GroupedCommand, command_text, exit_without_teardown, given_values, number_text,
                         quiet_libraries, run_cli)
from runtime.locations import Location
from runtime.options import TRL_ALIASES, dataclass_options, option_specs, spec_options
from runtime.placed import Placement, group_options, prefix_of
from runtime.terminal import echo

from .lora import LoraOptions
from .loss_config import unread_message, unread_options
from .config import TrainConfig
from .trainer_options import trainer_specs

LORA = {f.name: f for f in dataclasses.fields(LoraOptions)}
OURS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.metadata.get("cli") is not False} | LORA
# TrainingArguments fields that are not options: ours under the same name, the ones the recipe must set itself,
# and `debug` (our --debug shows tracebacks).
NOT_TRAINER_OPTIONS = set(OURS) | {"remove_unused_columns", "debug"}
# the TrainingArguments options, stored per installation (dpo/trainer_options.py): --help and a refusal of the
# command line do not import transformers and torch
TRAINER_SPECS = trainer_specs(NOT_TRAINER_OPTIONS)
TRAINER = {s.name for s in TRAINER_SPECS if not s.name.startswith("_")}
# every option's spec by field name, the one source of its type for the command line and --config alike
SPECS = {s.name: s for s in [*TRAINER_SPECS, *option_specs(LoraOptions),
                             *option_specs(TrainConfig, enforce_required=False, aliases=None)]}
REQUIRED = tuple(name for name, f in OURS.items() if f.metadata.get("required"))
# DPOConfig keys whose job refcache's reference cache does: noted, not refused
REPLACED_BY_CACHE = ("precompute_ref_log_probs", "precompute_ref_batch_size")
# older TRL's DPOConfig.ref_model_init_kwargs (from_pretrained's keyword arguments for the reference): the keys that
# place a live reference are train-dpo's --ref-* options (README, "Coming from TRL")
REF_INIT_KWARGS = {name: prefix_of(TrainConfig, Placement) + name for name in group_options(Placement)}


def _value_type(name: str):
    """The click type (and whether it repeats) of an option, as its command-line option has it: the config file's
    values go through the same checks (choices, parsed text, numeric domains)."""
    spec = SPECS[name]
    return spec.kind, spec.multiple


def _convert(path: str, key: str, value, given_as: str | None = None):
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
        named = f"{given_as} (TRL's name of {key})" if given_as and given_as != key else key
        raise click.UsageError(f"{path}: {named}: {e.message}") from None


def _trl_defaults() -> list[dict]:
    """What TRL's own defaults look like: its classes' field defaults, and a default DPOConfig as `to_dict()` writes
    it (post-init values: pad_to_multiple_of None, debug [])."""
    try:
        import tempfile
        import warnings

        from trl import DPOConfig, ModelConfig, ScriptArguments
    except ImportError:
        return []
    out = [{f.name: f.default for f in dataclasses.fields(c) if f.default is not dataclasses.MISSING}
           for c in (DPOConfig, ModelConfig, ScriptArguments)]
    try:
        with warnings.catch_warnings():  # TrainingArguments' own deprecation notices, about a config we only read
            warnings.simplefilter("ignore")
            out.append(DPOConfig(output_dir=tempfile.gettempdir(), bf16=False, use_cpu=True).to_dict())
    except Exception:  # a TRL whose defaults do not construct here: the class defaults only
        pass
    return out


def _aliased(path: str, data: dict) -> tuple[dict, dict]:
    """The keys under our names, and {our name: the TRL name it was given as}."""
    out, given_as = {}, {}
    for key, value in data.items():
        name = TRL_ALIASES.get(key, key)
        if name in out and out[name] != value:
            raise click.UsageError(f"{path}: {key} is TRL's name of {name}, and both are given, with different "
                                   f"values ({given_as.get(name, name)}: {out[name]!r}, {key}: {value!r}); keep one")
        out[name] = value
        if key != name:
            given_as[name] = key
    return out, given_as


def _one_loss(path: str, data: dict) -> None:
    """TRL 1.16 takes a list of losses (several combined with loss_weights); refcache trains one."""
    if isinstance(data.get("ld_alpha"), list) and len(data["ld_alpha"]) == 1:
        data["ld_alpha"] = data["ld_alpha"][0]
    losses = data.get("loss_type")
    if not isinstance(losses, list):
        return
    weights = data.get("loss_weights")
    if len(losses) == 1:
        data["loss_type"] = losses[0]
        if isinstance(weights, list) and weights == [1]:  # one loss at weight 1: what loss_type alone means
            del data["loss_weights"]
        if losses[0] == "sigmoid" and data.get("label_smoothing"):
            raise click.UsageError(
                f"{path}: loss_type [sigmoid] with label_smoothing {data['label_smoothing']}: TRL 1.16's sigmoid loss "
                "ignores label_smoothing, refcache's is conservative DPO (cDPO) with it, so the run would not be "
                "TRL's; drop label_smoothing for TRL's loss, or write loss_type: sigmoid (not a list) for cDPO")
        return
    if sorted(losses) == ["sft", "sigmoid"]:
        w = dict(zip(losses, weights)) if isinstance(weights, list) and len(weights) == 2 else {"sigmoid": 1,
                                                                                                  "sft": 1}
        ratio = w["sft"] / w["sigmoid"] if w["sigmoid"] else float("inf")
        raise click.UsageError(
            f"{path}: loss_type {losses} (TRL's RPO) is not mapped: TRL's sft term is the NLL averaged over all chosen "
            "tokens of the batch, refcache's rpo_alpha term the per-token mean NLL of each chosen completion averaged "
            "over the pairs (equal only when every chosen completion has the same length), so the run would not be "
            f"TRL's; for refcache's RPO use loss_type: sigmoid and rpo_alpha: {ratio:g} (the sft weight over the "
            "sigmoid weight; --rpo-alpha on the command line) and drop loss_weights")
    raise click.UsageError(f"{path}: loss_type {losses}: refcache trains one preference loss (combining several with "
                           "loss_weights is not supported); give one of them")


def _ref_init_kwargs(path: str, data: dict, given_as: dict) -> None:
    """ref_model_init_kwargs' keys of the placement group (runtime/placed.py: device_map, max_memory,
    offload_folder) as train-dpo's --ref-* options (a max_memory mapping {0: "20GiB", "cpu": "60GiB"} in the option's
    DEVICE=SIZE form); any other key, and a device map that is not a splitting strategy, refused naming it.
    model_init_kwargs (TRL 1.16: the policy's and the reference's) is refused pointing here: refcache places the
    policy itself."""
    from runtime.placement import DEVICE_MAPS

    where = "ref_model_init_kwargs"
    keys, flags = _listed(REF_INIT_KWARGS), _listed(f"--{o.replace('_', '-')}" for o in REF_INIT_KWARGS.values())
    if data.get("model_init_kwargs"):
        raise click.UsageError(
            f"{path}: model_init_kwargs: TRL 1.16 loads the policy and the reference with it; refcache places the "
            f"policy itself (the accelerator, or --use-cpu) and loads it in --model-dtype, and splits a live reference "
            f"with {flags} (or the same keys under {where}); move {keys} there, and drop model_init_kwargs")
    data.pop("model_init_kwargs", None)
    kwargs = data.pop(where, None)
    if kwargs is None or kwargs == {}:
        return
    if not isinstance(kwargs, dict):
        raise click.UsageError(f"{path}: {where} is {type(kwargs).__name__}; expected a mapping of "
                               f"from_pretrained's keyword arguments ({', '.join(REF_INIT_KWARGS)})")
    other = [str(k) for k in kwargs if k not in REF_INIT_KWARGS]
    if other:
        raise click.UsageError(
            f"{path}: {where}: {', '.join(other)}: not mapped; refcache maps {keys} (to {flags}); the reference is "
            "loaded in the training dtype (--bf16 / --fp16, else --model-dtype) and with --trust-remote-code: drop the "
            "other keys")
    for key, option in REF_INIT_KWARGS.items():
        if key not in kwargs:
            continue
        value = kwargs[key]
        if key == "device_map" and value not in DEVICE_MAPS:
            raise click.UsageError(
                f"{path}: {where}.device_map {value!r} names a device, not a splitting strategy: refcache's live "
                f"reference goes on the policy's device; to split it give one of {', '.join(DEVICE_MAPS)} (with "
                "max_memory for each device), or drop device_map")
        if key == "max_memory" and isinstance(value, dict):
            value = ",".join(f"{device}={size}" for device, size in value.items())
        if option in data and data[option] != value:
            raise click.UsageError(f"{path}: {where}.{key} and {option} are both given, with different values "
                                   f"({data[option]!r}, {value!r}); keep one")
        data[option] = value
        given_as[option] = f"{where}.{key}"


def _listed(words) -> str:
    """a, b and c."""
    words = list(words)
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else "".join(words)


def _from_trl(path: str, data: dict) -> tuple[dict, dict]:
    """Map TRL's spellings onto ours; refuse DPOConfig keys we do not support unless they hold TRL's default.
    Returns the values and {our name: the TRL name it was given as}."""
    data, given_as = _aliased(path, data)
    _ref_init_kwargs(path, data, given_as)
    # to_dict() writes every *_token field as "<NAME_TOKEN>": a placeholder, not a value
    redacted = [k for k, v in data.items() if k.endswith("_token") and v == f"<{k.upper()}>"]
    _one_loss(path, data)
    if isinstance(data.get("report_to"), list):  # TrainingArguments' list form
        data["report_to"] = ",".join(map(str, data["report_to"])) or "none"
    replaced = [k for k in REPLACED_BY_CACHE if k in data and data[k] not in (None, False)]
    if replaced:
        echo(f"note: {path}: {', '.join(replaced)}: refcache's reference cache replaces this (precompute-ref "
                   "computes the reference log-probs once; train-dpo --ref-cache reads them); ignored", err=True)
    data = {k: v for k, v in data.items() if k not in redacted and k not in replaced}
    unknown = sorted(set(data) - set(OURS) - set(TRAINER))
    if not unknown:
        return data, given_as
    defaults = _trl_defaults()
    inert = [k for k in unknown if any(k in d and data[k] == d[k] for d in defaults)]
    unsupported = [k for k in unknown if k not in inert]
    if unsupported:
        raise click.UsageError(
            f"{path}: unknown option(s) {', '.join(unsupported)} (refcache does not support these DPOConfig / trl "
            "keys, or they are misspelt; see `train-dpo --help` and README 'Coming from TRL')")
    echo(f"note: {path}: ignoring {len(inert)} DPOConfig / trl keys at TRL's default: {', '.join(inert)}",
               err=True)
    return {k: v for k, v in data.items() if k not in inert}, given_as


def yaml_12(text: str):
    """YAML read with the core schema of YAML 1.2 (what TRL's YAML configs are written for), not PyYAML's YAML 1.1:
    `kl_target: 1:2` stays the text "1:2" (1.1 reads it as 62, base 60), `on`/`yes`/`no` stay words, `010` is ten and
    `1e-6` a number; every value then goes through its option's own type as on the command line (`_convert`)."""
    import re

    import yaml

    class Core12Loader(yaml.SafeLoader):
        pass

    Core12Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag.rsplit(":", 1)[-1] not in ("bool", "int", "float")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    core = {"bool": (r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
            "int": (r"^[-+]?[0-9]+$", list("-+0123456789")),
            "float": (r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                      r"|\.(?:nan|NaN|NAN))$", list("-+.0123456789"))}
    for kind, (pattern, first) in core.items():
        Core12Loader.add_implicit_resolver(f"tag:yaml.org,2002:{kind}", re.compile(pattern), first)
    Core12Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(loader.construct_scalar(node)))
    return yaml.load(text, Loader=Core12Loader)  # a SafeLoader: plain data only, no object ever built


def load_config_file(path) -> dict:
    import yaml

    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text) if path.endswith(".json") else yaml_12(text)
    except (ValueError, yaml.YAMLError) as e:  # ValueError: JSON errors and UnicodeDecodeError
        detail = " ".join(str(e).split())
        raise click.UsageError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'} ({detail})") from None
    if not isinstance(data, dict):
        raise click.UsageError(f"{path}: expected a mapping of option names to values")
    data, given_as = _from_trl(path, {k.replace("-", "_"): v for k, v in data.items()})
    return {key: _convert(path, key, value, given_as.get(key)) for key, value in data.items() if value is not None}


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
    plot = f"\n  plot:       {out / 'metrics.png'}" if (out / "metrics.png").is_file() else ""
    merged = f"\n  merged:     {s['merged_dir']}" if s.get("merged_dir") else ""
    return (
        f"trained {s['steps']} step{'s' * (s['steps'] != 1)} in {s['train_s']:.1f} s{verified}; {loss}"
        + (f"; eval reward accuracy {acc:.3f} (share of eval pairs whose implicit reward beta*log(pi/ref) "
           "ranks chosen above rejected)" if acc is not None else "")
        + f"\n  checkpoint: {out}{kept}{merged}\n  metrics:    {out / 'metrics.jsonl'}{plot}"
        f"\n  manifest:   {out / 'run-manifest.json'}"
        + (f"\n  card:       {out / 'README.md'}" if (out / "README.md").is_file() else "")
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


@click.command(cls=GroupedCommand, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
