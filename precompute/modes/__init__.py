"""The batching modes of precompute-ref: how pairs go through the reference, and the registry that lists them.

Every mode gives the numbers of `runtime.logprobs.reference_logps` (the model's own forward over one unpadded
sequence); the stamps never depend on the mode. A mode is one BatchingMode subclass in a module of its own (plan,
score, estimated cost, unsupported reasons, description) and one line in REGISTRY (registry.py), which `--batching`
(its choices and help), auto (choose.py), the manifest's `computation.batching` and the README's table of modes read.
The registry imports no model library (the modes import torch where they score), so precompute-ref's --help and
refusals need none; the scoring and choosing names below are imported on first use.
"""

from __future__ import annotations

from runtime.architecture import shape_dependent

from .base import BatchingMode
from .registry import MODES, REGISTRY, batching_help, lookup, readme_table

__all__ = ["FALLBACK", "HEAD_ELEMENTS", "MODES", "REGISTRY", "BatchingMode", "batching_help", "candidates",
           "choose_mode", "effective_budget", "estimated_cost", "lookup", "probe_pairs",
           "readme_table", "score_known", "score_pairs", "shape_dependent", "to_score", "unsupported"]


def __getattr__(name):
    # the names that need torch, imported on first use (as schemas.read_cache is)
    if name in ("FALLBACK", "candidates", "choose_mode", "probe_pairs", "score_known", "to_score", "unsupported"):
        from . import choose

        return getattr(choose, name)
    if name in ("estimated_cost", "score_pairs"):
        from . import scoring

        return getattr(scoring, name)
    if name in ("HEAD_ELEMENTS", "effective_budget"):
        from runtime import logprobs

        return getattr(logprobs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
