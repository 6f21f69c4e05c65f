"""train-dpo's --config file: YAML (read with YAML 1.2's core schema, as TRL's configs are written) or JSON, of
train-dpo's keys or a TRL `DPOConfig` / `trl dpo` recipe (TRL's names mapped onto ours, its keys at TRL's default
ignored, the others refused naming them); every value checked by its option's own type, as on the command line."""

from __future__ import annotations

import dataclasses

import click

from runtime.options import TRL_ALIASES
from runtime.placed import Placement, group_options, prefix_of
from runtime.terminal import echo
from runtime.config_file import FileValues, converted, read_mapping

from .config import TrainConfig
from .options import OURS, SPECS, TRAINER

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
    if isinstance(value, (dict, list)) and kind is str and not multiple:
        return value  # a dict/list-valued TrainingArguments option (fsdp_config, lr_scheduler_kwargs, ...)
    return converted(path, key, kind, value, multiple=multiple, given_as=given_as)


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
    """The keys under our names, and {our name: the TRL name it was given as} (read_mapping has kept one key of
    each option: TRL's name and ours both given is refused there, unless both give the same value)."""
    out, given_as = {}, {}
    for key, value in data.items():
        name = TRL_ALIASES.get(key, key)
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


# keys of older TRL / transformers configs that transformers 5 folded into another option: how to say it now
# (the option now, why); the command line says the same (dpo/cli.py ELSEWHERE)
RENAMED = {"warmup_ratio": ("warmup_steps", "transformers 5 reads a ratio from warmup_steps (a number below 1 is a share "
                                            "of the steps)")}


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
        moved = "".join(f"; {k}: {RENAMED[k][1]}: give {RENAMED[k][0]}: {data[k]}" for k in unsupported if k in RENAMED)
        raise click.UsageError(
            f"{path}: unknown option(s) {', '.join(unsupported)} (refcache does not support these DPOConfig / trl "
            f"keys, or they are misspelt; see `train-dpo --help` and README 'Coming from TRL'){moved}")
    echo(f"note: {path}: ignoring {len(inert)} DPOConfig / trl keys at TRL's default: {', '.join(inert)}",
               err=True)
    return {k: v for k, v in data.items() if k not in inert}, given_as


def load_config_file(path) -> dict:
    path = str(path)
    # runtime/config_file.py: the one reader of a config file, which refuses an option given twice under TRL's name
    mapping = read_mapping(path, lambda key: TRL_ALIASES.get(key, key))
    data, given_as = _from_trl(path, mapping)
    return FileValues({key: _convert(path, key, value, given_as.get(key)) for key, value in data.items()
                       if value is not None},
                      {key: mapping.written.get(given_as.get(key) or key, given_as.get(key) or key) for key in data})
