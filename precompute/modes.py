"""How precompute-ref batches pairs through the reference, and which way it picks by default.

Modes (all give the numbers of `runtime.logprobs.reference_logps`, the model's own forward over one unpadded
sequence; the stamps never depend on the mode):
  full_forward   [prompt | chosen] and [prompt | rejected] as separate right-padded rows, length-sorted batches
  varlen         the same sequences packed into one unpadded row per batch (varlen flash attention)
  kv_cache       each prompt once, chosen and rejected continue from its key/value cache (kvcache.py)
  shared_prompt  each prompt once, one [prompt | chosen | rejected] row per pair with a tree mask (packing.py)
  packed         as shared_prompt, several pairs per row
  single         one unpadded sequence per forward, position state reset: for models whose numbers depend on the
                 batch's shape (ALiBi, dynamic/longrope RoPE past its original context)

`auto` ranks the modes the attention implementation can run by the work they would do on the job's first shard
(estimated_cost). Every mode, asked for or ranked, is checked against reference_logps on real pairs (short ones and
the job's longest) before it runs; the first that agrees is taken, else the job is refused. The choice depends only
on the data, the model and the device, so a resumed job picks the same mode again.
"""

from __future__ import annotations

import numpy as np
import torch

from schemas.encoding import EncodedPair

from . import MODES
from .kvcache import FLASH, kv_batches, kv_cache_batch, varlen_batch, varlen_batches
from runtime.errors import JobError
from runtime.logprobs import completion_logps, pad_sequences, reference_logps, reset_position_state, token_logps
from runtime.packing import length_batches, pack_rows, row_batches, tree_batch
from runtime.packing import length_dependent_rope as _length_dependent_rope, sliding_window as _sliding_window

DESCRIPTIONS = {
    "full_forward": "length-sorted sequences within each shard, right padding",
    "varlen": "sequences packed into one unpadded row per batch, position ids restarting per sequence",
    "kv_cache": "each prompt once (right-padded, prompt-length-sorted batches); chosen and rejected continue from "
                "its key/value cache",
    "shared_prompt": "one [prompt|chosen|rejected] row per pair with a tree attention mask",
    "packed": "pairs packed into rows no longer than the longest pair, tree attention mask",
    "single": "one unpadded sequence per forward, position state reset before each (the definition's own shape)",
}


def single_sequence(model, prompt: list[int], completion: list[int]) -> tuple[torch.Tensor, dict]:
    """Completion log-probs of one sequence scored alone: unpadded, batch of one, fresh position state."""
    device = next(model.parameters()).device
    ids = torch.as_tensor([prompt + completion], device=device)
    at = torch.arange(len(prompt), ids.shape[1], device=device)
    reset_position_state(model)
    flat = token_logps(model, {"input_ids": ids}, torch.zeros_like(at), at - 1, ids[0, at])
    reset_position_state(model)
    return flat, {"processed": ids.shape[1], "slots": ids.shape[1]}


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
        if mode in ("full_forward", "varlen", "single"):
            order = batch
            clen = torch.tensor([len(seqs[i][1]) for i in order])
            if mode == "single":
                flat, counts = single_sequence(model, *seqs[batch[0]])
            elif mode == "varlen":
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
    if mode == "single":
        return [[i] for i in range(2 * len(pairs))]
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
        elif mode in ("varlen", "single"):
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


# ---------------------------------------------------------------------------------------------------------------
# which mode runs


HEAD_ELEMENTS = 2**28  # logits one forward may hold when the model's own head has to produce them (1 GiB float32)


