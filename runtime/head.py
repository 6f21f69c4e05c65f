"""Which way `logprobs.token_logps` gets a model's output-head values, decided once per model by comparing each
way with the model's own `logits` (log_softmax) on a short unpadded sequence.

The fast way (`hook`: output embeddings applied to the hidden states of the scored positions, in chunks) is only
right for models whose head is that projection and nothing more; some scale, soft-cap or otherwise post-process
the logits in their causal-LM forward, and some call an inner module the hook never sees. Nothing of a model's
head is re-implemented here: a model the projection does not reproduce gets its own logits instead, for the scored
positions only where it takes a boolean `logits_to_keep` mask (`logits_to_keep`), else all of them (`logits`).
"""

from __future__ import annotations

import torch

from .tolerance import head_tolerance

HEADS = ("hook", "logits_to_keep", "logits")
PROBE_TOKENS = 24


def verified_head(model) -> str:
    """The first of HEADS that reproduces the model's own log-probs (cached on the model; `logits` always does,
    it is the model's own output)."""
    from .logprobs import reference_logps, token_logps, unwrap

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
