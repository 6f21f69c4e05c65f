"""The batching modes of precompute-ref: how pairs go through the reference, and the registry that lists them.

Every mode gives the numbers of `runtime.logprobs.reference_logps` (the model's own forward over one unpadded
sequence); the stamps never depend on the mode. A mode is one BatchingMode subclass in a module of its own (plan,
score, estimated cost, unsupported reasons, description) and one line in REGISTRY (registry.py), which `--batching`
(its choices and help), auto (choose.py), the manifest's `computation.batching` and the README's table of modes read.
"""

from __future__ import annotations

from runtime.architecture import shape_dependent
from runtime.logprobs import HEAD_ELEMENTS, effective_budget

from .base import BatchingMode
from .choose import FALLBACK, candidates, choose_mode, probe_pairs, unsupported
from .registry import MODES, REGISTRY, batching_help, lookup, readme_table
from .scoring import estimated_cost, score_pairs

__all__ = ["FALLBACK", "HEAD_ELEMENTS", "MODES", "REGISTRY", "BatchingMode", "batching_help", "candidates",
           "choose_mode", "effective_budget", "estimated_cost", "lookup", "probe_pairs",
           "readme_table", "score_pairs", "shape_dependent", "unsupported"]
