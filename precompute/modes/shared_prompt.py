"""shared_prompt: each prompt once, one [prompt | chosen | rejected] row per pair with a tree attention mask
(runtime/packing.py: the rejected branch restarts its positions after the prompt and never sees the chosen one)."""

from __future__ import annotations

from runtime.cost import tree_rows
from runtime.placement import input_device
from runtime.packing import pack_rows, row_batches, tree_batch

from .base import BatchingMode, sequence
from runtime.architecture import tree_mask_unsupported


class SharedPrompt(BatchingMode):
    name = "shared_prompt"
    description = "one [prompt|chosen|rejected] row per pair with a tree attention mask"
    runs_with = "sdpa, eager (a custom 4-D mask); no recurrent layers, no sliding window shorter than the data"
    packs = False  # several pairs per row (packed)

    def plan(self, pairs, token_budget):
        lengths = [len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs]
        return row_batches(pack_rows(lengths, self.packs), lengths, token_budget)

    def score(self, model, pairs, batch, pad_id, top_k=0):
        import torch

        from runtime.logprobs import split_scores, token_scores

        order = [2 * i + k for row in batch for i in row for k in (0, 1)]
        seqs = [sequence(pairs, i) for i in order]
        inputs, rows, sources, targets = tree_batch(pairs, batch, pad_id, model.dtype, input_device(model))
        values = split_scores(token_scores(model, inputs, rows, sources, targets, top_k=top_k),
                       torch.tensor([len(c) for _, c in seqs]))
        processed = sum(len(c) + (len(p) if i % 2 == 0 else 0) for i, (p, c) in zip(order, seqs))  # prompts once
        return order, values, {"processed": processed, "slots": inputs["input_ids"].numel()}

    def batch_cost(self, lengths, batch):
        P, C, R = lengths.P, lengths.C, lengths.R
        return tree_rows([sum(P[i] + C[i] + R[i] for i in row) for row in batch])

    def unsupported(self, model, longest, attn):
        return tree_mask_unsupported(model, longest, attn)  # the rule train-dpo's prefix_shared layout follows too
