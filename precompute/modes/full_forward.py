"""full_forward: [prompt | chosen] and [prompt | rejected] as separate right-padded rows, length-sorted batches (the
plain forward every other tool runs; the fall-back of every other mode)."""

from __future__ import annotations

import torch

from runtime.cost import padded_rows
from runtime.logprobs import completion_scores, pad_sequences
from runtime.placement import input_device
from runtime.packing import length_batches

from .base import BatchingMode, sequence, sequence_lengths, split


class FullForward(BatchingMode):
    name = "full_forward"
    description = "length-sorted sequences within each shard, right padding"
    runs_with = "any model"

    def plan(self, pairs, token_budget):
        return length_batches(sequence_lengths(pairs), token_budget)

    def score(self, model, pairs, batch, pad_id, top_k=0):
        seqs = [sequence(pairs, i) for i in batch]
        ids, mask = pad_sequences([p + c for p, c in seqs], pad_id, input_device(model))
        clen = torch.tensor([len(c) for _, c in seqs])
        flat = completion_scores(model, ids, mask, torch.tensor([len(p) for p, _ in seqs]), clen, top_k=top_k)
        return batch, split(flat, clen), {"processed": int(mask.sum()), "slots": mask.numel()}

    def batch_cost(self, lengths, batch):
        return padded_rows(lengths.seqs[batch])

    def in_auto(self, attn):
        return True
