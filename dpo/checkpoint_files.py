"""Nothing in a checkpoint runs code when it is loaded: the weights are safetensors, and the Trainer's state files
(optimizer.pt, scheduler.pt, scaler.pt, rng_state*.pth: torch.save pickles) load with torch.load(weights_only=True),
as transformers 5's Trainer loads them on resume. Checked file by file before anything is verified or loaded, so a
file that cannot be loaded safely is refused by name, instead of an UnpicklingError deep inside the Trainer."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.errors import JobError

# Written by the Trainer for information and never loaded, by it or by refcache (it is a whole pickled
# TrainingArguments object, which weights_only cannot load).
NEVER_LOADED = {"training_args.bin"}
PICKLE_SUFFIXES = (".bin", ".pkl", ".pickle", ".ckpt", ".metadata", ".joblib")
TORCH_STATE = re.compile(r".*\.(pt|pth)(_\d+)?$")  # optimizer.pt, rng_state_3.pth, rank0-of-2-optimizer.pt, ...
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
RULE = ("a checkpoint's files must load without running code (weights as safetensors, the Trainer's .pt/.pth state "
        "with torch.load(weights_only=True))")


def check_checkpoint_files(checkpoint) -> None:
    """Refuse a checkpoint any of whose files could run code on load, or cannot be loaded, naming the file."""
    root = Path(checkpoint)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.name
        if name in NEVER_LOADED and path.parent == root:
            continue
        if name.endswith(PICKLE_SUFFIXES):
            raise JobError(f"--resume-from-checkpoint {root}: {path} is a pickle, which can run code when it is "
                           f"loaded; {RULE}. Save the weights as safetensors (model.safetensors) or resume from a "
                           "checkpoint that train-dpo wrote")
        if name.endswith(".safetensors"):
            _check_safetensors(root, path)
        elif TORCH_STATE.match(name):
            _check_torch_state(root, path)
    if not any((root / name).is_file() for name in WEIGHTS):
        raise JobError(f"--resume-from-checkpoint {root}: no weights in it ({' or '.join(WEIGHTS[::2])}); resume "
                       "from a complete checkpoint-N folder that train-dpo wrote")


def _check_safetensors(root: Path, path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # truncated, or not safetensors
        raise JobError(f"--resume-from-checkpoint {root}: {path} is not a readable safetensors file "
                       f"({' '.join(str(e).split())[:160]}): the checkpoint is damaged or was not completely saved; "
                       "resume from another checkpoint-N") from None


def _check_torch_state(root: Path, path: Path) -> None:
    import torch

    allowed = _rng_globals() if path.name.startswith("rng_state") else _no_globals()
    try:
        with allowed:
            try:  # mmap: the tensors' bytes are not read, only the pickle that the check is about
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except Exception as e:
        raise JobError(f"--resume-from-checkpoint {root}: {path} cannot be loaded safely ({_why(e)}); {RULE}. "
                       "Resume from a checkpoint that train-dpo wrote, or start a new run") from None


def _why(e: Exception) -> str:
    """torch's reason without its advice to load the file with weights_only=False (which would run its code)."""
    text = " ".join(str(e).split())
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"it holds pickled objects other than tensors and plain values: GLOBAL {m.group(1)}"
    if "weights_only" in text:
        return "it holds pickled objects other than tensors and plain values"
    return f"{type(e).__name__}: {text[:160]}; damaged or not completely saved"


def _rng_globals():
    from transformers.trainer_pt_utils import safe_globals  # the numpy types the Trainer allows for its RNG states

    return safe_globals()


def _no_globals():
    import contextlib

    return contextlib.nullcontext()
