"""precompute-ref --torch-compile: the scoring forward compiled by torch.compile (dynamic shapes), a fast path like
any batching mode. It is used only once it reproduces `runtime.logprobs.reference_logps`, run on the eager model
(never on the compiled one: the check would be circular), on the mode's probe of the job's own pairs, the longest
included; otherwise the job scores with the eager model and says why."""

from __future__ import annotations

from functools import partial

import torch

from runtime.probe import disagreement, reference_values
from schemas.encoding import EncodedPair

from .modes.choose import mode_values


def compiled_scorer(model, mode: str, probe: list[EncodedPair], pad_id: int, top_k: int, log) -> tuple[object, bool]:
    """(the model to score with, whether it is the compiled one). The probe's first calls also compile the graph, so
    the job's batches reuse it (shapes are symbolic; a new graph only where a size of 0 or 1 specialises)."""
    try:
        compiled = torch.compile(model, dynamic=True)
    except Exception as e:  # e.g. a platform torch.compile does not support
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    else:
        truth = reference_values(model, probe, top_k)  # the eager forward
        reason = disagreement(model, partial(mode_values, compiled, mode, pad_id=pad_id, top_k=top_k), probe,
                              truth=truth, where=" when compiled")
    if reason is not None:
        log(f"torch.compile: not used, scoring with the uncompiled model ({reason})")
        return model, False
    log(f"torch.compile: the {mode} forward compiled (dynamic shapes); matches the reference forward on the probe")
    return compiled, True