def effective_budget(model, token_budget: int, longest: int) -> int:
    """token_budget, lowered where the model's own head makes the logits (head.py) so that a forward's logits stay
    within HEAD_ELEMENTS (never below one sequence of the job)."""
    from runtime.head import verified_head

    if verified_head(model) == "hook":
        return token_budget
    vocab = model.get_output_embeddings().weight.shape[0]
    return min(token_budget, max(longest, HEAD_ELEMENTS // vocab))


def _alibi(config) -> bool:
    attn = getattr(config, "attn_config", None)
    return (config.model_type == "bloom" or getattr(config, "alibi", False) is True
            or getattr(config, "position_embedding_type", None) == "alibi"
            or (getattr(attn, "alibi", False) if not isinstance(attn, dict) else attn.get("alibi", False)) is True)


def shape_dependent(model, longest: int) -> str | None:
    """Why this model's numbers for a sequence depend on what else is in the forward (batch width, packing,
    earlier forwards), or None. Such a model is scored one sequence at a time (mode `single`)."""
    config = model.config.get_text_config()
    rope = _length_dependent_rope(config)
    if rope and longest > rope[1]:
        return (f"{rope[0]} RoPE picks its frequencies from the longest position of a forward (changes past "
                f"{rope[1]}; sequences up to {longest} tokens)")
    if _alibi(config):
        return "ALiBi position biases are computed over a forward's whole row and mask"
    return None


def unsupported(mode: str, model, longest: int) -> str | None:
    """Why `mode` cannot run on this model, or None. `longest`: the longest prompt + completion of the job."""
    attn, config = model.config._attn_implementation, model.config.get_text_config()
    if mode == "single":
        return None
    reason = shape_dependent(model, longest)
    if reason:
        return reason
    window = _sliding_window(config)
    if mode in ("shared_prompt", "packed", "kv_cache") and window and longest > window:
        return f"sliding-window attention (window {window}, sequences up to {longest} tokens)"
    if mode in ("shared_prompt", "packed") and attn not in ("sdpa", "eager"):
        return f"{attn} attention cannot take the tree mask"
    if mode == "kv_cache" and getattr(model.config, "is_encoder_decoder", False):  # the outer config says so
        return "encoder-decoder model"
    state = _state_layers(config)
    if mode == "kv_cache" and state:
        return f"layers other than attention ({', '.join(state)}) keep state a padded prompt would corrupt"
    if mode in ("varlen", "shared_prompt", "packed") and state:
        return f"layers other than attention ({', '.join(state)}) carry state across a packed row"
    return None


ATTENTION_LAYERS = {"full_attention", "sliding_attention", "attention", "chunked_attention"}
STATE_SPACE = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}


def _state_layers(config) -> list[str]:
    """Kinds of layers that carry a recurrent state along the sequence (state-space, linear attention,
    convolutions), from the config's per-layer lists; a pure state-space model's type counts as one."""
    kinds = set()
    for key in ("layer_types", "block_types", "layers_block_type"):
        kinds |= set(getattr(config, key, None) or ())
    found = sorted(str(k) for k in kinds - ATTENTION_LAYERS)
    return found or ([config.model_type] if config.model_type in STATE_SPACE else [])


def candidates(attn: str) -> tuple[str, ...]:
    """The modes auto considers for an attention implementation (varlen only where it runs without a dense mask)."""
    if attn in ("sdpa", "eager"):
        return ("packed", "kv_cache", "full_forward")
    if attn in FLASH:
        return ("kv_cache", "varlen", "full_forward")
    return ("kv_cache", "full_forward")


def choose_mode(model, requested: str, sample: list[EncodedPair], longest: int, pad_id: int, token_budget: int,
                log, long_pairs: list[EncodedPair] = ()) -> str:
    """The mode to run: `requested`, or for auto the cheapest by estimated_cost. Whatever the mode (full_forward
    and single included), it must first reproduce `reference_logps` on probe pairs (short ones of `sample`, and
    the longest of `sample` and `long_pairs`); one that does not falls back to the next (auto: the next cheapest;
    a requested mode: full_forward, then single), the reason logged once. A model whose numbers depend on batch shape runs single.
    Refuses (JobError) if nothing reproduces the reference."""
    attn = model.config._attn_implementation
    cost = {}
    if requested == "auto":
        hidden = getattr(model.config.get_text_config(), "hidden_size", 1024)
        cost = {m: estimated_cost(sample, m, token_budget, hidden) for m in candidates(attn)}
        order = sorted(cost, key=lambda m: (cost[m], m != "full_forward")) + ["single"]
    else:
        order = list(dict.fromkeys([requested, "full_forward", "single"]))
    if requested == "varlen" and attn not in FLASH:
        log(f"warning: varlen with {attn} attention builds a dense mask over each batch's whole row (slow); it is "
            "meant for flash attention")
    probe = probe_pairs(sample, long_pairs=long_pairs)
    truth = [reference_logps(model, p.prompt_ids, c).cpu().numpy() for p in probe for c in (p.chosen_ids, p.rejected_ids)]
    rejected = []
    for mode in order:
        reason = unsupported(mode, model, longest) or _disagrees(model, mode, probe, truth, pad_id)
        if reason is None:
            ratio = (f"; estimated {cost['full_forward'] / cost[mode]:.2f}x less work than full_forward"
                     if mode in cost else "")
            why = f"; instead of {'; '.join(rejected)}" if rejected else ""
            log(f"batching: {mode} ({attn} attention{ratio}; matches the reference forward on a probe{why})")
            return mode
        rejected.append(f"{mode}: {reason}")
    raise JobError(f"no batching mode reproduces this model's own forward ({'; '.join(rejected)}); check the model "
                   "with a plain transformers forward")


def probe_pairs(sample: list[EncodedPair], prompt_cap: int = 24, completion_cap: int = 8,
                long_pairs: list[EncodedPair] = ()) -> list[EncodedPair]:
    """Real pairs: the shortest, and the shortest whose prompt length differs from it, both cut to a few tokens
    (cut to differ still) so the probe also runs a padded batch of prompts and of completions; then, whole, the
    longest pair of `sample` and any `long_pairs` (the job's longest), where length effects show."""
    def total(p):
        return len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)

    by_length = sorted(sample, key=total)
    if not by_length:
        return list(long_pairs)
    first = by_length[0]
    other = next((p for p in by_length if len(p.prompt_ids) != len(first.prompt_ids)), None)
    other = other if other is not None else (by_length[1] if len(by_length) > 1 else None)

    def cut(pair: EncodedPair, n: int) -> EncodedPair:  # rejected one token shorter: completions are padded too
        return EncodedPair(pair.prompt_ids[:n], pair.chosen_ids[:completion_cap],
                           pair.rejected_ids[: completion_cap - 1] or pair.rejected_ids[:1])

    probe = [cut(first, prompt_cap)]
    if other is not None:
        n = min(len(other.prompt_ids), prompt_cap)
        if n == len(probe[0].prompt_ids) and n > 1:
            n -= 1
        probe.append(cut(other, n))
    for pair in [by_length[-1], *long_pairs]:
        if all(pair != p for p in probe):
            probe.append(pair)
    return probe


def _disagrees(model, mode: str, probe: list[EncodedPair], truth: list[np.ndarray], pad_id: int) -> str | None:
    try:
        got_c, got_r, _ = score_pairs(model, probe, pad_id, 1 << 30, mode)
    except Exception as e:  # an architecture whose forward rejects the inputs this mode needs
        return f"not supported by this model ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    got = [x for pair in zip(got_c, got_r) for x in pair]
    if any(len(a) != len(b) for a, b in zip(got, truth)):
        return "returns the wrong number of values"
    diff = max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(got, truth))
    if not diff <= probe_tolerance(model.dtype):  # NaN fails
        return f"differs from the reference forward by {diff:.2e} on this model"
    return None


def probe_tolerance(dtype: torch.dtype) -> float:
    """Largest per-token difference from reference_logps a mode may show on the probe."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 0.25
