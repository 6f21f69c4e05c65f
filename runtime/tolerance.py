"""When a log-prob "matches the plain forward" (`runtime.logprobs.reference_logps`): the one tolerance policy of
refcache, per dtype, with its reasons. The head check (head.py), precompute-ref's probe of a batching mode, train-dpo's
probe of its batch layout (both through runtime/probe.py) and audit-ref's replay all read it; nothing else holds a
figure for it.

Per token, |value - reference_logps| may be at most `per_token` of the dtype the forward computes in:
  float32, float64   1e-4. Every fast path (padding, packing, a tree mask, a key/value cache, the chunked output
                     projection) sums the same products in another order. float32 keeps 24 significant bits (a
                     rounding is 6e-8 relative), and the reorderings move a token's log-prob by about 1e-7 to 1e-5
                     through the layers and the log-softmax of the models tested here. A wrong layout (a token
                     that sees another branch, a padded slot or a wrong position) moves it by orders of magnitude
                     more. 1e-4 is ten times the rounding and far below any such mistake. float64 is held to the
                     same figure: the cache stores float32.
  bfloat16, float16  0.25. bfloat16 keeps 8 significant bits, float16 11. A logit between 16 and 32 has a bfloat16
                     rounding step of 0.125, and two orders of summation can end a step or two apart, so 0.25 is
                     two steps of such a logit. This is rounding, not a mistake (test_architectures.py checks that
                     a mistake moves values much further).
  any other dtype    the bfloat16 row, as coarse as the coarsest named.

Two named parts of the same policy:
  HEAD_SHARE      the head check (head.py) compares the output projection applied to the same hidden states with
                  the model's own logits. Only the projection's summation order differs, and the head it picks
                  also runs where no probe follows (train-dpo's padded layout, the live policy), so it may use a
                  tenth of the budget: 1e-5 in float32, 0.025 in bf16/fp16.
  truth share     the chunked truth (runtime/truth.py: the model's own forward with `logits_to_keep` piece by piece,
                  for sequences whose whole-forward logits are too large) is taken only where it equals the whole
                  forward on the job's sequences that fit within a tenth of the budget, relative to max(1, |value|):
                  1e-5 in float32 (the head on fewer rows rounds differently: at most 1.8e-6 measured over the
                  architecture matrix, hyperclovax's top-k, about one float32 step of its largest logit, 18.5, so
                  1e-6 relative to |value| cannot hold on every model), 0.025 in bf16/fp16. HEAD_SHARE names that
                  tenth too.
  across_devices  (a field of each row) a replay on another device type than the cache records (a CUDA cache
                  replayed on a CPU) runs other kernels (matmul blocking, fused attention, reductions) that round
                  differently at every layer. In float32 that is about the size of the budget on a deep model, hence x10 (1e-3). In
                  bf16/fp16 the budget is already rounding-sized, hence x2 (0.5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a dtype or its name; audit-ref's help reads the figures without importing torch
    import torch


@dataclass(frozen=True)
class Precision:
    """The tolerance of one group of dtypes: `per_token` (the budget) and the factor `across_devices`."""

    per_token: float
    across_devices: float


FULL = Precision(per_token=1e-4, across_devices=10)
LOW = Precision(per_token=0.25, across_devices=2)
PRECISION = {"float32": FULL, "float64": FULL, "bfloat16": LOW, "float16": LOW}
HEAD_SHARE = 0.1


def precision(dtype: torch.dtype | str) -> Precision:
    """The row of the policy for a torch dtype or its name ("float32", as the manifest records it)."""
    return PRECISION.get(str(dtype).removeprefix("torch."), LOW)


def probe_tolerance(dtype: torch.dtype | str) -> float:
    """Largest per-token difference from reference_logps that a batching mode or batch layout may show on the probe.
    This is the guarantee the README gives for a cached value."""
    return precision(dtype).per_token


def head_tolerance(dtype: torch.dtype | str) -> float:
    """Largest per-token difference from the model's own logits that a head path may show on the head check."""
    return precision(dtype).per_token * HEAD_SHARE


def truth_tolerance(dtype: torch.dtype | str) -> float:
    """Largest difference, per value and relative to max(1, |value|), of the chunked truth from the whole forward on
    the sequences it is proven on (runtime/truth.py)."""
    return precision(dtype).per_token * HEAD_SHARE


def replay_tolerance(dtype: torch.dtype | str, recorded_device: str | None, local_device: str) -> float:
    """audit-ref's per-token replay tolerance: the probe's, times the row's `across_devices` when the cache records
    another device type than this one (nothing recorded: no allowance)."""
    row = precision(dtype)
    across = bool(recorded_device) and recorded_device != local_device
    return row.per_token * (row.across_devices if across else 1)


def written(figure: float) -> str:
    """A figure as the README and --help write it: 1e-4, 0.25."""
    return f"{figure:.0e}".replace("e-0", "e-") if figure < 1e-3 else f"{figure:g}"


def describe_replay() -> str:
    """The figures, for audit-ref --tolerance's help."""
    return (f"{written(FULL.per_token)} for float32, {written(LOW.per_token)} for bfloat16/float16 (the probe's "
            f"tolerance), {FULL.across_devices:g}x and {LOW.across_devices:g}x that when the recorded device type "
            "differs")
