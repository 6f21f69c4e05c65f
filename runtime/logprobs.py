"""Per-token completion log-probs: the one implementation used for the cached reference and the live policy.

The full [batch, seq, vocab] log-softmax is never built. The model runs up to its final hidden states, only the
positions that predict completion tokens are kept, and the output projection plus log-softmax run over chunks of
those positions, so peak memory is bounded by `chunk_elements` whatever the vocabulary or sequence length.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 2**25  # logits held at once (~128 MiB in float32)


def unwrap(model):
    """The Hugging Face model inside DDP/FSDP/compile wrappers and a peft model (whose layers carry the adapter)."""
    while hasattr(model, "module"):
        model = model.module
    model = getattr(model, "_orig_mod", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _project(inner, hidden: torch.Tensor) -> torch.Tensor:
    """Output projection with the model-specific logit post-processing some architectures apply."""
    logits = inner.get_output_embeddings()(hidden).float()
    cfg = inner.config
    if getattr(cfg, "logit_scale", None):  # Cohere
        logits = logits * cfg.logit_scale
    if getattr(cfg, "logits_scaling", None):  # Granite
        logits = logits / cfg.logits_scaling
    if getattr(cfg, "final_logit_softcapping", None):  # Gemma 2/3
        cap = cfg.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def _chunk_logps(inner, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = _project(inner, hidden)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logps(model, inputs: dict, rows, sources, targets, chunk_elements: int = CHUNK_ELEMENTS,
                return_output: bool = False):
    """Log-prob of `targets[i]` predicted from position (rows[i], sources[i]) of a forward over `inputs`.

    The call goes through the outer module, so DDP/FSDP/DeepSpeed see a normal forward (`logits_to_keep=1` keeps
    the model's own logits to one position per row); the scoring runs in a hook on the base model's output, i.e.
    still inside that forward, where sharded output weights are materialised. Returns float32, differentiable
    when grad is enabled; with return_output, also the model's output (e.g. the key/value cache when `inputs`
    sets use_cache).
    """
    inner = unwrap(model)
    step = max(1, chunk_elements // inner.get_output_embeddings().weight.shape[0])
    captured = {}

    def score(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        h = hidden[rows, sources]
        # With several chunks, recompute each one's logits in the backward pass instead of keeping them all.
        recompute = torch.is_grad_enabled() and h.requires_grad and h.shape[0] > step
        parts = []
        for s in range(0, h.shape[0], step):
            if recompute:
                parts.append(checkpoint(_chunk_logps, inner, h[s : s + step], targets[s : s + step], use_reentrant=False))
            else:
                parts.append(_chunk_logps(inner, h[s : s + step], targets[s : s + step]))
        captured["logps"] = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)

    handle = inner.base_model.register_forward_hook(score)
    try:
        output = model(**{"use_cache": False, **inputs}, logits_to_keep=1)
    finally:
        handle.remove()
    return (captured["logps"], output) if return_output else captured["logps"]


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lens: torch.Tensor,
    completion_lens: torch.Tensor,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Log-prob of every completion token, flattened in row order (row i contributes completion_lens[i] values).

    `input_ids` are right-padded rows of prompt + completion. The first completion token is scored from the
    prompt's last position.
    """
    seq = torch.arange(input_ids.shape[1], device=input_ids.device)
    start = prompt_lens.to(input_ids.device)[:, None]
    end = start + completion_lens.to(input_ids.device)[:, None]
    rows, cols = ((seq >= start) & (seq < end)).nonzero(as_tuple=True)  # row-major: row order, then position
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    return token_logps(model, inputs, rows, cols - 1, input_ids[rows, cols], chunk_elements)


def pad_sequences(sequences: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into (input_ids, attention_mask)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def segment_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum consecutive runs of `values` of the given lengths (one sum per row)."""
    index = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths.to(values.device))
    return torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(0, index, values)
