"""Where a job may write: never into, around or inside what it reads (the model, the reference, a cache, the
data), so that no output can overwrite or delete an input. One rule for output folders (precompute-ref --out,
train-dpo --output-dir) and output files (audit-ref --json) alike."""

from __future__ import annotations

import os
from pathlib import Path

from schemas import store

from .errors import JobError


def _related(a: Path, b: Path) -> str | None:
    if a == b or (a.exists() and b.exists() and os.path.samefile(a, b)):  # samefile: a hard link or a bind mount
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "contains"
    return None


def check_apart(out, label: str, inputs: dict, *, on_store: bool = False) -> None:
    """Refuse an output (folder or file) that is, contains or is inside any of `inputs` ({option: path}, None
    skipped). Paths are resolved first, so a symlink or a `..` on the way does not hide the relation. An object-store
    URL is an output only where the job writes a cache (`on_store`: precompute-ref --out), compared with the inputs
    that are URLs too, by prefix; anywhere else it is refused, never taken for a local folder named `s3:`."""
    if store.is_remote(out):
        if not on_store:
            raise JobError(f"{label} {out}: an object-store URL is taken where refcache writes or reads a cache "
                           "(precompute-ref --out, train-dpo --ref-cache / --eval-ref-cache, audit-ref CACHE), not "
                           f"here; give {label} a local path (and copy the result to the store with its own tools)")
        _check_apart_urls(out, label, inputs)
        return
    target = Path(out).resolve()
    for option, path in inputs.items():
        if path is None or store.is_remote(path):  # a store prefix is never a local folder
            continue
        relation = _related(target, Path(path).resolve())
        if relation:
            raise JobError(f"{label} {out} {relation} {option} {path}: writing there could overwrite or delete an "
                           f"input; choose an {label} apart from it")


def _check_apart_urls(out, label: str, inputs: dict) -> None:
    key = lambda p: str(p).rstrip("/") + "/"
    for option, path in inputs.items():
        if path is None or not store.is_remote(path):
            continue  # a local path and a store prefix never overlap
        a, b = key(out), key(path)
        relation = "is" if a == b else "is inside" if a.startswith(b) else "contains" if b.startswith(a) else None
        if relation:
            raise JobError(f"{label} {out} {relation} {option} {path}: writing there could overwrite or delete an "
                           f"input; choose an {label} apart from it")
