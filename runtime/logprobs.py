"""Per-token completion log-probs: the one implementation used for the cached reference and the live policy, and
`reference_logps`, the definition every fast path is checked against.

The full [batch, seq, vocab] log-softmax is never built. Where the model's own logits are exactly its output
embeddings applied to the final hidden states (checked once per model against its own `logits`, see head.py), the
model runs up to its final hidden states, only the positions that predict completion tokens are kept, and the
output projection plus log-softmax run over chunks of those positions, so peak memory is bounded by
`chunk_elements` whatever the vocabulary or sequence length. Otherwise the model's own head produces the logits,
for the completion positions only where the model takes a `logits_to_keep` mask.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .head import HEADS, PROBE_TOKENS
from .tolerance import head_tolerance

CHUNK_ELEMENTS = 2**25  # logits held at once (~128 MiB in float32)


def unwrap(model):
    """The Hugging Face model inside DDP/FSDP/compile wrappers and a peft model (whose layers carry the adapter)."""
    while hasattr(model, "module"):
        model = model.module
    model = getattr(model, "_orig_mod", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _project(inner, hidden: torch.Tensor) -> torch.Tensor:
    """The output embeddings applied to hidden states, nothing else: `verified_head` only lets this path run
    on models whose own logits it reproduces (no soft-capping, scaling or other post-processing)."""
    return inner.get_output_embeddings()(hidden).float()


def _scores(logits: torch.Tensor, targets: torch.Tensor, given: torch.Tensor | None):
    """log_softmax(logits) at `targets`; with `given` ([n, K] ids per position) also at those ids, and the log of
    the mass outside them as a log-sum-exp over the other tokens themselves (no cancellation; -inf where `given`
    covers the whole vocabulary, with a zero, not NaN, gradient there)."""
    lse = torch.logsumexp(logits, dim=-1)
    logps = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if given is None:
        return logps
    others = logits.scatter(-1, given, float("-inf"))
    empty = torch.isneginf(others).all(-1)
    rest = torch.where(empty, float("-inf"), torch.where(empty[:, None], 0.0, others).logsumexp(-1) - lse)
    return logps, logits.gather(-1, given) - lse[:, None], rest


def _chunk_logps(inner, hidden: torch.Tensor, targets: torch.Tensor, given: torch.Tensor | None = None):
    return _scores(_project(inner, hidden), targets, given)


def _joined(parts: list, given, empty: torch.Tensor):
    """The chunks' scores concatenated: a tensor, or (logps, given_logps, rest) with `given`."""
    if given is None:
        return torch.cat(parts) if parts else empty
    if not parts:
        return empty, empty.new_zeros((0, given.shape[1])), empty
    return tuple(torch.cat(p) for p in zip(*parts))


def _gather_logps(logits: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, step: int, given=None):
    """log_softmax(logits[index])[targets] (and at `given`), a chunk of positions at a time (the float32 copy stays
    bounded)."""
    parts = []
    for s in range(0, len(index), step):
        chunk = logits[index[s : s + step]].float()
        parts.append(_scores(chunk, targets[s : s + step], None if given is None else given[s : s + step]))
    return _joined(parts, given, logits.new_zeros(0, dtype=torch.float32))


