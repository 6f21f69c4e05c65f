"""Which run an output dir's checkpoints belong to, which of them a run may resume, and what --overwrite-output-dir
retires.

A run writes the output dir's run record (schemas/run_manifest.RUN_RECORD, a new run id) when it starts writing,
before any checkpoint; a resume keeps it. Every checkpoint's record carries the run id. A resume names a checkpoint-N
folder directly in --output-dir (not a symlink) whose record has the output dir's run id, complete and made only of
files that load without running code. --overwrite-output-dir deletes only what an earlier run provably wrote (its
run record, run manifest, metrics, model card and the checkpoint-N folders that carry our record), refuses a file in
the way that the new run would write and cannot be proved ours, and leaves everything else."""

from __future__ import annotations

import datetime
import json
import re
import shutil
import uuid
from pathlib import Path

from runtime.errors import JobError
from runtime.locks import is_lock_file
from runtime.terminal import echo
from schemas import run_manifest as rm
from storage.nearby import nearby
from storage.reads import record_bytes

from .card import CARD, is_card
from .checkpoint_files import check_checkpoint_files

CHECKPOINT = re.compile(r"checkpoint-(\d+)")
TRAINER_STATE = "trainer_state.json"
METRICS = ("metrics.jsonl", "metrics.png")
OUTPUTS = (*METRICS, CARD)  # a run's other files in --output-dir, each proved ours by _ours
# what the Trainer's final save writes into --output-dir itself (the model, its tokenizer, its arguments): an earlier
# run's own where the folder holds that run's record, anyone's otherwise
TRAINER_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                           "adapter_config.json", "adapter_model.safetensors", "training_args.bin", "tokenizer.json",
                           "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "tokenizer.model",
                           "vocab.json", "merges.txt", "added_tokens.json"})
MODEL_SHARD = re.compile(r"(model|adapter_model)-\d{5}-of-\d{5}\.safetensors")


def is_complete(checkpoint: Path) -> bool:
    """The Trainer writes trainer_state.json last; a folder without a whole one was interrupted while being saved."""
    try:
        return isinstance(json.loads(record_bytes(checkpoint / TRAINER_STATE))["global_step"], int)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _record_run_id(checkpoint: Path):
    """The run id in a checkpoint's record; None: a record without one; raises RunManifestError: no record."""
    if (checkpoint / rm.CHECKPOINT_RECORD).is_symlink():
        raise rm.RunManifestError(f"{checkpoint / rm.CHECKPOINT_RECORD} is a symbolic link, not a reference record")
    return rm.read_checkpoint_record(checkpoint).get("run_id")


def check_resume(checkpoint: str | None, out: Path, latest: bool = False) -> None:
    """Refuse a checkpoint that is not a complete checkpoint of this output dir's run, or holds a file that could run
    code when loaded. `latest`: it was chosen by --resume-from-checkpoint true."""
    if not checkpoint:
        return
    ckpt, out = Path(checkpoint), Path(out)
    given = f"--resume-from-checkpoint {'true (' + str(ckpt) + ')' if latest else ckpt}"
    other = _advice(out, ckpt)
    if not ckpt.is_dir():
        raise JobError(f"--resume-from-checkpoint {ckpt}: no such directory{nearby(ckpt)}; resume from a complete "
                       "checkpoint-N folder (or pass --resume-from-checkpoint true: the latest)")
    if not is_complete(ckpt):
        what = "its trainer_state.json is not whole" if (ckpt / TRAINER_STATE).exists() else \
            "no trainer_state.json in it"
        raise JobError(f"{given}: {what} (not a Trainer checkpoint, or one interrupted while being saved); resume "
                       f"from a complete checkpoint-N folder{other}")
    if ckpt.is_symlink() or not CHECKPOINT.fullmatch(ckpt.name) or ckpt.resolve().parent != out.resolve():
        raise JobError(
            f"{given}: not a checkpoint of --output-dir {out} (a resume continues the run in its own output dir: it "
            f"must name a checkpoint-N folder directly inside it, not a symlink); resume with that run's "
            f"--output-dir {ckpt.parent}, or copy that whole output dir and resume in the copy")
    try:
        found = _record_run_id(ckpt)
    except rm.RunManifestError as e:
        raise JobError(f"--resume-from-checkpoint {ckpt}: {e}") from None
    try:
        run_id = rm.read_run_record(out)["run_id"]
    except rm.RunManifestError as e:
        raise JobError(f"{given}: {e}: --output-dir {out} does not say which run its checkpoints belong to; "
                       "start a new run (--overwrite-output-dir, or a new --output-dir)") from None
    if found != run_id:
        raise JobError(f"{given}: the checkpoint belongs to another run (run id {found}) than --output-dir {out}'s "
                       f"(run id {run_id}): an --overwrite-output-dir started a new run there; resume from one of "
                       f"this run's checkpoints{other or ', or start a new run (--overwrite-output-dir)'}")
    check_checkpoint_files(ckpt)


def resumable(out: Path, run_id: str | None = None) -> list[Path]:
    """The checkpoints of the output dir's run (or of `run_id`) that a resume accepts by their record and
    completeness, oldest first."""
    out = Path(out)
    if run_id is None:
        try:
            run_id = rm.read_run_record(out)["run_id"]
        except rm.RunManifestError:
            return []
    found = []
    for path in out.iterdir() if out.is_dir() else ():
        m = CHECKPOINT.fullmatch(path.name)
        if not m or path.is_symlink() or not path.is_dir() or not is_complete(path):
            continue
        try:
            if _record_run_id(path) == run_id:
                found.append((int(m.group(1)), path))
        except rm.RunManifestError:
            continue
    return [p for _, p in sorted(found)]


