"""precompute-ref's options (PrecomputeConfig: every field is one) and the refusals the options alone show.

Nothing here imports a model library: the command line builds its options and --help from this module, and refuses a
bad command line, before precompute/job.py (torch, transformers, datasets) is imported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace

import click

from runtime.budget import DEFAULT_TOKEN_BUDGET, parse_token_budget
from runtime.locations import check_present, read_locations
from runtime.options import ENCODING_OPTIONS, field_help, option_specs
from runtime.errors import JobError
from runtime.hub import origin
from runtime.paths import check_apart
from runtime.placed import ATTENTION, Attention, Placement, included
from runtime.terminal import clipped, escaped
from storage import places
from storage.reads import record_bytes
from schemas.encoding import EncodingConfig, RecordedEncodingError

from .modes import REGISTRY, batching_help


@dataclass
@included(Attention, after="tp_size", section="Computation")
@included(Placement, after="device", section="Computation", notes={"device_map": (
    "For a reference larger than one device; not with --device. The numbers are the model's own: batching modes "
    "are probed on the split model.")})
class PrecomputeConfig:
    """Every field is a precompute-ref option (precompute/cli.py generates them); the metadata is its --help text."""

    model: str = field(metadata=field_help(
        "Reference checkpoint: a folder (safetensors weights, config.json, tokenizer) or a hub id in the local "
        "Hugging Face cache.", "Model", required=True, location="input", present="checkpoint"))
    data: str = field(metadata=field_help(
        "Preference data: a .jsonl/.json/.parquet/.csv file, a folder of them, a save_to_disk folder, or a hub "
        "data set id in the local Hugging Face cache.", "Data", required=True, location="input", present="data"))
    out: str = field(default="ref-cache", metadata=field_help(
        "Cache directory to write: a local folder, or a prefix on an object store (s3://bucket/prefix, gs://, "
        "az://).", "Output", click_type=click.Path(file_okay=False), location="output", store=True))
    adapter: str | None = field(default=None, metadata=field_help(
        "peft LoRA adapter folder merged into --model: the reference is base + adapter (e.g. an SFT LoRA that "
        "train-dpo --init-adapter starts from); the model hash covers both.", "Model",
        click_type=click.Path(exists=True, file_okay=False), location="input"))
    split: str = field(default="train", metadata=field_help(
        "Split to read: a file or folder named after it (train, test/eval, validation, as datasets.load_dataset "
        "resolves them) or a DatasetDict split.", "Data"))
    data_config: str | None = field(default=None, metadata=field_help(
        "For a data folder or hub data set whose dataset card (README.md) has `configs`: the config to read, as "
        "datasets.load_dataset(DATA, NAME) takes it (default: the card's default config). Only the files it chooses "
        "are read; the config and its files are recorded in the manifest.", "Data", metavar="NAME"))
    encoding: EncodingConfig = field(default_factory=EncodingConfig, metadata={"cli": False})  # its own options
    token_budget: int | str = field(default=DEFAULT_TOKEN_BUDGET, metadata=field_help(
        "Padded tokens per forward batch (batch size x longest sequence), or auto: on CUDA sized from the memory "
        "free after loading the model and the model's shapes (hidden size, layers, vocabulary, dtype; kv_cache's "
        f"keys and values), logged and recorded; on CPU auto keeps {DEFAULT_TOKEN_BUDGET}, lowered only when the "
        "available memory is short.", "Computation", parse=parse_token_budget, metavar="TOKENS|auto"))
    rows_per_shard: int = field(default=2048, metadata=field_help("Pairs per Parquet shard.", "Output",
                                                                domain="count"))
    dtype: str = field(default="auto", metadata=field_help(
        "Reference precision; auto is bfloat16 on CUDA and float32 on CPU.", "Computation",
        choices=("auto", "float32", "bfloat16", "float16")))
    device: str = field(default="auto", metadata=field_help(
        "auto (CUDA device LOCAL_RANK if present, else CPU), cpu, cuda, cuda:N.", "Computation"))
    tp_size: int = field(default=1, metadata=field_help(
        "Tensor parallelism under torchrun: each group of N consecutive ranks loads one copy of the model split N "
        "ways by the tensor-parallel plan transformers has for the architecture (refused for one without a plan) "
        "and scores its shards together; groups share the shards out as ranks do. WORLD_SIZE must be a multiple "
        "of N. Not with --device, --adapter, --torch-compile or --device-map. Batching modes are probed on the "
        "split model.", "Computation", domain="count", metavar="N"))
    batching: str = field(default="auto", metadata=field_help(batching_help(), "Computation",
                                                          choices=("auto", *REGISTRY)))
    top_k: int = field(default=0, metadata=field_help(
        "Also store, for every completion token, the reference's K most probable token ids, their log-probs and "
        "the log of the probability mass outside them (the tail), from the same forward: what train-dpo's KL "
        "figures and token-level losses read. 0: only the log-prob of each completion token. Size, measured on "
        "data/ (README): about 7 bytes per completion token at K = 0, 31 at K = 8, 86 at K = 32, 288 at K = 128 "
        "(2 to 3 bytes per K per completion token).", "Computation",
        domain="natural"))
    torch_compile: bool | None = field(default=None, metadata=field_help(
        "Compile the scoring forward with torch.compile (dynamic shapes): used only where it reproduces the model's "
        "own eager forward on the probe of the job's pairs, else the job scores uncompiled and says why. Neither "
        "flag (auto): the job starts eager and, after its first batches (4, and 10 s of scoring), compiles when the "
        "rest of its eager scoring, estimated from their measured rate, would save more than compiling costs "
        "(measured on CPU: past about 10 minutes of eager scoring with a warm inductor cache, 25 cold; the caches "
        "are kept in refcache's home); a job done sooner stays eager; a split model scores uncompiled. The choice "
        "is logged; where one was made the manifest notes computation.compile_choice and compiled (and "
        "compiled_from); the cache is the same either way. Needs a C++ compiler on CPU.", "Computation", show_default="auto"))
    overwrite: bool = field(default=False, metadata=field_help(
        "Delete the existing cache first (default: resume, keeping finished shards of this same job).", "Output"))
    update: bool = field(default=False, metadata=field_help(
        "Bring the finished cache in --out to this --data (grown, shrunk or changed), with the cache's model, "
        "tokenizer, encoding and settings: keep the shards whose rows are unchanged, score only the new rows, and "
        "write a new manifest version listing the rows added and removed (the previous manifest is kept as "
        "manifest-NNNNN.json, so runs trained on it still audit). Rows whose content changed under the same id are "
        "refused unless --replace-changed.", "Output"))
    replace_changed: bool = field(default=False, metadata=field_help(
        "With --update: score again the rows whose content changed under an id the cache holds, replacing them.",
        "Output"))
    on_bad_row: str = field(default="error", metadata=field_help(
        "error: stop at the first bad row (exit 2). skip: leave it out and list it in skipped.jsonl.", "Data",
        choices=("error", "skip")))
    trust_remote_code: bool = field(default=False, metadata=field_help(
        "Allow custom model code from the checkpoint folder.", "Model"))
    progress: bool = field(default=True, metadata=field_help("Show the progress bar.", "Output"))
    # the options given on the command line (precompute/cli.py); None (a config built in code): those at their default
    # are taken as not given. --update takes the cache's settings for those not given (cache_settings)
    given: frozenset | None = field(default=None, metadata={"cli": False})
    config_file: str | None = field(default=None, metadata={"cli": False, "location": "input"})  # --config: an input

    def __post_init__(self):
        read_locations(self)


# --update: what a cache records of how it was made (manifest `computation` key -> option), taken from the cache for
# every option not given; one given that differs is refused naming the option and the recorded value
# (precompute/update.py). Not the device: a cache made on CUDA updated on a CPU machine is refused naming --device.
RECORDED_SETTINGS = {"rows_per_shard": "rows_per_shard", "top_k": "top_k", "dtype": "dtype",
                     "token_budget": "token_budget", "requested_attn_implementation": "attn_implementation",
                     "requested_batching": "batching"}
# what an `auto` setting chose, as the cache records it (computation key): given by name, it is the cache's own
AUTO_CHOSE = {"attn_implementation": "attn_implementation", "batching": "mode"}
OPTION_OF = {**{k: "--" + v.replace("_", "-") for k, v in RECORDED_SETTINGS.items()}, "device_type": "--device"}


def _given(cfg: PrecomputeConfig, holder, name: str, default) -> bool:
    return name in cfg.given if cfg.given is not None else getattr(holder, name) != default


def recorded_settings(out) -> tuple[str, dict, dict, EncodingConfig] | None:
    """How the rows already in --out were scored: (whose, the settings as their options take them (_recorded_values),
    computation, encoding) from a
    finished cache's manifest, or, where an interrupted first run left shards and no manifest, from its first readable
    shard's footer; None when --out holds neither (or nothing readable: the job's own checks name it). A record
    holding a value refcache never writes (an encoding outside its domain, a computation that is not a mapping) is a
    damaged cache, refused (JobError)."""
    from schemas import format as fmt  # pyarrow: not on the --help path

    try:
        if (out / fmt.MANIFEST).exists():
            manifest = json.loads(record_bytes(out / fmt.MANIFEST))
            where, whose = str(out / fmt.MANIFEST), "the cache's"
            computation, encoding = manifest.get("computation") or {}, manifest["encoding"]
        else:
            for path in sorted(out.glob("shard-*.parquet")):
                meta = fmt.read_shard_metadata(path)
                if "computation" in meta and "encoding" in meta:
                    where, whose = f"{out / path.name}'s footer", "the interrupted run's"
                    computation, encoding = json.loads(meta["computation"]), json.loads(meta["encoding"])
                    break
            else:
                return None
    except Exception:  # missing, unreadable, not ours: the resume and the update name it
        return None
    values = check_recorded(out, where, computation, encoding)
    try:
        return whose, values, computation, EncodingConfig.from_dict(encoding)
    except Exception:  # not a record of this version (no add_bos, unknown keys): the resume and the update name it
        return None


def check_recorded(out, where: str, computation, encoding=None) -> dict:
    """Refuse (JobError) a record of how rows were scored (`where`: a manifest, or a shard's footer) that holds a
    value precompute-ref never writes: a computation setting its option's type and domain refuse (_recorded_values),
    or an encoding value outside EncodingConfig's (RecordedEncodingError). Everything else is left to the rules.
    Returns the settings as their options take them."""
    if not isinstance(computation, dict):
        raise _damaged(out, f"{where}: computation is {computation!r}, not a mapping of settings")
    values = _recorded_values(out, where, computation)
    if isinstance(encoding, dict):
        try:
            EncodingConfig.from_dict(encoding)
        except RecordedEncodingError as e:
            raise _damaged(out, f"{where}: {e}") from None
        except (TypeError, ValueError):  # unknown keys, no add_bos: not this version's record; the rules name it
            pass
    return values


class DamagedRecord(JobError):
    """A record of how rows were scored that precompute-ref never writes (`what`), refused with the rebuild command."""

    def __init__(self, message: str, what: str):
        super().__init__(message)
        self.what = what


def _damaged(out, what: str, **known) -> DamagedRecord:
    """`what` (the file, the key, the value and why) precompute-ref never writes: the cache is damaged (exit 2), the
    value escaped for the terminal and clipped; the remedy is the command that makes it again (`known`: the model,
    data and split of this run, else the manifest's)."""
    from runtime.remedies import rebuild
    from schemas.history import current_manifest

    return DamagedRecord(clipped(escaped(f"{what}; {rebuild(out, current_manifest(out), **known)}")), what)


_JSON_KIND = {int: "an integer", float: "a float", str: "a string", bool: "a boolean", list: "a list", dict: "a mapping"}


def _recorded_values(out, where: str, computation: dict) -> dict:
    """{option field: value} of RECORDED_SETTINGS that `computation` records, each through its option's own type and
    declared domain exactly as the command line converts it (runtime.config_file.converted); a value it refuses, or
    one it would have to change (4.0 for 4, "4" for 4: precompute-ref writes neither), is a damaged cache."""
    from runtime.config_file import converted

    kinds = {spec.name: spec.kind for spec in option_specs(PrecomputeConfig)}
    values = {}
    for key, name in RECORDED_SETTINGS.items():
        value = computation.get(key)
        if value is None:
            continue
        try:
            taken = converted(where, f"computation {key!r}", kinds[name], value)
        except click.UsageError as e:  # "WHERE: computation 'KEY': the type's reason"
            if name == "attn_implementation" and value in ATTENTION:  # a real kernel, not installed here: no damage
                why = e.message.split("; use one of")[0].split(": ", 2)[-1]
                raise JobError(clipped(escaped(f"{where}: the cache was scored with --attn-implementation {value}, "
                                               f"which cannot load here ({why}); resume it where it loads, or "
                                               "--overwrite to start over"))) from None
            raise _damaged(out, f"{e.message.rstrip('.')} (precompute-ref never records one)") from None
        if type(taken) is not type(value):
            raise _damaged(out, f"{where}: computation {key!r} is {value!r}, not a setting precompute-ref makes (it "
                                f"records {_JSON_KIND.get(type(taken), type(taken).__name__)} there, never {_JSON_KIND.get(type(value), 'that')})")
        if taken != value:
            raise _damaged(out, f"{where}: computation {key!r} is {value!r}, not a setting precompute-ref makes (it "
                                "records the option's own spelling)")
        values[name] = value
    device_type = computation.get("device_type")  # not an option's value (cuda:1 records cuda), named as --device
    if device_type is not None and not (isinstance(device_type, str) and re.fullmatch(r"[a-z]{1,16}", device_type)):
        raise _damaged(out, f"{where}: computation 'device_type' is {device_type!r}, not a setting precompute-ref "
                            "makes (a torch device type: cpu, cuda, ...)")
    return values


def cache_settings(cfg: PrecomputeConfig) -> tuple[str, dict]:
    """A run into an --out that already holds scored rows (--update, or a resume of a finished or interrupted run):
    every setting of RECORDED_SETTINGS and every encoding option not given is set on `cfg` from what --out records
    (recorded_settings), so the new rows are scored exactly as those were; returns (whose, {option: value} of those
    taken). Nothing with --overwrite, or when --out records nothing readable (the update refuses that itself). Every
    value recorded goes through its option's type and domain first (_recorded_values): a damaged one is refused."""
    out = places.location(cfg.out)
    try:
        recorded = None if cfg.overwrite else recorded_settings(out)
    except DamagedRecord as e:  # the rebuild command with this run's model and data
        raise _damaged(out, e.what, model=cfg.model, data=cfg.data, split=cfg.split) from None
    if recorded is None:
        return "", {}
    whose, recorded_values, computation, encoding = recorded
    if cfg.update and whose != "the cache's":
        return "", {}
    defaults = {f.name: f.default for f in fields(PrecomputeConfig)}
    taken = {}
    for name in RECORDED_SETTINGS.values():
        value = recorded_values.get(name, 0 if name == "top_k" else None)  # no top-k recorded: 0 (format.py)
        chose = computation.get(AUTO_CHOSE.get(name, ""))
        if value == "auto" and _given(cfg, cfg, name, defaults[name]) and getattr(cfg, name) == chose:
            # the kernel or mode the cache's auto chose, given by name: the same scoring, so the cache's request
            setattr(cfg, name, value)
            taken["--" + name.replace("_", "-")] = f"auto (the cache's; it chose {escaped(chose)}, as given)"
        elif value is not None and not _given(cfg, cfg, name, defaults[name]) and value != getattr(cfg, name):
            setattr(cfg, name, value)
            taken["--" + name.replace("_", "-")] = value
    fresh = EncodingConfig()
    keep = {f.name: getattr(cfg.encoding, f.name) for f in fields(EncodingConfig)
            if _given(cfg, cfg.encoding, f.name, getattr(fresh, f.name)) and f.metadata.get("cli") is not False}
    chosen = replace(encoding, **keep)
    differ = encoding_options(encoding.to_dict(), chosen.to_dict())
    if differ and whose == "the cache's":  # refused as the setting it is, before any row is encoded by it (a row
        # the cache's encoding took may fail this one's: --chat-template off on conversational rows)
        where = f"the cache {out} was" if cfg.update else f"{out} already holds a different cache,"
        raise JobError(("--update: " if cfg.update else "") + settings_refusal(differ, where, update=cfg.update))
    options = {f.name for f in fields(EncodingConfig) if f.metadata.get("cli") is not False}
    taken |= {"--" + k.replace("_", "-"): v for k, v in chosen.to_dict().items()
              if k in options and k not in keep and getattr(cfg.encoding, k) != v}
    cfg.encoding = chosen
    return whose, taken


def computation_options(findings) -> list[tuple[str | None, object, object]]:
    """rules.computation_findings as (option, the cache's value, this run's); option None where none sets the key."""
    return [(OPTION_OF.get(key), was, (f.found or {}).get(key)) for f in findings for key, was in f.expected.items()]


def encoding_options(cache: dict, run: dict) -> list[tuple[str, object, object]]:
    """The encoding options whose values differ between the cache's encoding and this run's (EncodingConfig dicts,
    which leave out a value at its old default: completion_end eos, no columns), as (option, the cache's value, this
    run's)."""
    def every(d: dict) -> dict:
        defaults = {f.name: f.default for f in fields(EncodingConfig)}
        return defaults | (d if isinstance(d, dict) else {})

    cache, run = every(cache), every(run)
    return [(f"--{k.replace('_', '-')}", v, run.get(k)) for k, v in cache.items()
            if run.get(k) != v and k in ENCODING_OPTIONS]


def settings_refusal(differ: list[tuple[str | None, object, object]], where: str, *, update: bool) -> str | None:
    """A run into --out given settings other than those its rows were made with ((option, the cache's, this run's)),
    as the options a user types ("`where` made with --top-k 8; this run gives --top-k 4"): the two sides by owner and
    the remedy; None where a differing key has no option (the caller words it)."""
    from runtime import remedies  # schemas.history (polars): not on a refused command line's path

    if not differ or any(option is None for option, _, _ in differ):
        return None
    was, uses = [f"{o} {v}" for o, v, _ in differ], [f"{o} {v}" for o, _, v in differ]
    return (f"{where} made with {', '.join(was)}; this run gives {', '.join(uses)}\n  the cache: {' '.join(was)}"
            f"\n  this run:  {' '.join(uses)}\n  remedy:    {remedies.setting(was, update=update)}")


def checked_inputs(cfg: PrecomputeConfig) -> tuple[object, dict, dict]:
    """Refuse what the options alone show, before any model or data is read: (the --out location, {"model", "data"}:
    runtime.hub.origin of each, {option: input path} that no output may touch). cfg.token_budget is written in its
    one form; cfg.model is left as given (the job records the hub id beside the path)."""
    out = places.location(cfg.out)  # a folder, or a prefix on an object store (storage/places.py)
    if cfg.update and cfg.overwrite:
        raise JobError("--update keeps the cache's rows and --overwrite deletes them: pass one of them")
    if cfg.replace_changed and not cfg.update:
        raise JobError("--replace-changed is an option of --update: pass both")
    try:
        cfg.token_budget = parse_token_budget(cfg.token_budget)
    except ValueError as e:
        raise JobError(f"--token-budget: {e}") from None
    try:
        origins = {"model": origin(cfg.model, "model"), "data": origin(cfg.data, "dataset")}
    except JobError:
        check_present(cfg)  # a local path mistyped that reads as a hub id: refused naming the option
        raise
    inputs = {"--model": origins["model"]["path"], "--data": origins["data"]["path"], "--adapter": cfg.adapter,
              "--config": cfg.config_file}
    check_apart(out, "--out", inputs, on_store=True)
    check_present(cfg)  # --model and --data: there, named as given (the option, or --config's file and key)
    return out, origins, inputs
