"""`--token-budget auto`: the padded tokens one forward may take, sized from the memory left after the weights
are loaded and from the model's shapes, instead of a fixed number.

Per budget token a forward holds (no gradient: a layer's activations are freed before the next runs):
  activations   the residual stream, its normed copy, attention's q/k/v/o and the MLP's gate, up and product
                (4 x hidden + 3 x intermediate, in the model's dtype) and two float32 copies of the hidden state
                (RMSNorm upcasts);
  mask          the 4-D attention mask a padded or tree-masked batch builds (a row's width per token, in the dtype,
                plus a boolean copy), except under flash attention, which takes none;
  scores        with eager attention, every head's scores against the row (dtype plus the float32 softmax);
  logits        where the model's own head makes them (head path `logits` / `logits_to_keep`), a vocabulary per
                token; the `hook` head projects bounded chunks instead (a fixed amount, below);
  kv_cache      the mode `kv_cache` keeps every layer's keys and values for the batch (2 x layers x key/value heads
                x head size x dtype bytes per token), repeated for both completions: twice that per budget token.
A share of the free memory is kept back for the allocator's fragmentation and the kernels' workspaces.

On CUDA the free memory is torch.cuda.mem_get_info of the device (with a device map, the least free of the GPUs
holding layers). On CPU `auto` keeps the fixed default, lowered only when the memory the system reports available
(psutil, shared by the ranks of this node) could not hold it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_TOKEN_BUDGET = 16384
USABLE_SHARE = 0.7  # of the free memory: the rest for fragmentation, workspaces and what the estimate leaves out
CPU_USABLE_SHARE = 0.25  # of the available system memory: other processes share it, and it moves
HEAD_CHUNK_BYTES = 3 * 2**25 * 4  # runtime.logprobs.CHUNK_ELEMENTS float32 logits, their exp and log-softmax
MAX_AUTO = 2**20  # more tokens per forward buys nothing once the device is busy; a bound on the batches' size
TREE_MODES = ("shared_prompt", "packed")  # rows of [prompt | chosen | rejected]: up to twice a sequence wide


def parse_token_budget(text) -> int | str:
    """--token-budget: a positive number of padded tokens per forward, or auto."""
    value = str(text).strip().lower()
    if value == "auto":
        return "auto"
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{text!r} is neither a number of tokens nor auto") from None
    if number < 1:
        raise ValueError(f"{number} is not a positive number of tokens (or pass auto)")
    return number


@dataclass(frozen=True)
class Shapes:
    """What a forward's memory per token depends on."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def of(cls, model) -> "Shapes":
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        hidden = int(config.hidden_size)
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        return cls(hidden=hidden, intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
                   layers=int(config.num_hidden_layers), heads=heads,
                   kv_heads=int(getattr(config, "num_key_value_heads", None) or heads), head_dim=int(head_dim),
                   vocab=int(model.get_output_embeddings().weight.shape[0]),
                   dtype_bytes=next(model.parameters()).element_size())


def bytes_per_token(shapes: Shapes, mode: str, attn: str, head: str, longest: int) -> int:
    """Memory one budget token takes in a forward of batching mode `mode` (the module's docstring says what counts).
    `longest`: the job's longest prompt + completion."""
    b = shapes.dtype_bytes
    width = 2 * longest if mode in TREE_MODES else longest
    total = b * (4 * shapes.hidden + 3 * shapes.intermediate) + 2 * 4 * shapes.hidden
    if not attn.startswith("flash"):
        total += width * (b + 1)
    if attn == "eager":
        total += shapes.heads * width * (b + 4)
    if head != "hook":
        total += shapes.vocab * b
    if mode == "kv_cache":
        total += 2 * (2 * shapes.layers * shapes.kv_heads * shapes.head_dim * b)
    return total


@dataclass(frozen=True)
class Sized:
    """The budget `auto` resolved to, and why (logged, and kept in the manifest's computation as a note)."""

    tokens: int
    why: str
    free_bytes: int | None = None
    per_token_bytes: int | None = None

    def note(self) -> dict:
        return {"tokens": self.tokens, "why": self.why,
                **({"free_bytes": self.free_bytes} if self.free_bytes is not None else {}),
                **({"per_token_bytes": self.per_token_bytes} if self.per_token_bytes is not None else {})}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _round(tokens: int) -> int:
    return tokens - tokens % 1024 if tokens >= 2048 else tokens


def size_budget(free_bytes: int | None, per_token: int, longest: int, *, device_type: str) -> Sized:
    """The token budget `auto` gives for `free_bytes` of memory left after the weights (None: unknown) at `per_token`
    bytes a token. CUDA: USABLE_SHARE of it, less the head's chunks, divided by per_token, between one sequence
    of the job (`longest`) and MAX_AUTO, rounded down to a multiple of 1024. CPU: DEFAULT_TOKEN_BUDGET, or less
    where CPU_USABLE_SHARE of the available memory holds fewer tokens. Pure: the same figures give the same budget."""
    if device_type != "cuda":
        default = f"{device_type}: the default {DEFAULT_TOKEN_BUDGET}"
        if free_bytes is None:
            return Sized(DEFAULT_TOKEN_BUDGET, f"{default} (available memory unknown)")
        room = max(0, int(CPU_USABLE_SHARE * free_bytes) - HEAD_CHUNK_BYTES) // per_token
        share = f"{CPU_USABLE_SHARE:.0%} of the {_gib(free_bytes)} available, at {per_token:,} bytes a token"
        if room >= DEFAULT_TOKEN_BUDGET:
            return Sized(DEFAULT_TOKEN_BUDGET, f"{default} ({share}, would hold {room:,})", free_bytes, per_token)
        tokens = max(longest, _round(room), 1)
        return Sized(tokens, f"{default} lowered to {tokens} ({share})", free_bytes, per_token)
    usable = int(USABLE_SHARE * free_bytes) - HEAD_CHUNK_BYTES
    room = max(0, usable) // per_token
    tokens = min(MAX_AUTO, max(longest, _round(room), 1))
    why = (f"cuda: {USABLE_SHARE:.0%} of the {_gib(free_bytes)} free after loading, at {per_token:,} bytes a token, "
           f"holds {room:,} tokens")
    if tokens == MAX_AUTO and room > MAX_AUTO:
        why += f"; capped at {MAX_AUTO}"
    elif tokens > room:
        why += f"; raised to the job's longest sequence ({longest}): memory may run short"
    return Sized(tokens, why, free_bytes, per_token)


def free_memory(model, device_type: str) -> int | None:
    """Bytes free for activations now: on CUDA the least free of the GPUs holding the model's parameters; on CPU
    psutil's available memory over the ranks of this node (LOCAL_WORLD_SIZE), None without psutil."""
    if device_type == "cuda":
        import torch

        gpus = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
        return min(torch.cuda.mem_get_info(g)[0] for g in gpus) if gpus else None
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def auto_budget(model, mode: str, head: str, longest: int) -> Sized:
    """`--token-budget auto` for `model` loaded as it will score, in batching mode `mode` with head path `head`."""
    cuda = any(p.device.type == "cuda" for p in model.parameters())
    device_type = "cuda" if cuda else "cpu"
    shapes = Shapes.of(model)
    per_token = bytes_per_token(shapes, mode, model.config._attn_implementation or "eager", head, longest)
    return size_budget(free_memory(model, device_type), per_token, longest, device_type=device_type)