def _advice(out: Path, refused: Path) -> str:
    ok = [p for p in resumable(out) if p != refused]
    return f" (the latest of this run's: --resume-from-checkpoint {ok[-1]})" if ok else ""


# ---------------------------------------------------------------------------------------------------------------
# --overwrite-output-dir


def _ours(path: Path) -> bool:
    """Provably written by a train-dpo run (never through a symlink)."""
    if path.is_symlink():
        return False
    name = path.name
    try:
        if CHECKPOINT.fullmatch(name):
            if not path.is_dir():
                return False
            _record_run_id(path)  # raises unless it holds our record (a real file)
            return True
        if not path.is_file():
            return False
        if name == rm.RUN_RECORD or name in TRAINER_FILES or MODEL_SHARD.fullmatch(name):
            rm.read_run_record(path.parent)
            return True
        if name == rm.RUN_MANIFEST:
            rm.read_run_manifest(path.parent)
            return True
        if name == "metrics.jsonl":
            # step records; the last one may be cut off (a crash or a full disk); empty: nothing to lose
            *lines, tail = path.read_text(encoding="utf-8").split("\n")
            return (tail == "" or tail.startswith('{"step": ')) and all(
                isinstance(json.loads(line).get("step"), int) for line in lines if line.strip())
        if name == "metrics.png":
            return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if name == CARD:  # the card of the run whose record is here (a cache's dataset card is not one)
            return is_card(path, rm.read_run_record(path.parent)["run_id"])
    except (rm.RunManifestError, OSError, ValueError, AttributeError):
        return False
    return False


def _would_write(name: str) -> bool:
    return (bool(CHECKPOINT.fullmatch(name) or MODEL_SHARD.fullmatch(name))
            or name in (rm.RUN_RECORD, rm.RUN_MANIFEST, *OUTPUTS, *TRAINER_FILES))


def _judged(out: Path) -> tuple[list[Path], set[Path], list[Path]]:
    """(the folder's entries, those an earlier run provably wrote of the names a new run writes, those of such a
    name it did not)."""
    entries = sorted(p for p in out.iterdir() if not is_lock_file(p)) if out.is_dir() and not out.is_symlink() else []
    ours = {p for p in entries if _would_write(p.name) and _ours(p)}
    return entries, ours, [p for p in entries if _would_write(p.name) and p not in ours]


def in_the_way(out: Path) -> list[Path]:
    """What --overwrite-output-dir would refuse: files of names the new run writes that no earlier run wrote."""
    return _judged(Path(out))[2]


def overwrite_plan(out: Path) -> tuple[list[Path], list[Path]]:
    """(what --overwrite-output-dir retires, what it leaves). Refuses a file or folder in the way of the new run
    (a name it writes: checkpoint-N, the run record, run manifest, metrics, model card, the Trainer's final model
    and tokenizer files) that an earlier run did not provably write: replacing it could destroy something that is
    not ours."""
    out = Path(out)
    entries, ours, in_the_way = _judged(out)
    # an earlier run's final model and tokenizer stay until the new run's final save replaces them
    retire = [p for p in entries if p in ours and not (p.name in TRAINER_FILES or MODEL_SHARD.fullmatch(p.name))]
    if in_the_way:
        names = ", ".join(p.name + (" (a symlink)" if p.is_symlink() else "") for p in in_the_way[:5])
        raise JobError(f"--overwrite-output-dir {out}: {names} {'is' if len(in_the_way) == 1 else 'are'} not an "
                       "earlier train-dpo run's own (no train-dpo record in or on it), and the new run would write "
                       "there; refcache replaces only files it can prove it wrote: move them away or choose a new "
                       "--output-dir")
    return retire, [p for p in entries if p not in retire]


def start_run(cfg, log=echo) -> str:
    """The run id of this run, once it starts writing --output-dir (rank 0): a resume keeps the output dir's; a new
    run retires an earlier run's files (--overwrite-output-dir) and writes a new run record before any checkpoint."""
    out = Path(cfg.output_dir)
    if cfg.resume_from_checkpoint:
        return rm.read_run_record(out)["run_id"]
    retire, left = overwrite_plan(out)
    for path in retire:
        if path.is_dir():
            shutil.rmtree(path)  # a real folder (checked); rmtree removes symlinks inside it, never their targets
        else:
            path.unlink()
    if retire:
        log(f"--overwrite-output-dir: removed the earlier run's {', '.join(p.name for p in retire)}"
            + (f"; left {', '.join(p.name for p in left[:8])}{' …' if len(left) > 8 else ''} (not provably an "
               "earlier run's checkpoint, record or metrics; the final save replaces same-named model files)"
               if left else ""))
    run_id = uuid.uuid4().hex
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out.mkdir(parents=True, exist_ok=True)
    rm.write_json(out / rm.RUN_RECORD, rm.run_record(run_id, started))
    return run_id


# how a resume names each cache role of a run's record (schemas/run_manifest.py reference_record)
CACHE_ROLES = {"cache": "the cache", "eval_cache": "the eval cache"}


def same_cache_elsewhere(role: str, recorded, now) -> str | None:
    """The line a resume prints when it goes on with the cache it trained with (the same content: same_cache) found
    at another place (a copy, a move): None when it is where the checkpoint's record says it was."""
    if not isinstance(recorded, dict) or not isinstance(now, dict) or recorded.get("path") == now.get("path"):
        return None
    from storage.quoting import shell_word

    ident = f"cache id {now['cache_id']}" if now.get("cache_id") else f"manifest sha256 {now.get('manifest_sha256')}"
    return (f"resume: {CACHE_ROLES.get(role, role)} at {shell_word(now.get('path'))} is the one this run trained with "
            f"({ident}, was at {shell_word(recorded.get('path'))})")
