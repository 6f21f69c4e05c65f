"""What an architecture allows the batching modes: facts read from the model's config, the reasons the modes give."""

from __future__ import annotations

from runtime.packing import length_dependent_rope, sliding_window

ATTENTION_LAYERS = {"full_attention", "sliding_attention", "attention", "chunked_attention"}
STATE_SPACE = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}
TREE_MASK_ATTENTION = ("sdpa", "eager")  # the implementations that take a custom 4-D mask


def shape_dependent(model, longest: int) -> str | None:
    """Why this model's numbers for a sequence depend on what else is in the forward (batch width, packing,
    earlier forwards), or None. Such a model is scored one sequence at a time (mode `single`)."""
    config = model.config.get_text_config()
    rope = length_dependent_rope(config)
    if rope and longest > rope[1]:
        return (f"{rope[0]} RoPE picks its frequencies from the longest position of a forward (changes past "
                f"{rope[1]}; sequences up to {longest} tokens)")
    if _alibi(config):
        return "ALiBi position biases are computed over a forward's whole row and mask"
    return None


def _alibi(config) -> bool:
    attn = getattr(config, "attn_config", None)
    return (config.model_type == "bloom" or getattr(config, "alibi", False) is True
            or getattr(config, "position_embedding_type", None) == "alibi"
            or (getattr(attn, "alibi", False) if not isinstance(attn, dict) else attn.get("alibi", False)) is True)


def window_too_short(model, longest: int) -> str | None:
    """Sliding-window attention shorter than the job's sequences (a prompt's cache or a shared row would see past
    the window), or None."""
    window = sliding_window(model.config.get_text_config())
    if window and longest > window:
        return f"sliding-window attention (window {window}, sequences up to {longest} tokens)"
    return None


def state_layers(model) -> list[str]:
    """Kinds of layers that carry a recurrent state along the sequence (state-space, linear attention,
    convolutions), from the config's per-layer lists; a pure state-space model's type counts as one."""
    config = model.config.get_text_config()
    kinds = set()
    for key in ("layer_types", "block_types", "layers_block_type"):
        kinds |= set(getattr(config, key, None) or ())
    found = sorted(str(k) for k in kinds - ATTENTION_LAYERS)
    return found or ([config.model_type] if config.model_type in STATE_SPACE else [])


def state_across_rows(model) -> str | None:
    """For modes that put several sequences in one row: layers whose state would run from one into the next."""
    state = state_layers(model)
    return f"layers other than attention ({', '.join(state)}) carry state across a packed row" if state else None
