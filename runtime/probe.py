"""The probe run before a fast path is trusted: its per-token values on real pairs (the longest included), compared
with `runtime.logprobs.reference_logps` (and, for a top-k cache, `reference_top_k`) at the tolerance of
runtime/tolerance.py. precompute-ref probes each batching mode with it, train-dpo its prefix_shared layout. Which
pairs make the probe is each job's own choice."""

from __future__ import annotations

import numpy as np
import torch

from schemas.encoding import EncodedPair
from schemas.columns import TokenScores

from .logprobs import reference_logps, reference_scores, reference_top_k, unwrap
from .tolerance import probe_tolerance
from .truth import chosen_truth, chunked_scores


def reference_values(model, pairs: list[EncodedPair], top_k: int = 0, notes: dict | None = None) -> list:
    """reference_logps of each pair's chosen, then its rejected completion: [chosen 0, rejected 0, chosen 1, ...];
    with top_k, TokenScores holding reference_top_k's ids, log-probs and tail beside them. A sequence whose whole
    forward's logits would pass runtime/truth.py's WHOLE_ELEMENTS is scored by the chunked truth once that is proven
    on this model (truth.chosen_truth); its record goes to `notes["truth"]`."""
    sequences = [(p.prompt_ids, c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    chunked, record = chosen_truth(model, sequences, top_k)
    if record is not None and notes is not None:
        notes["truth"] = record
    return [chunked_value(model, *s, top_k) if i in chunked else reference_value(model, *s, top_k)
            for i, s in enumerate(sequences)]


def chunked_value(model, prompt_ids: list[int], completion_ids: list[int], top_k: int = 0):
    """reference_value's values from the chunked truth."""
    scores = chunked_scores(model, prompt_ids, completion_ids, top_k).map(_numpy)
    return scores if top_k else scores.logps


def reference_value(model, prompt_ids: list[int], completion_ids: list[int], top_k: int = 0):
    """The definition's values of one sequence, as numpy: reference_logps, or with top_k TokenScores beside it."""
    if top_k:
        return reference_scores(model, prompt_ids, completion_ids, top_k).map(_numpy)
    return reference_logps(model, prompt_ids, completion_ids).cpu().numpy()


def top_k_disagreement(model, got: list[TokenScores], truth: list[TokenScores], pairs: list[EncodedPair],
                       tol: float) -> str | None:
    """Why top-k scores `got` are not the truth's: log-probs (slot by slot, sorted: ties do not matter) or tails
    beyond `tol`, or an id that is not the truth's at its slot and whose true log-prob (from reference_top_k with a
    few more entries) is not the value stored for it: ids may differ only between ties, at the boundary too."""
    for i, (a, b) in enumerate(zip(got, truth)):
        if a.top_ids is None or np.shape(a.top_ids) != np.shape(b.top_ids) or np.shape(a.tail) != np.shape(b.tail):
            return "returns no or the wrong number of top-k values"
        diff = _max_abs(a.top_logps, b.top_logps)
        if not diff <= tol:
            return f"top-k log-probs differ from the reference forward by {diff:.2e} on this model"
        diff = _max_abs(a.tail, b.tail)
        if not diff <= tol:
            return f"the top-k tail differs from the reference forward by {diff:.2e} on this model"
        wrong = np.argwhere(np.asarray(a.top_ids) != np.asarray(b.top_ids))
        if len(wrong):
            pair = pairs[i // 2]
            completion = pair.chosen_ids if i % 2 == 0 else pair.rejected_ids
            vocab = unwrap(model).get_output_embeddings().weight.shape[0]
            more = min(vocab, a.top_ids.shape[1] + 8)
            more_ids, more_logps, _ = reference_top_k(model, pair.prompt_ids, completion, more)
            more_ids, more_logps = more_ids.cpu().numpy(), more_logps.cpu().numpy()
            for t, j in wrong:
                at = np.flatnonzero(more_ids[t] == a.top_ids[t, j])
                if not len(at) or not abs(float(more_logps[t, at[0]]) - float(a.top_logps[t, j])) <= tol:
                    return (f"top-k ids differ from the reference forward (token {t}, slot {j}: id "
                            f"{int(a.top_ids[t, j])} where the reference has {int(b.top_ids[t, j])}) on this model")
    return None


def _max_abs(a, b) -> float:
    """Largest |a - b|, equal infinities (a tail of -inf: k is the vocabulary) counting as no difference."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    same = a == b  # also -inf == -inf, where a - b is NaN
    with np.errstate(invalid="ignore"):
        return float(np.max(np.where(same, 0.0, np.abs(a - b)), initial=0.0))


def max_difference(got, truth) -> float:
    """Largest per-token |got - truth| over sequences of values; NaN if any difference is NaN (numpy's max keeps
    it, Python's max would drop one that is not first)."""
    return float(np.max([np.max(np.abs(np.asarray(a) - b), initial=0.0) for a, b in zip(got, truth)], initial=0.0))


def disagreement(model, fast, pairs: list[EncodedPair], *, dtype: torch.dtype | None = None, truth=None,
                 where: str = "") -> str | None:
    """Why the fast path does not reproduce reference_logps on `pairs`, or None. `fast(pairs)` gives the values in
    reference_values' order; `dtype` is what the forward computes in (default: the model's); `truth`: the reference
    values, when computed once for several fast paths; `where` (e.g. " under bfloat16 autocast") goes into the
    reason. `fast` may give TokenScores, and `truth` (reference_values with top_k) TokenScores with a top-k: then the top-k
    is judged too (top_k_disagreement)."""
    try:
        scores = [v.map(_numpy) if isinstance(v, TokenScores) else TokenScores(_numpy(v)) for v in fast(pairs)]
        truth = reference_values(model, pairs) if truth is None else truth
    except Exception as e:  # an architecture whose forward rejects the inputs this fast path needs
        return f"not supported by this model{where} ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    scored = [t if isinstance(t, TokenScores) else TokenScores(t) for t in truth]
    got, truth = [v.logps for v in scores], [t.logps for t in scored]
    if len(got) != len(truth) or any(len(a) != len(b) for a, b in zip(got, truth)):
        return "returns the wrong number of values"
    diff = max_difference(got, truth)
    tol = probe_tolerance(model.dtype if dtype is None else dtype)
    if not diff <= tol:  # NaN fails
        return f"differs from the reference forward by {diff:.2e}{where} on this model"
    if any(t.top_ids is not None for t in scored):
        return top_k_disagreement(model, scores, scored, pairs, tol)
    return None


def _numpy(v):
    return v.cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
