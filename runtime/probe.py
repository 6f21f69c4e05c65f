"""The probe run before a fast path is trusted: its per-token values on real pairs (the longest included), compared
with `runtime.logprobs.reference_logps` at the tolerance of runtime/tolerance.py. precompute-ref probes each
batching mode with it, train-dpo its prefix_shared layout. Which pairs make the probe is each job's own choice."""

from __future__ import annotations

import numpy as np
import torch

from schemas.encoding import EncodedPair

from .logprobs import reference_logps
from .tolerance import probe_tolerance


def reference_values(model, pairs: list[EncodedPair]) -> list[np.ndarray]:
    """reference_logps of each pair's chosen, then its rejected completion: [chosen 0, rejected 0, chosen 1, ...]."""
    return [reference_logps(model, p.prompt_ids, c).cpu().numpy()
            for p in pairs for c in (p.chosen_ids, p.rejected_ids)]


def max_difference(got, truth) -> float:
    """Largest per-token |got - truth| over sequences of values; NaN if any difference is NaN (numpy's max keeps
    it, Python's max would drop one that is not first)."""
    return float(np.max([np.max(np.abs(np.asarray(a) - b), initial=0.0) for a, b in zip(got, truth)], initial=0.0))


def disagreement(model, fast, pairs: list[EncodedPair], *, dtype: torch.dtype | None = None, truth=None,
                 where: str = "") -> str | None:
    """Why the fast path does not reproduce reference_logps on `pairs`, or None. `fast(pairs)` gives the values in
    reference_values' order; `dtype` is what the forward computes in (default: the model's); `truth`: the reference
    values, when computed once for several fast paths; `where` (e.g. " under bfloat16 autocast") goes into the
    reason."""
    try:
        got = [v.cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for v in fast(pairs)]
        truth = reference_values(model, pairs) if truth is None else truth
    except Exception as e:  # an architecture whose forward rejects the inputs this fast path needs
        return f"not supported by this model{where} ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    if len(got) != len(truth) or any(len(a) != len(b) for a, b in zip(got, truth)):
        return "returns the wrong number of values"
    diff = max_difference(got, truth)
    if not diff <= probe_tolerance(model.dtype if dtype is None else dtype):  # NaN fails
        return f"differs from the reference forward by {diff:.2e}{where} on this model"
    return None
