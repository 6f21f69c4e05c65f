"""single: one unpadded sequence per forward, position state reset before each: the definition's own shape, for
models whose numbers depend on the batch's shape (ALiBi, dynamic/longrope RoPE past its original context)."""

from __future__ import annotations

from runtime.cost import unpadded_sequences
from runtime.placement import input_device

from .base import BatchingMode, sequence


def single_sequence(model, prompt: list[int], completion: list[int], top_k: int = 0) -> tuple[object, dict]:
    """Completion scores of one sequence scored alone: unpadded, batch of one, fresh position state."""
    import torch

    from runtime.logprobs import reset_position_state, token_scores

    device = input_device(model)
    ids = torch.as_tensor([prompt + completion], device=device)
    at = torch.arange(len(prompt), ids.shape[1], device=device)
    reset_position_state(model)
    flat = token_scores(model, {"input_ids": ids}, torch.zeros_like(at), at - 1, ids[0, at], top_k=top_k)
    reset_position_state(model)
    return flat, {"processed": ids.shape[1], "slots": ids.shape[1]}


class Single(BatchingMode):
    name = "single"
    description = "one unpadded sequence per forward, position state reset before each (the definition's own shape)"
    runs_with = "any model; the last fall-back"

    def plan(self, pairs, token_budget):
        return [[i] for i in range(2 * len(pairs))]

    def score(self, model, pairs, batch, pad_id, top_k=0):
        import torch

        from runtime.logprobs import split_scores

        prompt, completion = sequence(pairs, batch[0])
        flat, counts = single_sequence(model, prompt, completion, top_k)
        return batch, split_scores(flat, torch.tensor([len(completion)])), counts

    def batch_cost(self, lengths, batch):
        return unpadded_sequences(lengths.seqs[batch])

    def unsupported(self, model, longest, attn):
        return None
