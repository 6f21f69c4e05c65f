"""What an architecture allows the fast paths of the jobs (precompute-ref's batching modes, train-dpo's batch
layout): facts read from the model's config, and the reasons given when a path cannot reproduce the plain forward.
Each rule is written here once."""

from __future__ import annotations

ATTENTION_LAYERS = {"full_attention", "sliding_attention", "attention", "chunked_attention"}
STATE_SPACE = {"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"}
TREE_MASK_ATTENTION = ("sdpa", "eager")  # the implementations that take a custom 4-D mask


def sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if "sliding_attention" in types else None
    return window if getattr(config, "use_sliding_window", True) else None


def length_dependent_rope(config) -> tuple[str, int] | None:
    """(type, length) for RoPE whose frequencies depend on the longest position of a forward (dynamic NTK,
    longrope): a forward over a prompt alone, or a padded batch, would then rotate differently from the plain
    forward of one sequence."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return None
    for params in [rope, *(v for v in rope.values() if isinstance(v, dict))]:  # also per layer type (Gemma 3)
        kind = params.get("rope_type", params.get("type"))
        if kind in ("dynamic", "longrope"):
            return kind, int(params.get("original_max_position_embeddings") or config.max_position_embeddings)
    return None


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


def tree_mask_unsupported(model, longest: int, attn: str | None = None) -> str | None:
    """Why a [prompt | chosen | rejected] row with the tree mask (runtime/packing.py) cannot reproduce the plain
    forward on this model, or None: precompute's shared_prompt and packed modes and train-dpo's prefix_shared layout.
    `longest`: the longest prompt + completion of the job; `attn`: the attention implementation (the model's own
    by default)."""
    attn = attn or model.config._attn_implementation
    return (shape_dependent(model, longest) or window_too_short(model, longest)
            or (None if attn in TREE_MASK_ATTENTION else f"{attn} attention cannot take the tree mask")
            or state_across_rows(model))
