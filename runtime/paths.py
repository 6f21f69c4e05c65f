"""Where a job may write: never into, around or inside what it reads (the model, the reference, a cache, the
data), so that no output can overwrite or delete an input."""

from __future__ import annotations

from pathlib import Path

from .errors import JobError


def _related(a: Path, b: Path) -> str | None:
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "contains"
    return None


def check_apart(out, label: str, inputs: dict) -> None:
    """Refuse an output folder that is, contains or is inside any of `inputs` ({option: path}, None skipped)."""
    target = Path(out).resolve()
    for option, path in inputs.items():
        if path is None:
            continue
        relation = _related(target, Path(path).resolve())
        if relation:
            raise JobError(f"{label} {out} {relation} {option} {path}: writing there could overwrite or delete an "
                           f"input; choose an {label} apart from it")
