"""varlen: [prompt | completion] sequences concatenated into a single row per batch, position ids restarting at 0
for each sequence and no attention mask, which transformers turns into varlen flash attention (cu_seqlens): no
padding at all. Only flash attention makes this cheap; sdpa and eager would build a dense mask over the whole row.
"""

from __future__ import annotations

import numpy as np
from runtime.cost import unpadded_sequences
from runtime.placement import input_device

from .base import FLASH, BatchingMode, sequence, sequence_lengths
from runtime.architecture import state_across_rows


def varlen_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices sorted by length (longest first) and cut so that each batch's total length fits token_budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current, total = [], [], 0
    for i in order:
        if current and total + lengths[i] > token_budget:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += lengths[i]
    return batches + ([current] if current else [])


def varlen_batch(model, seqs: list[tuple[list[int], list[int]]], top_k: int = 0) -> tuple[object, dict]:
    """Flattened completion scores of the (prompt, completion) sequences `seqs`, packed into one row."""
    import torch

    from runtime.logprobs import token_scores

    device = input_device(model)
    ids, positions, sources, targets = [], [], [], []
    for prompt, completion in seqs:
        start = len(ids)
        ids += prompt + completion
        positions += range(len(prompt) + len(completion))
        at = start + len(prompt) + np.arange(len(completion))
        sources.append(at - 1)
        targets.append(at)
    ids_t = torch.as_tensor([ids], device=device)
    src = torch.as_tensor(np.concatenate(sources), device=device)
    inputs = {"input_ids": ids_t, "position_ids": torch.as_tensor([positions], device=device)}
    flat = token_scores(model, inputs, torch.zeros_like(src), src,
                        ids_t[0, torch.as_tensor(np.concatenate(targets), device=device)], top_k=top_k)
    return flat, {"processed": len(ids), "slots": len(ids)}


class Varlen(BatchingMode):
    name = "varlen"
    description = "sequences packed into one unpadded row per batch, position ids restarting per sequence"
    runs_with = "flash attention (sdpa, eager: a dense mask over the whole row); no recurrent layers"

    def plan(self, pairs, token_budget):
        return varlen_batches(sequence_lengths(pairs), token_budget)

    def score(self, model, pairs, batch, pad_id, top_k=0):
        import torch

        from runtime.logprobs import split_scores

        seqs = [sequence(pairs, i) for i in batch]
        flat, counts = varlen_batch(model, seqs, top_k)
        return batch, split_scores(flat, torch.tensor([len(c) for _, c in seqs])), counts

    def batch_cost(self, lengths, batch):
        return unpadded_sequences(lengths.seqs[batch])

    def unsupported(self, model, longest, attn):
        return super().unsupported(model, longest, attn) or state_across_rows(model)

    def in_auto(self, attn):
        return attn in FLASH

    def warning(self, attn):
        if attn in FLASH:
            return None
        return (f"warning: varlen with {attn} attention builds a dense mask over each batch's whole row (slow); it is "
                "meant for flash attention")
