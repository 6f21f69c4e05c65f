"""How precompute-ref batches pairs through the reference, and which way it picks by default.

Modes (all give the plain forward's numbers; the stamps never depend on the mode):
  full_forward   [prompt | chosen] and [prompt | rejected] as separate right-padded rows, length-sorted batches
  varlen         the same sequences packed into one unpadded row per batch (varlen flash attention)
  kv_cache       each prompt once, chosen and rejected continue from its key/value cache (kvcache.py)
  shared_prompt  each prompt once, one [prompt | chosen | rejected] row per pair with a tree mask (packing.py)
  packed         as shared_prompt, several pairs per row

`auto` ranks the modes the attention implementation can run by the work they would do on the job's first shard
(estimated_cost), checks the cheapest on two real pairs against full_forward and takes the first that agrees. The
choice depends only on the data, the model and the device, so a resumed job picks the same mode again.
"""

from __future__ import annotations

import numpy as np
import torch

from schemas.encoding import EncodedPair

from . import MODES
from .kvcache import FLASH, kv_batches, kv_cache_batch, varlen_batch, varlen_batches
from runtime.logprobs import completion_logps, pad_sequences, token_logps
from runtime.packing import length_batches, pack_rows, row_batches, tree_batch
from runtime.packing import length_dependent_rope as _length_dependent_rope, sliding_window as _sliding_window

DESCRIPTIONS = {
    "full_forward": "length-sorted sequences within each shard, right padding",
    "varlen": "sequences packed into one unpadded row per batch, position ids restarting per sequence",
    "kv_cache": "each prompt once (right-padded, prompt-length-sorted batches); chosen and rejected continue from "
                "its key/value cache",
    "shared_prompt": "one [prompt|chosen|rejected] row per pair with a tree attention mask",
    "packed": "pairs packed into rows no longer than the longest pair, tree attention mask",
}


