"""train-dpo's --output-dir: apart from every input, never a used folder unless asked (--overwrite-output-dir) or
resuming, and metrics.jsonl consistent with the checkpoint a run resumes from."""

from __future__ import annotations

import json
import os
from pathlib import Path

from runtime.errors import JobError
from runtime.paths import check_apart


def check_output_dir(cfg) -> None:
    """Refuse an --output-dir that cannot be made, that is, contains or is inside an input, or that a run already
    used (unless --overwrite-output-dir, or a resume). Nothing is created here."""
    out = Path(cfg.output_dir)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise JobError(f"--output-dir {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JobError(f"--output-dir {out}: {existing} is not writable")
    check_apart(out, "--output-dir", {"--model": cfg.model, "--ref-model": cfg.ref_model, "--ref-cache": cfg.ref_cache,
                                      "--eval-ref-cache": cfg.eval_ref_cache, "--data": cfg.data,
                                      "--eval-data": cfg.eval_data})
    used = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if used and not cfg.overwrite_output_dir and not cfg.resume_from_checkpoint:
        raise JobError(f"--output-dir {out} already holds files ({', '.join(used[:5])}{' …' if len(used) > 5 else ''})"
                       ": a second run would mix its checkpoints and metrics with them; pass --overwrite-output-dir to "
                       "train over them, --resume-from-checkpoint to continue that run, or choose a new --output-dir")


def resumed_step(checkpoint: str) -> int:
    return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])


def metrics_kind(record: dict) -> str:
    return "eval" if any(k.startswith("eval_") for k in record) else "train"


def prepare_metrics(path: Path, checkpoint: str | None) -> set:
    """metrics.jsonl for this run: empty for a new run; for a resume, the records up to the checkpoint's step (those
    logged after it will be logged again). Returns the (step, kind) pairs already present, which are not written
    twice."""
    if not checkpoint or not path.exists():
        path.unlink(missing_ok=True)
        return set()
    step = resumed_step(checkpoint)
    # a last line without its newline was cut off while being written: after the checkpoint, it is dropped anyway
    lines = path.read_text().split("\n")[:-1]
    kept = [r for r in map(json.loads, filter(str.strip, lines)) if r.get("step", 0) <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return {(r.get("step"), metrics_kind(r)) for r in kept}