def token_logps(model, inputs: dict, rows, sources, targets, chunk_elements: int = CHUNK_ELEMENTS,
                return_output: bool = False, head: str | None = None, given: torch.Tensor | None = None):
    """Log-prob of `targets[i]` predicted from position (rows[i], sources[i]) of a forward over `inputs`.

    `head` (default: `verified_head(model)`, decided once per model against its own logits):
      hook            the base model's hidden states at those positions, projected by the output embeddings in
                      chunks inside a hook (so DDP/FSDP/DeepSpeed see a normal forward, and sharded output weights
                      are materialised); memory bounded by `chunk_elements`;
      logits_to_keep  the model's own logits, for those positions only (a boolean `logits_to_keep` mask);
      logits          the model's own logits at every position, gathered.
    Returns float32, differentiable when grad is enabled; with return_output, also the model's output (e.g. the
    key/value cache when `inputs` sets use_cache). With `given` ([N, K] token ids per scored position, e.g. the
    reference's top k), the log-probs are (logps [N], log-probs of the given ids [N, K], log of the mass outside
    them [N]), from the same forward and chunks; the chunk's memory is about twice the logits chunk.
    """
    head = head or verified_head(model)
    inner = unwrap(model)
    step = max(1, chunk_elements // inner.get_output_embeddings().weight.shape[0])
    if head != "hook":
        return _own_logits(model, inputs, rows, sources, targets, step, return_output, head == "logits_to_keep",
                           given)
    captured = {}

    def score(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        h = hidden[rows, sources]
        # With several chunks, recompute each one's logits in the backward pass instead of keeping them all.
        recompute = torch.is_grad_enabled() and h.requires_grad and h.shape[0] > step
        parts = []
        for s in range(0, h.shape[0], step):
            chunk = (inner, h[s : s + step], targets[s : s + step], None if given is None else given[s : s + step])
            if recompute:
                parts.append(checkpoint(_chunk_logps, *chunk, use_reentrant=False))
            else:
                parts.append(_chunk_logps(*chunk))
        captured["logps"] = _joined(parts, given, hidden.new_zeros(0, dtype=torch.float32))

    handle = inner.base_model.register_forward_hook(score)
    try:
        output = model(**{"use_cache": False, **inputs}, logits_to_keep=1)
    finally:
        handle.remove()
    if "logps" not in captured:
        raise RuntimeError(f"{type(inner).__name__}: the forward hook on its base model did not run")
    return (captured["logps"], output) if return_output else captured["logps"]


def _own_logits(model, inputs, rows, sources, targets, step, return_output, keep_only, given=None):
    """token_logps from the model's own `logits` output (its whole head, whatever it does after the projection)."""
    width = inputs["input_ids"].shape[1]
    if keep_only:
        keep = torch.zeros(inputs["input_ids"].shape, dtype=torch.bool, device=rows.device)
        keep[rows, sources] = True
        output = model(**{"use_cache": False, **inputs}, logits_to_keep=keep)
        slot = keep.flatten().cumsum(0) - 1  # row of the kept logits for each (row, position)
        logits = output.logits.reshape(-1, output.logits.shape[-1])
        index = slot[rows * width + sources]
    else:
        output = model(**{"use_cache": False, **inputs})
        logits = output.logits.reshape(-1, output.logits.shape[-1])
        index = rows * width + sources
    logps = _gather_logps(logits, index, targets, step, given)
    return (logps, output) if return_output else logps


def reset_position_state(model) -> None:
    """Undo what a dynamic-NTK rotary embedding kept from earlier forwards (frequencies grown for a longer
    sequence), so the next forward computes its numbers as a fresh model would."""
    for module in unwrap(model).modules():
        kinds = getattr(module, "rope_type", None)
        kinds = kinds.items() if isinstance(kinds, dict) else [(None, kinds)]
        for layer_type, kind in kinds:
            if not isinstance(kind, str) or "dynamic" not in kind:
                continue
            prefix = f"{layer_type}_" if layer_type else ""
            original = getattr(module, f"{prefix}original_inv_freq", None)
            if original is not None and hasattr(module, "original_max_seq_len"):
                module.register_buffer(f"{prefix}inv_freq", original.clone(), persistent=False)
                setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


@torch.no_grad()
def reference_log_softmax(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """THE definition of the reference's distribution: the model's own forward over the unpadded sequence
    prompt + completion as a batch of one (fresh position state), its own `logits` after log_softmax (float32), at
    the positions that predict each completion token: [completion tokens, vocabulary]. Every batching mode and head
    path is checked against this; it uses none of them."""
    device = next(unwrap(model).parameters()).device
    ids = torch.as_tensor([list(prompt_ids) + list(completion_ids)], device=device)
    reset_position_state(model)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : ids.shape[1] - 1].float()
    reset_position_state(model)
    return logits.log_softmax(-1)


def reference_logps(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """THE definition of a reference log-prob: `reference_log_softmax` at each completion token."""
    logps = reference_log_softmax(model, prompt_ids, completion_ids)
    return logps.gather(-1, torch.as_tensor(list(completion_ids), device=logps.device)[:, None]).squeeze(-1)


def reference_top_k(model, prompt_ids: list[int], completion_ids: list[int], k: int):
    """The truth for a top-k cache, from `reference_log_softmax`: per completion token the k most probable ids
    ([T, k], most probable first), their log-probs ([T, k]) and the tail, the log of the probability mass outside
    them ([T]), as a log-sum-exp over those tokens themselves (no cancellation; -inf when k is the vocabulary)."""
    logps = reference_log_softmax(model, prompt_ids, completion_ids)
    top_logps, top_ids = logps.topk(k, dim=-1)
    rest = logps.scatter(-1, top_ids, float("-inf"))
    return top_ids, top_logps, rest.logsumexp(-1)


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lens: torch.Tensor,
    completion_lens: torch.Tensor,
    chunk_elements: int = CHUNK_ELEMENTS,
    given: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of every completion token, flattened in row order (row i contributes completion_lens[i] values).

    `input_ids` are right-padded rows of prompt + completion. The first completion token is scored from the
    prompt's last position. `given`: as in token_logps, one row of ids per completion token in the same order.
    """
    seq = torch.arange(input_ids.shape[1], device=input_ids.device)
    start = prompt_lens.to(input_ids.device)[:, None]
    end = start + completion_lens.to(input_ids.device)[:, None]
    rows, cols = ((seq >= start) & (seq < end)).nonzero(as_tuple=True)  # row-major: row order, then position
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    return token_logps(model, inputs, rows, cols - 1, input_ids[rows, cols], chunk_elements, given=given)


def pad_sequences(sequences: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into (input_ids, attention_mask)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def verified_head(model) -> str:
    """The first of HEADS that reproduces the model's own log-probs (cached on the model; `logits` always does,
    it is the model's own output)."""
    inner = unwrap(model)
    found = getattr(inner, "_refcache_head", None)
    if found is not None:
        return found
    vocab = inner.get_output_embeddings().weight.shape[0]
    device = next(inner.parameters()).device
    ids = ((torch.arange(PROBE_TOKENS, device=device) * 7919 + 3) % vocab).tolist()
    with torch.no_grad():
        truth = reference_logps(model, ids[:1], ids[1:])
        found = "logits"
        for head in HEADS[:-1]:
            try:
                got = token_logps(model, {"input_ids": torch.as_tensor([ids], device=device)},
                                  torch.zeros(len(ids) - 1, dtype=torch.long, device=device),
                                  torch.arange(len(ids) - 1, device=device),
                                  torch.as_tensor(ids[1:], device=device), head=head)
            except Exception:  # e.g. a forward that takes no logits_to_keep mask, or a hook that never runs
                continue
            if got.shape == truth.shape and float((got - truth).abs().max()) <= head_tolerance(inner.dtype):
                found = head
                break
    inner._refcache_head = found
    return found