@torch.no_grad()
def score_pairs(model, pairs: list[EncodedPair], pad_id: int, token_budget: int, mode: str = "full_forward",
                on_batch=None):
    """Reference log-probs per completion token for each pair: (chosen list, rejected list, stats).

    stats: tokens (of the plain sequences: the work done, whatever the mode), processed (real tokens through the
    model), slots (tokens including padding).
    """
    device = next(model.parameters()).device
    values: list = [None] * (2 * len(pairs))  # chosen of pair i at 2i, rejected at 2i + 1
    stats = {"tokens": 0, "processed": 0, "slots": 0}
    seqs = [(p.prompt_ids, c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    for batch in plan_batches(pairs, mode, token_budget):
        if mode in ("full_forward", "varlen"):
            order = batch
            clen = torch.tensor([len(seqs[i][1]) for i in order])
            if mode == "varlen":
                flat, counts = varlen_batch(model, seqs, batch)
            else:
                ids, mask = pad_sequences([seqs[i][0] + seqs[i][1] for i in order], pad_id, device)
                flat = completion_logps(model, ids, mask, torch.tensor([len(seqs[i][0]) for i in order]), clen)
                counts = {"processed": int(mask.sum()), "slots": mask.numel()}
            parts = _split(flat, clen)
        elif mode == "kv_cache":
            order = [2 * i + k for i in batch for k in (0, 1)]
            parts, counts = kv_cache_batch(model, pairs, batch, pad_id)
        else:
            order = [2 * i + k for row in batch for i in row for k in (0, 1)]
            inputs, rows, sources, targets = tree_batch(pairs, batch, pad_id, model.dtype, device)
            parts = _split(token_logps(model, inputs, rows, sources, targets),
                           torch.tensor([len(seqs[i][1]) for i in order]))
            counts = {"processed": sum(len(seqs[i][1]) + (len(seqs[i][0]) if i % 2 == 0 else 0) for i in order),
                      "slots": inputs["input_ids"].numel()}
        for i, part in zip(order, parts):
            values[i] = part
        tokens = sum(len(seqs[i][0]) + len(seqs[i][1]) for i in order)
        stats = {"tokens": stats["tokens"] + tokens, "processed": stats["processed"] + counts["processed"],
                 "slots": stats["slots"] + counts["slots"]}
        if on_batch:
            on_batch(len(order) / 2, tokens)
    return values[0::2], values[1::2], stats


def plan_batches(pairs: list[EncodedPair], mode: str, token_budget: int) -> list:
    """Batches of sequence indices (full_forward, varlen: 2i chosen, 2i + 1 rejected), of pair indices (kv_cache)
    or of rows of pair indices (shared_prompt, packed)."""
    if mode in ("full_forward", "varlen"):
        lengths = [len(p.prompt_ids) + len(c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
        return (length_batches if mode == "full_forward" else varlen_batches)(lengths, token_budget)
    if mode == "kv_cache":
        return kv_batches(pairs, token_budget)
    if mode in ("shared_prompt", "packed"):
        lengths = [len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs]
        return row_batches(pack_rows(lengths, mode == "packed"), lengths, token_budget)
    raise ValueError(f"unknown batching mode {mode!r}; one of {', '.join(MODES)}")


def _split(flat, lengths: torch.Tensor) -> list[np.ndarray]:
    flat = flat.cpu().numpy() if isinstance(flat, torch.Tensor) else flat
    return np.split(flat, np.cumsum(lengths.numpy())[:-1])


def estimated_cost(pairs: list[EncodedPair], mode: str, token_budget: int, hidden: int) -> float:
    """Work of scoring `pairs` in `mode`, in token equivalents: every slot that runs through the layers (padding
    included) plus the attention scores the kernel computes, each weighted 1 / (6 * hidden) of a token (a layer's
    linear maps cost about 24 h^2 FLOPs per token, attention about 4 h per score). Masked scores count: a custom
    or padding mask makes the kernel compute them anyway; causal attention without padding skips the upper
    triangle, as flash attention does per sequence (varlen)."""
    P = np.array([len(p.prompt_ids) for p in pairs])
    C = np.array([len(p.chosen_ids) for p in pairs])
    R = np.array([len(p.rejected_ids) for p in pairs])
    seqs = np.stack([P + C, P + R], axis=1).ravel().astype(float)  # sequence 2i chosen, 2i + 1 rejected
    slots = scores = 0.0
    for batch in plan_batches(pairs, mode, token_budget):
        if mode == "full_forward":
            L = seqs[batch]
            slots, scores = slots + len(L) * L.max(), scores + len(L) * L.max() ** 2 * _causal(L)
        elif mode == "varlen":
            L = seqs[batch]
            slots, scores = slots + L.sum(), scores + (L**2).sum() / 2
        elif mode == "kv_cache":
            p, c = P[batch].max(), np.maximum(C[batch], R[batch]).max() - 1
            slots += len(batch) * (p + 2 * c)
            scores += len(batch) * (p**2 * _causal(P[batch]) + 2 * c * (p + c))
        else:
            width = max(sum(P[i] + C[i] + R[i] for i in row) for row in batch)
            slots, scores = slots + len(batch) * width, scores + len(batch) * width**2
    return float(slots + scores / (6 * hidden))


def _causal(lengths: np.ndarray) -> float:
    """Share of the score matrix computed: without padding transformers lets the kernel skip the upper triangle."""
    return 0.5 if (lengths == lengths[0]).all() else 1.0


def unsupported(mode: str, model, longest: int) -> str | None:
    """Why `mode` cannot run on this model, or None. `longest`: the longest prompt + completion of the job."""
    attn, config = model.config._attn_implementation, model.config.get_text_config()
    window = _sliding_window(config)
    if mode in ("shared_prompt", "packed", "kv_cache") and window and longest > window:
        return f"sliding-window attention (window {window}, sequences up to {longest} tokens)"
    rope = _length_dependent_rope(config)
    if mode in ("shared_prompt", "packed", "kv_cache") and rope and longest > rope[1]:
        return f"{rope[0]} RoPE changes its frequencies past {rope[1]} positions (sequences up to {longest} tokens)"
    if mode in ("shared_prompt", "packed") and attn not in ("sdpa", "eager"):
        return f"{attn} attention cannot take the tree mask"
    if mode == "kv_cache" and getattr(model.config, "is_encoder_decoder", False):  # the outer config says so
        return "encoder-decoder model"
    layers = set(getattr(config, "layer_types", None) or ())
    if mode == "kv_cache" and layers - {"full_attention", "sliding_attention"}:
        return f"layers other than attention ({', '.join(sorted(layers))}) keep state a padded prompt would corrupt"
    return None


def candidates(attn: str) -> tuple[str, ...]:
    """The modes auto considers for an attention implementation (varlen only where it runs without a dense mask)."""
    if attn in ("sdpa", "eager"):
        return ("packed", "kv_cache", "full_forward")
    if attn in FLASH:
        return ("kv_cache", "varlen", "full_forward")
    return ("kv_cache", "full_forward")


def choose_mode(model, requested: str, sample: list[EncodedPair], longest: int, pad_id: int, token_budget: int,
                log) -> str:
    """The mode to run: `requested`, or for auto the cheapest by estimated_cost; either way a shared-prompt or
    packed mode must first match full_forward on the two shortest pairs of `sample`, else full_forward is used and
    the reason logged once."""
    attn = model.config._attn_implementation
    if requested == "auto":
        hidden = getattr(model.config.get_text_config(), "hidden_size", 1024)
        cost = {m: estimated_cost(sample, m, token_budget, hidden) for m in candidates(attn)}
        order = sorted(cost, key=lambda m: (cost[m], m != "full_forward"))
    else:
        cost, order = {}, [requested]
    if requested == "varlen" and attn not in FLASH:
        log(f"warning: varlen with {attn} attention builds a dense mask over each batch's whole row (slow); it is "
            "meant for flash attention")
    probe = probe_pairs(sample)
    rejected = []
    for mode in order:
        if mode == "full_forward":
            break
        reason = unsupported(mode, model, longest) or _disagrees(model, mode, probe, pad_id)
        if reason is None:
            ratio = f"; estimated {cost['full_forward'] / cost[mode]:.2f}x less work than full_forward" if cost else ""
            log(f"batching: {mode} ({attn} attention{ratio}; matches the plain forward on a probe)")
            return mode
        rejected.append(f"{mode}: {reason}")
    why = "; ".join(rejected) or ("the cheapest for this data" if cost else "requested")
    log(f"batching: full_forward ({why})")
    return "full_forward"


def probe_pairs(sample: list[EncodedPair], prompt_cap: int = 24, completion_cap: int = 8) -> list[EncodedPair]:
    """Two real pairs cut to a few tokens: the shortest, and the shortest whose prompt length differs from it
    (cut to differ still), so the probe also runs a padded batch of prompts and of completions. Short keeps the
    probe cheap; what it checks (masks, cache continuation, positions) does not depend on the length, and the
    length limits that do (sliding windows) are checked by `unsupported`."""
    by_length = sorted(sample, key=lambda p: len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids))
    if not by_length:
        return []
    first = by_length[0]
    other = next((p for p in by_length if len(p.prompt_ids) != len(first.prompt_ids)), None)
    other = other if other is not None else (by_length[1] if len(by_length) > 1 else None)

    def cut(pair: EncodedPair, n: int) -> EncodedPair:  # rejected one token shorter: completions are padded too
        return EncodedPair(pair.prompt_ids[:n], pair.chosen_ids[:completion_cap],
                           pair.rejected_ids[: completion_cap - 1])

    probe = [cut(first, prompt_cap)]
    if other is not None:
        n = min(len(other.prompt_ids), prompt_cap)
        if n == len(probe[0].prompt_ids) and n > 1:
            n -= 1
        probe.append(cut(other, n))
    return probe


def _disagrees(model, mode: str, probe: list[EncodedPair], pad_id: int) -> str | None:
    try:
        ref_c, ref_r, _ = score_pairs(model, probe, pad_id, 1 << 30, "full_forward")
        got_c, got_r, _ = score_pairs(model, probe, pad_id, 1 << 30, mode)
    except Exception as e:  # an architecture whose forward rejects the inputs this mode needs
        return f"not supported by this model ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ref_c + ref_r, got_c + got_r))
    tolerance = 1e-4 if model.dtype == torch.float32 else 0.25
    if diff > tolerance:
        return f"differs from the plain forward by {diff:.2e} on this model"
    return None
