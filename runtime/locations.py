"""The one click type for a path-or-URL option (`Location`, over storage.places.location) and the reading of a config
dataclass's `location` fields by it (`read_locations`), for every command and config file alike."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import click

from .terminal import escaped, holds_control


class Location(click.ParamType):
    """A path-or-URL option (a field with `location` metadata, the audit's CACHE, train-dpo's --config): its text
    read by the one function that reads places, storage.places.location (a local Path, file:// URLs included, or a
    StorePath), at parse time: a URL it refuses (another host's file://, a protocol chain, another protocol) and a
    store URL where the option takes no store are usage errors (exit 2) naming the option. `role`: "input" or
    "output"; `store`: the option takes a cache on an object store; `local`: a click.Path checking the local path
    (exists, file or folder); `words`: values kept as text (resume_from_checkpoint's `true`); `json_text`: a value
    starting with `{` is JSON text, not a path (DeepSpeed and FSDP configs)."""

    name = "path"

    def __init__(self, role: str, *, store: bool = False, local: click.Path | None = None, words=(),
                 json_text: bool = False):
        if role not in ("input", "output"):
            raise ValueError(f"location role {role!r}: input or output")
        self.role, self.store, self.local, self.words, self.json_text = role, store, local, tuple(words), json_text

    def get_metavar(self, param, ctx=None):
        return ("PATH|URL" if self.store else "PATH") + "".join(f"|{w}" for w in self.words[:1])

    def convert(self, value, param, ctx):
        from storage import places

        if isinstance(value, (places.StorePath, Path)):
            return self._checked(value, param, ctx)
        if isinstance(value, bool) and self.words:  # a config file's `resume_from_checkpoint: true`
            value = str(value).lower()
        if self.json_text and isinstance(value, dict):
            return value
        if not isinstance(value, (str, os.PathLike)):
            self.fail(f"{value!r} is not a path ({type(value).__name__})", param, ctx)
        text = os.fspath(value)
        if holds_control(text):  # other unprintable characters are escaped where shown
            self.fail(f"{escaped(text)}: a path holding a control character is not taken; rename it", param, ctx)
        if text.startswith("-") and param is not None:  # `--out --overwrite`: the next option taken as the value
            self.fail(f"{escaped(text)} reads as an option, not a path: give the option its value (a path that does "
                      f"start with '-': ./{escaped(text)})", param, ctx)
        if text.strip().lower() in self.words or (self.json_text and text.lstrip().startswith("{")):
            return text
        if places.is_remote(text) and not self.store:
            self._no_store(text, param, ctx)
        try:
            place = places.location(text)
        except places.LocationError as e:
            self.fail(str(e), param, ctx)
        return self._checked(place, param, ctx)

    def _checked(self, place, param, ctx):
        from storage import places

        if isinstance(place, places.StorePath):
            if not self.store:
                self._no_store(place, param, ctx)
        elif self.local is not None:  # its own check; a hub id's type gives the local snapshot folder it names
            try:
                return Path(self.local.convert(str(place), param, ctx))
            except click.BadParameter:
                if os.path.lexists(place) or getattr(self.local, "names_misses", False):  # a hub id's type does
                    raise
                from storage.nearby import missing

                raise PlaceMissing(escaped(missing(place)), ctx, param)  # what is there, the closest
        return place

    def _no_store(self, url, param, ctx):
        self.fail(f"{url}: an object-store URL is taken where refcache writes or reads a cache (precompute-ref --out, "
                  "train-dpo --ref-cache / --eval-ref-cache, audit-ref CACHE), not here; give a local path (and copy "
                  "to or from the store with its own tools)", param, ctx)


class PlaceMissing(click.BadParameter):
    """A local place an option must name that is not there, said as every location refusal says it: the option as
    the user typed it (CACHE, --config, --dataset_name), then the path and what is near it (`CACHE c33: does not
    exist; did you mean c3?`), not click's "Invalid value for ...". Exit 2, as every usage error."""

    def format_message(self) -> str:
        from .cli import typed_options

        param = self.param
        if param is None:
            return self.message
        if isinstance(param, click.Option):
            shown = typed_options().get(param.name) or param.opts[0]
        else:
            shown = param.human_readable_name
        return f"{shown} {self.message}"


def read_locations(config) -> None:
    """Every `location` field of a config dataclass read by the Location type, as the command line reads it (the
    local existence checks are the command line's own): a config made in Python, a config file's values and the
    command line's name the same places. Called by each config's __post_init__."""
    for fld in dataclasses.fields(config):
        value = getattr(config, fld.name)
        if "location" not in fld.metadata or value is None:
            continue
        kind = location_type({k: v for k, v in fld.metadata.items() if k != "click_type"})
        try:
            setattr(config, fld.name, kind.convert(value, None, None))
        except click.BadParameter as e:
            raise click.BadParameter(e.message, param_hint=f"'--{fld.name.replace('_', '-')}'") from None


def location_type(metadata) -> Location:
    """The Location type of a field's `location` metadata ("input" or "output"), with its `store`, `words` and
    `json_text` keys and its `click_type` (a click.Path) as the local check."""
    local = metadata.get("click_type")
    return Location(metadata["location"], store=bool(metadata.get("store")),
                    local=local if isinstance(local, click.Path) else None, words=metadata.get("words", ()),
                    json_text=bool(metadata.get("json_text")))



# What an input place must hold (a field's `present` metadata), checked by check_present before the job reads it
PRESENT = ("checkpoint", "data", "cache")
NOT_A_CHECKPOINT = "not a Hugging Face checkpoint folder (no config.json)"


def checkpoint_problem(path) -> str | None:
    """Why a local path that exists is not a checkpoint folder (runtime.checkpoint.Checkpoint.open says it too)."""
    return None if (Path(path) / "config.json").is_file() else NOT_A_CHECKPOINT


def record_sources(config, config_file, keys, written=None, typed=None) -> None:
    """Note which of `config`'s values came from --config `config_file` (`keys`: those its command line did not
    override; `written`: {option: the key as the file wrote it}) and how the command line spelt the others (`typed`:
    runtime.cli.typed_options, --dataset_name for --data), so that every refusal of a value names it as the user
    gave it (named)."""
    written = written or {}
    vars(config)["_sources"] = ({key: f"{config_file}: {written.get(key, key)}: " for key in keys} if config_file
                                else {})
    vars(config)["_typed"] = {key: f"{flag} " for key, flag in (typed or {}).items() if key not in keys}


def named(config, name: str) -> str:
    """How a refusal of field `name`'s value begins, the one naming of every option a job refuses: for a value from
    --config its file and key as written (`run.yaml: dataset_name: `), else the option as the command line spelt it
    (`--dataset_name `), else its kebab-case spelling (`--data `); the value follows."""
    own = vars(config)
    return ((own.get("_sources") or {}).get(name) or (own.get("_typed") or {}).get(name)
            or f"--{name.replace('_', '-')} ")


def was_given(config, name: str) -> bool:
    """Whether field `name` was given (on the command line or in --config), as record_sources noted it."""
    own = vars(config)
    return name in (own.get("_sources") or {}) or name in (own.get("_typed") or {})


def renamed(error: Exception, config, name: str) -> Exception:
    """A refusal raised by code that knows only the option (`--resume-from-checkpoint X: no such directory`), begun
    as `named` names field `name`'s value (the config file and its key, or the spelling typed); any other error as
    it is."""
    flag, shown = f"--{name.replace('_', '-')} ", named(config, name)
    text = str(error)
    if shown == flag or not text.startswith(flag) or type(error).__init__ is not RuntimeError.__init__:
        return error
    return type(error)(shown + text[len(flag):])


def check_present(config, names=None) -> None:
    """Every local input place of `config` that must be there (a field's `present` metadata: a "checkpoint" folder,
    "data", a "cache"; `names`: only these fields) refused, before the job reads it, where it is not there, is not a
    checkpoint folder, or holds no cache: the refusal names the option the user typed (--ref-cache c33: does not
    exist; did you mean c3?), or for a value from --config the file and its key (record_sources). A hub id
    (org/name, resolved from the local Hugging Face cache by runtime.hub) and an object-store URL are their
    readers' to judge."""
    from storage.nearby import missing

    from .errors import JobError

    for fld in dataclasses.fields(config):
        value, kind = getattr(config, fld.name), fld.metadata.get("present")
        if kind is None or value is None or (names is not None and fld.name not in names) or not isinstance(
                value, (str, Path)):
            continue
        where = named(config, fld.name)
        path = Path(value)
        if not os.path.lexists(path):
            if kind != "cache" and _hub_id(path):
                problem = _not_on_hub(path, kind)
                if problem is None:
                    continue
                raise JobError(f"{where}{problem}")
            raise JobError(f"{where}{missing(path)}")  # (printed by the terminal rule)
        if kind == "checkpoint" and checkpoint_problem(path):
            raise JobError(f"{where}{path}: {checkpoint_problem(path)}")
        if kind == "cache" and not (path / "manifest.json").is_file():
            from schemas.format import CacheError, no_manifest

            e = no_manifest(path)
            raise CacheError(e.kind, f"{where}{e.message}", remedy=e.remedy)


def _not_on_hub(path: Path, kind: str) -> str | None:
    """Why a name that reads as a hub id (org/name) and is no local path is not there either: None where the local
    Hugging Face cache holds it (runtime.hub reads it); a name ending in a data file's suffix (d2/train.jsonl) is a
    local path mistyped, named with what is near it."""
    from storage.nearby import missing

    from .data_files import SUFFIXES
    from .errors import JobError
    from .hub import resolve

    if kind == "data" and path.suffix.lower() in SUFFIXES:
        return f"{missing(path)}; a name ending in {path.suffix} is read as a local file, not a hub data set id"
    try:
        resolve(str(path), "model" if kind == "checkpoint" else "dataset")
    except JobError as e:
        return str(e)
    return None


def _hub_id(path: Path) -> bool:
    """A name that may be a hub id (org/name) rather than a mistyped local path (runtime.hub.resolve's rule)."""
    parts = str(path).split("/")
    local = path.parent.is_dir() and path.parent != Path(".")
    return len(parts) == 2 and all(parts) and not str(path).startswith((".", "~")) and not local
