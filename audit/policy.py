"""The policy of a train-dpo run at the rows audit-ref --show / --html --run shows: per completion token its log-prob,
and in a top-k cache its log-probs at the reference's K ids with the log of the mass outside them (the KL's inputs).
The numbers are the definition's: runtime.logprobs.reference_log_softmax, the unpadded sequence through the policy's
own forward. Many rows run in length-sorted padded batches under a token budget (runtime.logprobs.padded_scores, the
jobs' batched scoring), once those batches reproduce the definition on probe rows of the view (the two longest and the
two shortest, at runtime/probe.py's tolerance); a view of a few rows, a model whose numbers depend on what else is in
the forward (runtime/architecture.py), or batches that disagree are scored one sequence at a time by the definition
itself, the reason kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime.errors import JobError
from schemas.columns import TokenScores
from schemas.encoding import EncodedPair

from .replay import PROBE_ROWS, recorded_budget


class PolicyScorer:
    """Scores (prompt, chosen, rejected) rows with one model: `score`. `fallback`: why the last rows scored were
    not batched (None when they were, or when they were too few to need batches)."""

    def __init__(self, model, pad_id: int, budget: int):
        self.model, self.pad_id, self.budget = model, pad_id, budget
        self.fallback: str | None = None

    def score(self, pairs: list[EncodedPair], given: list[np.ndarray | None] | None = None) -> list[TokenScores]:
        """Each pair's chosen then its rejected completion: [chosen 0, rejected 0, chosen 1, ...], numpy TokenScores.
        `given`: per completion (same order) the reference's top-k ids [tokens, K] or None; the scores then also
        hold the policy's log-probs at those ids (top_logps) and the log of its mass outside them (tail)."""
        from runtime.architecture import shape_dependent
        from runtime.logprobs import effective_budget
        from runtime.probe import disagreement

        sequences = [(p.prompt_ids, c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
        given = list(given) if given is not None else [None] * len(sequences)
        self.fallback = None
        if len(pairs) <= PROBE_ROWS:  # no more rows than a probe holds: the definition itself, nothing to prove
            return [truth(self.model, *s, g) for s, g in zip(sequences, given)]
        size = [len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs]
        longest = max(size)
        budget = effective_budget(self.model, self.budget, longest)
        why = shape_dependent(self.model, longest)
        if why is None:
            order = sorted(range(len(pairs)), key=lambda i: (size[i], i))
            probe = sorted(set(order[: PROBE_ROWS // 2] + order[-(PROBE_ROWS // 2):]))
            at = [2 * i + side for i in probe for side in (0, 1)]
            known = [truth(self.model, *sequences[i], given[i]) for i in at]
            why = disagreement(self.model, lambda _: self._batched([sequences[i] for i in at], [given[i] for i in at],
                                                                    budget),
                               [pairs[i] for i in probe], truth=known)
            if why is None:
                return self._batched(sequences, given, budget)
        self.fallback = f"padded batches not used: {why}"
        return [truth(self.model, *s, g) for s, g in zip(sequences, given)]

    def _batched(self, sequences: list[tuple[list[int], list[int]]], given: list, budget: int) -> list[TokenScores]:
        """The sequences in right-padded batches, longest first, at most `budget` padded tokens each; sequences with
        and without `given` ids in batches of their own."""
        from runtime.logprobs import padded_scores
        from runtime.packing import length_batches

        out = [None] * len(sequences)
        for with_ids in (False, True):
            part = [i for i, g in enumerate(given) if (g is not None) == with_ids]
            for batch in length_batches([len(sequences[i][0]) + len(sequences[i][1]) for i in part], budget):
                picked = [part[b] for b in batch]
                ids = torch.as_tensor(np.concatenate([given[i] for i in picked])) if with_ids else None
                with torch.no_grad():
                    scores, _ = padded_scores(self.model, [sequences[i] for i in picked], self.pad_id, given=ids)
                for i, s in zip(picked, scores):
                    out[i] = s
        return out


def truth(model, prompt_ids: list[int], completion_ids: list[int], given: np.ndarray | None = None) -> TokenScores:
    """The definition's values of one sequence, as numpy: runtime.logprobs.reference_logps, or with `given` ids
    [tokens, K] reference_log_softmax at the completion tokens and at those ids, and the log of the mass outside
    them."""
    from runtime.logprobs import reference_log_softmax, reference_logps

    if given is None:
        return TokenScores(reference_logps(model, prompt_ids, completion_ids).cpu().numpy())
    logps = reference_log_softmax(model, prompt_ids, completion_ids)
    ids = torch.as_tensor(np.asarray(given, np.int64), device=logps.device)
    targets = torch.as_tensor(list(completion_ids), device=logps.device)[:, None]
    scores = TokenScores(logps.gather(-1, targets).squeeze(-1), ids, logps.gather(-1, ids),
                         logps.scatter(-1, ids, float("-inf")).logsumexp(-1))
    return scores.map(lambda v: v.cpu().numpy())


def load_policy(run_dir: str, model_dir: str | None, manifest: dict, tokenizer,
                trust_remote_code: bool = False) -> PolicyScorer:
    """The policy a train-dpo run left in `run_dir` (its checkpoint, or `model_dir` + its LoRA adapter), in the dtype
    the cache was computed in, on this machine's device, with the batches' budget the cache recorded; padded slots
    carry the cache's tokenizer's pad token (else its EOS)."""
    from runtime.checkpoint import Checkpoint, preserved_rng, resolve_device, resolve_dtype

    if (Path(run_dir) / "adapter_config.json").is_file():
        if not model_dir:
            raise JobError(f"{run_dir} holds a LoRA adapter: pass --model with its base checkpoint to score the policy")
        checkpoint = Checkpoint.open(model_dir, trust_remote_code, adapter=run_dir)
    else:
        checkpoint = Checkpoint.open(run_dir, trust_remote_code)
    device = resolve_device("auto")
    comp = manifest.get("computation") or {}
    with preserved_rng():
        model = checkpoint.load_model(resolve_dtype(comp.get("dtype", "float32"), device), device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return PolicyScorer(model, pad if pad is not None else 0, recorded_budget(comp))
