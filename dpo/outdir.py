"""train-dpo's --output-dir: apart from every input, never a used folder unless asked (--overwrite-output-dir) or
resuming (and then holding no link the Trainer would write through), and metrics.jsonl consistent with the checkpoint
a run resumes from. The lock that keeps a second run out is runtime.locks, taken in recipe.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from runtime.errors import JobError
from runtime.hub import resolve_data
from runtime.locks import is_lock_file
from runtime.paths import check_apart
from storage.places import location
from storage.reads import record_bytes
from storage.files import atomic_write, refusal, remove_file, why_unsafe


def check_output_dir(cfg) -> None:
    """Refuse an --output-dir that cannot be made, that is, contains or is inside an input, or that a run already
    used (unless --overwrite-output-dir, or a resume). Nothing is created here."""
    check_apart(cfg.output_dir, "--output-dir", inputs(cfg))  # a store URL is refused, never read as a folder
    out = location(cfg.output_dir)
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise JobError(f"--output-dir {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JobError(f"--output-dir {out}: {existing} is not writable")
    used = sorted(p.name for p in out.iterdir() if not is_lock_file(p)) if out.is_dir() else []  # the lock: no use
    if used and not cfg.overwrite_output_dir and not cfg.resume_from_checkpoint:
        from .resume import in_the_way

        foreign = [p.name for p in in_the_way(Path(out))]  # offer --overwrite-output-dir only where it is taken
        if foreign:
            raise JobError(f"--output-dir {out} holds {', '.join(foreign[:5])}{' …' if len(foreign) > 5 else ''}, "
                           "which no earlier train-dpo run there wrote, where this run would write: move "
                           f"{'it' if len(foreign) == 1 else 'them'} elsewhere, or choose a new --output-dir")
        held = f"--output-dir {out} already holds files ({', '.join(used[:5])}{' …' if len(used) > 5 else ''})"
        raise JobError(f"{held}: a second run would mix its checkpoints and metrics with them; pass "
                       "--overwrite-output-dir to train over them, --resume-from-checkpoint to continue that run, or "
                       "choose a new --output-dir")


def inputs(cfg) -> dict:
    """Every path train-dpo reads ({option: path}; a data set named by hub id: its local snapshot); the DeepSpeed and
    FSDP configs only where they name a file (the Trainer also takes them as JSON text)."""
    files = {"--deepspeed": cfg.deepspeed, "--fsdp-config": cfg.fsdp_config,
             "--accelerator-config": (getattr(cfg, "training_args", None) or {}).get("accelerator_config")}
    return {"--model": cfg.model, "--ref-model": cfg.ref_model, "--ref-cache": cfg.ref_cache,
            "--eval-ref-cache": cfg.eval_ref_cache, "--data": resolve_data(cfg.data),
            "--eval-data": resolve_data(cfg.eval_data),
            "--init-adapter": cfg.lora.init_adapter, "--config": cfg.config_file} | {
        k: v for k, v in files.items() if isinstance(v, (str, os.PathLike)) and not str(v).lstrip().startswith("{")
        and os.path.lexists(v)}


def check_no_links(out: Path) -> None:
    """A used --output-dir (overwritten or resumed) must hold no symlink, hard-linked or special file anywhere: the
    Trainer writes its files in place, and would write through them into files outside the folder. Checked after
    dpo/resume.py's own refusals (a symlinked checkpoint or metrics file), which name the remedy for those."""
    for folder, dirs, names in os.walk(out):
        for name in sorted(dirs + names):
            path = Path(folder) / name
            st = path.lstat()
            why = why_unsafe(st) if not stat.S_ISDIR(st.st_mode) else None
            if why:
                raise refusal(path, why)


def resumed_step(checkpoint: str) -> int:
    return int(json.loads(record_bytes(Path(checkpoint) / "trainer_state.json"))["global_step"])


def at_last_step(checkpoint, max_steps: int) -> int | None:
    """The checkpoint's step where it is at (or past) --max-steps, so that resuming it trains nothing (the Trainer
    trained one step past it); None where steps are left, or no --max-steps bounds the run."""
    step = resumed_step(str(checkpoint)) if max_steps > 0 else None
    return step if step is not None and step >= max_steps else None


def metrics_kind(record: dict) -> str:
    if "event" in record:  # dpo/kl_governor.py's records: kl_control, kl_alarm
        return record["event"]
    return "eval" if any(k.startswith("eval_") for k in record) else "train"


def prepare_metrics(path: Path, checkpoint: str | None) -> set:
    """metrics.jsonl for this run: empty for a new run; for a resume, the records up to the checkpoint's step (those
    logged after it will be logged again). Returns the (step, kind) pairs already present, which are not written
    twice."""
    if not checkpoint or not path.exists():
        remove_file(path)
        return set()
    step = resumed_step(checkpoint)
    # a last line without its newline was cut off while being written: after the checkpoint, it is dropped anyway
    lines = path.read_text().split("\n")[:-1]
    kept = [r for r in map(json.loads, filter(str.strip, lines)) if r.get("step", 0) <= step]
    data = "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8")
    atomic_write(path, lambda f: f.write(data))
    return {(r.get("step"), metrics_kind(r)) for r in kept}
