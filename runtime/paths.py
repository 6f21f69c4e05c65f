"""Where a job may write: never into, around or inside what it reads (the model, the reference, a cache, the
data), so that no output can overwrite or delete an input. One rule for output folders (precompute-ref --out,
train-dpo --output-dir, the offload folders) and output files (audit-ref --json and --html): every place is read by
storage.places.location (a local path, file:// URLs included, or a store prefix), never compared as text."""

from __future__ import annotations

import os
from pathlib import Path

from storage import places
from storage.files import check_destination

from .errors import JobError


def _related(a: Path, b: Path) -> str | None:
    if a == b or (a.exists() and b.exists() and os.path.samefile(a, b)):  # samefile: a hard link or a bind mount
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "contains"
    return None


def _place(value, label: str):
    try:
        return places.location(value)
    except places.LocationError as e:
        raise JobError(f"{label} {e}") from None


def check_apart(out, label: str, inputs: dict, *, on_store: bool = False) -> None:
    """Refuse an output (folder or file) that is, contains or is inside any of `inputs` ({option: location}, None
    skipped). Local paths are resolved first, so a symlink or a `..` on the way does not hide the relation. An
    object-store prefix is an output only where the job writes a cache (`on_store`: precompute-ref --out), compared
    with the inputs on a store too, by prefix; anywhere else it is refused, never taken for a local folder."""
    place = _place(out, label)
    if places.is_remote(place):
        if not on_store:
            raise JobError(f"{label} {place}: an object-store URL is taken where refcache writes or reads a cache "
                           "(precompute-ref --out, train-dpo --ref-cache / --eval-ref-cache, audit-ref CACHE), not "
                           f"here; give {label} a local path (and copy the result to the store with its own tools)")
        _check_apart_urls(place, label, inputs)
        return
    target = place.resolve()
    for option, path in inputs.items():
        if path is None:
            continue
        there = _place(path, option)
        if places.is_remote(there):  # a store prefix is never a local folder
            continue
        relation = _related(target, there.resolve())
        if relation:
            raise JobError(f"{label} {out} {relation} {option} {path}: writing there could overwrite or delete an "
                           f"input; choose an {label} apart from it")


def _check_apart_urls(out, label: str, inputs: dict) -> None:
    key = lambda p: str(p).rstrip("/") + "/"
    for option, path in inputs.items():
        if path is None:
            continue
        there = _place(path, option)
        if not places.is_remote(there):
            continue  # a local path and a store prefix never overlap
        a, b = key(out), key(there)
        relation = "is" if a == b else "is inside" if a.startswith(b) else "contains" if b.startswith(a) else None
        if relation:
            raise JobError(f"{label} {out} {relation} {option} {path}: writing there could overwrite or delete an "
                           f"input; choose an {label} apart from it")


def check_output_file(path, label: str, inputs: dict, *, ours, kind: str) -> Path:
    """The one rule for a single file a command writes (audit-ref --json, --html): a local path (a store URL is
    refused), in a folder that exists, apart from every input, not a symlink, a folder or another non-regular file,
    and either absent or a file this command provably wrote before (`ours(path) -> bool`; `kind` names what such a
    file is). Checked before any work, and again just before the write (write_output_file). Returns the path."""
    place = _place(path, label)
    check_apart(place, label, inputs)
    parent = place.parent if place.is_absolute() else (Path.cwd() / place).parent
    if not parent.is_dir():
        raise JobError(f"{label} {path}: its folder {parent} does not exist; make it first, or choose another path")
    check_destination(place)  # a link, a folder or a special file there: refused, never followed or replaced
    if os.path.lexists(place) and not ours(place):
        raise JobError(f"{label} {path} already exists and is not {kind} refcache wrote; it is not replaced: move it "
                       "away, or choose another path")
    return place


def write_output_file(path, label: str, inputs: dict, data: bytes, *, ours, kind: str) -> Path:
    """Write `data` as a single output file, atomically, once check_output_file passes again (the inputs may be
    known better by now, e.g. the model folder a cache recorded)."""
    from storage.files import atomic_write

    place = check_output_file(path, label, inputs, ours=ours, kind=kind)
    atomic_write(place, lambda f: f.write(data))
    return place


def refcache_home() -> Path:
    """$REFCACHE_HOME, else refcache/ in the user's cache folder ($XDG_CACHE_HOME or ~/.cache): what refcache keeps
    between jobs (train-dpo's table of options, torch.compile's inductor caches)."""
    if os.environ.get("REFCACHE_HOME"):
        return Path(os.environ["REFCACHE_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "refcache"
