"""What a batching mode is: one way of running preference pairs through the reference, with the same numbers as
`runtime.logprobs.reference_logps` (the model's own forward over one unpadded sequence).

A mode is a subclass of BatchingMode in a module of its own, registered by one line in `precompute/modes/registry.py`.
Indices: sequence 2i is [prompt | chosen] of pair i, sequence 2i + 1 its [prompt | rejected]. Scores are one
record per sequence, schemas.format.TokenScores (log-probs, and with a top-k its ids, log-probs and tail), whatever
the mode and the head path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from schemas.encoding import EncodedPair

from runtime.architecture import shape_dependent
from runtime.cost import work

if TYPE_CHECKING:  # pyarrow only where scores are made: the registry is read by --help
    from schemas.columns import TokenScores

FLASH = ("flash_attention_2", "flash_attention_3")


class BatchingMode:
    """One batching mode. `description` is one line: the manifest records it (computation.batching), `--batching`'s
    help and the README's table of modes show it; `runs_with` (the README's table) says where it works."""

    name: str = ""
    description: str = ""
    runs_with: str = ""

    def plan(self, pairs: list[EncodedPair], token_budget: int) -> list:
        """The batches, in scoring order; what a batch holds is the mode's own business (indices of sequences,
        pairs or rows of pairs), `score` and `batch_cost` take one."""
        raise NotImplementedError

    def score(self, model, pairs: list[EncodedPair], batch, pad_id: int,
              top_k: int = 0) -> tuple[list[int], list[TokenScores], dict]:
        """(order, scores, counts) for one batch: the sequence indices it scored, each one's TokenScores (one
        entry per completion token; with top_k, the top_k most probable ids too: runtime.logprobs.token_scores), and
        {"processed": real tokens through the model, "slots": tokens including padding}."""
        raise NotImplementedError

    def probe_budget(self, pairs: list[EncodedPair]) -> int:
        """The token budget the batching-mode probe (choose.mode_values) scores its pairs with: by default all in
        one batch, so that a packing mode also packs the short probe pairs into the long pair's row and pads rows
        against it. A padded layout lowers it (`long_alone`): the long pair's sequences run alone and the short
        probe pairs form a padded batch of their own, instead of being padded to the long pair's length (which
        costs the long pair's forward once more for each of them and shows nothing the short padding does not)."""
        return 1 << 30

    def batch_cost(self, lengths: Lengths, batch) -> tuple[float, float]:
        """(slots, attention scores) the kernel computes for one batch (runtime/cost.py has one per layout)."""
        raise NotImplementedError

    def estimated_cost(self, pairs: list[EncodedPair], token_budget: int, hidden: int) -> float:
        """Work of scoring `pairs`, in token equivalents: runtime.cost.work of every batch's slots and attention
        scores (the cost model train-dpo's layouts are weighed by too)."""
        lengths = Lengths.of(pairs)
        slots = scores = 0.0
        for batch in self.plan(pairs, token_budget):
            batch_slots, batch_scores = self.batch_cost(lengths, batch)
            slots, scores = slots + batch_slots, scores + batch_scores
        return work(slots, scores, hidden)

    def unsupported(self, model, longest: int, attn: str) -> str | None:
        """Why this mode cannot run on `model` with attention `attn`, or None. `longest`: the longest prompt +
        completion of the job. Every mode but `single` needs numbers that do not depend on the batch's shape."""
        return shape_dependent(model, longest)

    def in_auto(self, attn: str) -> bool:
        """Whether `--batching auto` weighs this mode for attention implementation `attn`."""
        return False

    def warning(self, attn: str) -> str | None:
        """A line logged when this mode is asked for by name with attention `attn` (it runs, but badly)."""
        return None


def long_alone(widths: list[int]) -> int:
    """A token budget for batches cut at batch size x widest <= budget: just under two of the narrowest width that is
    more than half the widest, so each of those runs alone while any two widths under half the widest still fit
    one batch."""
    top = max(widths)
    return 2 * min(w for w in widths if 2 * w > top) - 1


@dataclass
class Lengths:
    """Token counts of a job's pairs: prompt P, chosen C, rejected R per pair; seqs: 2i = P + C, 2i + 1 = P + R."""

    P: np.ndarray
    C: np.ndarray
    R: np.ndarray
    seqs: np.ndarray

    @classmethod
    def of(cls, pairs: list[EncodedPair]) -> Lengths:
        P = np.array([len(p.prompt_ids) for p in pairs])
        C = np.array([len(p.chosen_ids) for p in pairs])
        R = np.array([len(p.rejected_ids) for p in pairs])
        return cls(P, C, R, np.stack([P + C, P + R], axis=1).ravel().astype(float))


def sequence(pairs: list[EncodedPair], i: int) -> tuple[list[int], list[int]]:
    """(prompt, completion) of sequence i."""
    pair = pairs[i // 2]
    return pair.prompt_ids, (pair.chosen_ids if i % 2 == 0 else pair.rejected_ids)


def sequence_lengths(pairs: list[EncodedPair]) -> list[int]:
    return [len(p.prompt_ids) + len(c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]

