"""Scoring a job's pairs in a named mode: the mode plans the batches and scores each; this collects the values."""

from __future__ import annotations

import numpy as np
import torch

from schemas.encoding import EncodedPair

from runtime.cost import work

from .registry import lookup
from .base import Lengths, sequence


class Current:
    """The model score_pairs scores with, read anew for each batch: the on_batch hook may replace `model` between
    batches (precompute-ref's --torch-compile auto switches to the compiled forward mid-job)."""

    def __init__(self, model):
        self.model = model


@torch.no_grad()
def score_pairs(model, pairs: list[EncodedPair], pad_id: int, token_budget: int, mode: str = "full_forward",
                on_batch=None, top_k: int = 0):
    """Reference scores per completion token for each pair, a schemas.format.TokenScores per completion (log-probs;
    with top_k also the top_k most probable ids, their log-probs and the tail): (chosen list, rejected list, stats).

    stats: tokens (of the plain sequences: the work done, whatever the mode), processed (real tokens through the
    model), slots (tokens including padding). on_batch(pairs, tokens) is called after each batch with the pairs it
    completed (both sequences scored: a mode may score a pair's two in different batches) and its tokens. `model`
    may be a Current, whose model the hook may replace for the batches after.
    """
    way = lookup(mode)
    current = model if isinstance(model, Current) else Current(model)
    values: list = [None] * (2 * len(pairs))  # chosen of pair i at 2i, rejected at 2i + 1
    scored = np.zeros(2 * len(pairs), dtype=bool)
    stats = {"tokens": 0, "processed": 0, "slots": 0}
    for batch in way.plan(pairs, token_budget):
        order, parts, counts = way.score(current.model, pairs, batch, pad_id, top_k=top_k)
        for i, part in zip(order, parts):
            values[i] = part
        scored[order] = True
        touched = np.unique(np.asarray(order) // 2)  # a pair touched now and whole now was completed now
        completed = int((scored[2 * touched] & scored[2 * touched + 1]).sum())
        tokens = sum(len(prompt) + len(completion) for prompt, completion in (sequence(pairs, i) for i in order))
        stats = {"tokens": stats["tokens"] + tokens, "processed": stats["processed"] + counts["processed"],
                 "slots": stats["slots"] + counts["slots"]}
        if on_batch:
            on_batch(completed, tokens)
    return values[0::2], values[1::2], stats


def estimated_cost(pairs: list[EncodedPair], mode: str, token_budget: int, hidden: int) -> float:
    """Work of scoring `pairs` in `mode`, in token equivalents (see BatchingMode.estimated_cost)."""
    return lookup(mode).estimated_cost(pairs, token_budget, hidden)


def batch_costs(pairs: list[EncodedPair], mode: str, token_budget: int, hidden: int) -> list[float]:
    """Work of each batch score_pairs runs for `pairs`, in its order, in token equivalents (estimated_cost's terms)."""
    if not pairs:  # (a shard whose pairs the probe scored whole: none run, modes.to_score)
        return []
    way, lengths = lookup(mode), Lengths.of(pairs)
    return [work(*way.batch_cost(lengths, batch), hidden) for batch in way.plan(pairs, token_budget)]
