"""full_forward: [prompt | chosen] and [prompt | rejected] as separate right-padded rows, length-sorted batches (the
plain forward every other tool runs; the fall-back of every other mode)."""

from __future__ import annotations

from runtime.cost import padded_rows
from runtime.packing import length_batches

from .base import BatchingMode, long_alone, sequence, sequence_lengths


class FullForward(BatchingMode):
    name = "full_forward"
    description = "length-sorted sequences within each shard, right padding"
    runs_with = "any model"

    def plan(self, pairs, token_budget):
        return length_batches(sequence_lengths(pairs), token_budget)

    def score(self, model, pairs, batch, pad_id, top_k=0):
        from runtime.logprobs import padded_scores

        scores, counts = padded_scores(model, [sequence(pairs, i) for i in batch], pad_id, top_k)
        return batch, scores, counts

    def probe_budget(self, pairs):
        return long_alone(sequence_lengths(pairs))  # length_batches' slots per sequence

    def batch_cost(self, lengths, batch):
        return padded_rows(lengths.seqs[batch])

    def in_auto(self, attn):
        return True
