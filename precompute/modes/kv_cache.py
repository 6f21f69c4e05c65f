"""kv_cache: one forward runs a batch of prompts (right-padded) and keeps their key/value cache. The cache is
repeated once per completion and a second forward runs [chosen, rejected] for every prompt on top of it, with
position ids continuing at each prompt's own length and the attention mask hiding the prompts' padding. The first
token of both completions is scored from the prompt's last position in the first forward. Causal attention keeps
its fast path for the prompts, and any attention implementation that supports a cache and a padding mask works
(sdpa, eager, flash attention).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import numpy as np

from schemas.encoding import EncodedPair

from runtime.cost import causal
from runtime.placement import input_device

from .base import BatchingMode, long_alone
from runtime.architecture import state_layers, window_too_short

if TYPE_CHECKING:
    from schemas.columns import TokenScores


def kv_batches(pairs: list[EncodedPair], token_budget: int) -> list[list[int]]:
    """Pairs sorted by prompt length (longest first), cut so that prompt slots plus both completions' slots fit
    token_budget: len(batch) * (longest prompt + 2 * longest completion)."""
    order = sorted(range(len(pairs)), key=lambda i: (-len(pairs[i].prompt_ids), -_completion(pairs[i]), i))
    batches, current, prompt, completion = [], [], 0, 0
    for i in order:
        p, c = len(pairs[i].prompt_ids), _completion(pairs[i])
        if current and (len(current) + 1) * (max(prompt, p) + 2 * max(completion, c)) > token_budget:
            batches.append(current)
            current, prompt, completion = [], 0, 0
        current.append(i)
        prompt, completion = max(prompt, p), max(completion, c)
    return batches + ([current] if current else [])


def _completion(pair: EncodedPair) -> int:
    return max(len(pair.chosen_ids), len(pair.rejected_ids))


def _cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use whichever this version's forward takes."""
    from runtime.logprobs import unwrap

    params = inspect.signature(unwrap(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def kv_cache_batch(model, pairs: list[EncodedPair], batch: list[int], pad_id: int,
                   top_k: int = 0) -> tuple[list[TokenScores], dict]:
    """Per-token scores (TokenScores) of chosen and rejected for the pairs in `batch`, in the order
    [chosen of batch[0], rejected of batch[0], chosen of batch[1], ...], plus token counts."""
    import torch

    from runtime.logprobs import pad_sequences, split_scores, token_scores
    from schemas.columns import TokenScores

    device = input_device(model)
    completions = [c for i in batch for c in (pairs[i].chosen_ids, pairs[i].rejected_ids)]
    ids, mask = pad_sequences([pairs[i].prompt_ids for i in batch], pad_id, device)
    plen = mask.sum(1).repeat_interleave(2)  # one row per completion from here on
    key = _cache_kwarg(model)
    first, out = token_scores(model, {"input_ids": ids, "attention_mask": mask, "use_cache": True},
                              torch.arange(len(batch), device=device).repeat_interleave(2), plen - 1,
                              torch.as_tensor([c[0] for c in completions], device=device), return_output=True,
                              top_k=top_k)
    # each prompt's last position scores the first token of both completions
    first = split_scores(first, torch.ones(len(completions), dtype=torch.long))
    rest = [c[1:] for c in completions]  # input c[:-1] predicts c[1:]
    slots = ids.numel()
    if any(rest):
        cache = getattr(out, key)
        cache.batch_repeat_interleave(2)
        cont, cont_mask = pad_sequences([c[:-1] or [pad_id] for c in completions], pad_id, device)
        cont_mask[:, 0] = torch.as_tensor([len(r) > 0 for r in rest], device=device)  # a 1-token completion: no input
        width = cont.shape[1]
        lens = torch.as_tensor([len(r) for r in rest], device=device)
        rows, cols = (torch.arange(width, device=device) < lens[:, None]).nonzero(as_tuple=True)  # row-major
        inputs = {"input_ids": cont, "attention_mask": torch.cat([mask.repeat_interleave(2, 0), cont_mask], 1),
                  "position_ids": plen[:, None] + torch.arange(width, device=device), key: cache, "use_cache": True}
        targets = torch.as_tensor([t for r in rest for t in r], device=device)
        flat = token_scores(model, inputs, rows, cols, targets, top_k=top_k)
        slots += cont.numel()
        parts = split_scores(flat, lens.cpu())
    else:
        parts = [f.map(lambda v: v[:0]) for f in first]
    values = [TokenScores.join([first[k], parts[k]], np.concatenate) for k in range(len(completions))]
    processed = int(mask.sum()) + sum(len(c) for c in completions) - len(completions)
    return values, {"processed": processed, "slots": slots}


class KvCache(BatchingMode):
    name = "kv_cache"
    description = ("each prompt once (right-padded, prompt-length-sorted batches); chosen and rejected continue from "
                   "its key/value cache")
    runs_with = ("any attention with a key/value cache (sdpa, eager, flash); decoder-only, no recurrent layers, no "
                 "sliding window shorter than the data")

    def plan(self, pairs, token_budget):
        return kv_batches(pairs, token_budget)

    def score(self, model, pairs, batch, pad_id, top_k=0):
        values, counts = kv_cache_batch(model, pairs, batch, pad_id, top_k)
        return [2 * i + k for i in batch for k in (0, 1)], values, counts

    def probe_budget(self, pairs):
        return long_alone([len(p.prompt_ids) + 2 * _completion(p) for p in pairs])  # kv_batches' slots per pair

    def batch_cost(self, lengths, batch):
        P, C, R = lengths.P, lengths.C, lengths.R
        p, c = P[batch].max(), np.maximum(C[batch], R[batch]).max() - 1
        return len(batch) * (p + 2 * c), len(batch) * (p**2 * causal(P[batch]) + 2 * c * (p + c))

    def unsupported(self, model, longest, attn):
        reason = super().unsupported(model, longest, attn) or window_too_short(model, longest)
        if reason:
            return reason
        if getattr(model.config, "is_encoder_decoder", False):  # the outer config says so
            return "encoder-decoder model"
        state = state_layers(model)
        if state:
            return f"layers other than attention ({', '.join(state)}) keep state a padded prompt would corrupt"
        return None

    def in_auto(self, attn):
        return True
