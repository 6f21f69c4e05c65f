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

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from schemas.columns import TOP_K_COLUMNS, TokenScores

from .distribution import _Distribution
from .head import HEADS, PROBE_TOKENS
from .placement import input_device
from .tolerance import head_tolerance

CHUNK_ELEMENTS = 2**25  # logits held at once (~128 MiB in float32)
HEAD_ELEMENTS = 2**28  # logits one forward may hold when the model's own head has to produce them (1 GiB float32)
# On CPU the head runs in smaller pieces than CHUNK_ELEMENTS allows: the log-softmax's passes over a piece (max,
# exp, sum, gather) then read it from the core's cache instead of memory (bench_flops.py --head-pieces: at a vocabulary
# of 8k about a fifth less head time than 2**25). At least CPU_CHUNK_ROWS positions a piece, so the projection stays
# a matmul that reads its weight once for many rows at a large vocabulary.
CPU_CHUNK_ELEMENTS = 2**21
CPU_CHUNK_ROWS = 256


def unwrap(model):
    """The Hugging Face model inside DDP/FSDP/compile wrappers and a peft model (whose layers carry the adapter)."""
    while hasattr(model, "module"):
        model = model.module
    model = getattr(model, "_orig_mod", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def uncompiled(model):
    """`model` without torch.compile's wrapper (an OptimizedModule keeps the module it compiles as `_orig_mod`): what
    the truth runs on, so that a compiled forward is checked against the eager one, never against itself."""
    while hasattr(model, "_orig_mod"):
        model = model._orig_mod
    return model


def _project(inner, hidden: torch.Tensor) -> torch.Tensor:
    """The output embeddings applied to hidden states, nothing else: `verified_head` only lets this path run
    on models whose own logits it reproduces (no soft-capping, scaling or other post-processing)."""
    return inner.get_output_embeddings()(hidden).float()


def _scores(logits: torch.Tensor, targets: torch.Tensor, top_k: int, given: torch.Tensor | None = None) -> tuple:
    """(logps[, ids, their logps, tail]) of one chunk of float32 logits: log_softmax at the targets and, with
    `top_k`, its k largest values with their ids, or with `given` ([n, K] ids per position, e.g. the reference's top
    k scored under the policy) the values at those ids; the tail is the log of the mass outside the ids, a sum over
    the other tokens themselves (no 1 - sum: no cancellation), -inf where the ids cover the whole vocabulary (with a
    zero, not NaN, gradient there). See _Distribution."""
    # a model split by a device map (runtime/placement.py) may put its head on another device than its inputs
    targets = targets.to(logits.device)
    given = given.to(logits.device) if given is not None else None
    if not top_k and given is None:
        norm = torch.logsumexp(logits, dim=-1, keepdim=True)
        return (logits.gather(-1, targets[:, None]).squeeze(-1) - norm[:, 0],)
    ids = logits.topk(top_k, dim=-1)[1] if given is None else given  # the order of the logits is the log-softmax's
    logps, picked, tail = _Distribution.apply(logits, targets, ids)
    return logps, ids, picked, tail


def _chunk_scores(inner, hidden: torch.Tensor, targets: torch.Tensor, top_k: int = 0, given=None) -> tuple:
    return _scores(_project(inner, hidden), targets, top_k, given)


def _joined(parts: list[tuple], width: int, like: torch.Tensor) -> TokenScores:
    """The chunks' scores as one TokenScores; `width`: K ids per position (0: log-probs only)."""
    names = ("logps", *TOP_K_COLUMNS) if width else ("logps",)
    if not parts:
        empty = {"logps": like.new_zeros(0, dtype=torch.float32)}
        if width:
            empty |= {"top_ids": like.new_zeros((0, width), dtype=torch.long),
                      "top_logps": like.new_zeros((0, width), dtype=torch.float32),
                      "tail": like.new_zeros(0, dtype=torch.float32)}
        return TokenScores(**empty)
    return TokenScores(**{name: torch.cat([p[i] for p in parts]) for i, name in enumerate(names)})


def _gather_scores(logits: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, step: int, top_k: int,
                   given=None) -> TokenScores:
    """The scores of log_softmax(logits[index]) at `targets`, a chunk of positions at a time (the float32 copy
    stays bounded)."""
    index = index.to(logits.device)
    parts = [_scores(logits[index[s : s + step]].float(), targets[s : s + step], top_k,
                     None if given is None else given[s : s + step])
             for s in range(0, len(index), step)]
    return _joined(parts, _width(top_k, given), logits)


def _width(top_k: int, given) -> int:
    return given.shape[1] if given is not None else top_k


def _piece(step: int, vocab: int, width: int, device: torch.device) -> int:
    """Positions the head scores at once: `step` (the memory bound), on CPU a cache-sized piece of it."""
    if device.type != "cpu":
        return step
    return min(step, max(CPU_CHUNK_ROWS, CPU_CHUNK_ELEMENTS // (vocab * (2 if width else 1))))


def token_logps(model, inputs: dict, rows, sources, targets, chunk_elements: int = CHUNK_ELEMENTS,
                return_output: bool = False, head: str | None = None, given: torch.Tensor | None = None):
    """Log-prob of `targets[i]` predicted from position (rows[i], sources[i]) of a forward over `inputs`: the
    `logps` of `token_scores` (see there). With `given` ([N, K] token ids per scored position, e.g. the reference's
    top k) the tuple (logps [N], log-probs of the given ids [N, K], log of the mass outside them [N]), from the
    same forward and chunks."""
    got = token_scores(model, inputs, rows, sources, targets, chunk_elements, return_output, head, given=given)
    scores, output = got if return_output else (got, None)
    value = scores.logps if given is None else (scores.logps, scores.top_logps, scores.tail)
    return (value, output) if return_output else value


def token_scores(model, inputs: dict, rows, sources, targets, chunk_elements: int = CHUNK_ELEMENTS,
                 return_output: bool = False, head: str | None = None, top_k: int = 0, given=None):
    """The scores (schemas.format.TokenScores) of position (rows[i], sources[i]) of a forward over `inputs`: the
    log-prob of `targets[i]`, and with `top_k` the k most probable ids there, their log-probs and the tail (with
    `given` ids instead of the top k: the values at those ids, and the tail outside them).

    `head` (default: `verified_head(model)`, decided once per model against its own logits):
      hook            the base model's hidden states at those positions, projected by the output embeddings in
                      chunks inside a hook (so DDP/FSDP/DeepSpeed see a normal forward, and sharded output weights
                      are materialised); memory bounded by `chunk_elements` (the ids of a chunk are scored before
                      the next is projected);
      logits_to_keep  the model's own logits, for those positions only (a boolean `logits_to_keep` mask);
      logits          the model's own logits at every position, gathered.
    Returns float32 values (ids long), differentiable when grad is enabled; with return_output, also the model's
    output (e.g. the key/value cache when `inputs` sets use_cache).
    """
    head = head or verified_head(model)
    inner = unwrap(model)
    width = _width(top_k, given)
    # with ids, exp(logits - max) is held beside the chunk's logits: half the positions
    vocab = inner.get_output_embeddings().weight.shape[0]
    step = max(1, chunk_elements // (vocab * (2 if width else 1)))
    if head != "hook":
        return _own_logits(model, inputs, rows, sources, targets, step, return_output, head == "logits_to_keep",
                           top_k, given)
    captured = {}

    def score(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        h = hidden[rows.to(hidden.device), sources.to(hidden.device)]
        # Beyond one memory chunk, recompute each piece's logits in the backward pass instead of keeping them all.
        recompute = torch.is_grad_enabled() and h.requires_grad and h.shape[0] > step
        piece = _piece(step, vocab, width, h.device)
        parts = []
        for s in range(0, h.shape[0], piece):
            chunk = (inner, h[s : s + piece], targets[s : s + piece], top_k,
                     None if given is None else given[s : s + piece])
            parts.append(checkpoint(_chunk_scores, *chunk, use_reentrant=False) if recompute else _chunk_scores(*chunk))
        captured["scores"] = _joined(parts, width, hidden)

    if model is not uncompiled(model):
        # Eager under torch.compile: the positions, targets and chunked head stay out of the compiled graph (a new
        # closure per batch would otherwise be traced and recompiled at every batch); the decoder is what compiles.
        score = torch.compiler.disable(score)
    handle = inner.base_model.register_forward_hook(score)
    try:
        output = model(**{"use_cache": False, **inputs}, logits_to_keep=1)
    finally:
        handle.remove()
    if "scores" not in captured:
        raise RuntimeError(f"{type(inner).__name__}: the forward hook on its base model did not run")
    return (captured["scores"], output) if return_output else captured["scores"]


def _own_logits(model, inputs, rows, sources, targets, step, return_output, keep_only, top_k, given=None):
    """token_scores from the model's own `logits` output (its whole head, whatever it does after the projection)."""
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
    piece = _piece(step, logits.shape[-1], _width(top_k, given), logits.device)
    scores = _gather_scores(logits, index, targets, piece, top_k, given)
    return (scores, output) if return_output else scores


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
def reference_logits(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """The model's own forward over the unpadded sequence prompt + completion as a batch of one (fresh position
    state), its own `logits` (float32) at the positions that predict each completion token: [completion tokens,
    vocabulary]. The head runs on every position, as `model(ids).logits` does: `logits_to_keep` is one of the head
    paths checked against this (runtime/head.py), so the definition must not go through it; nor through
    torch.compile (a compiled model is judged by its eager module's forward)."""
    model = uncompiled(model)
    device = input_device(unwrap(model))
    ids = torch.as_tensor([list(prompt_ids) + list(completion_ids)], device=device)
    reset_position_state(model)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : ids.shape[1] - 1].float()
    reset_position_state(model)
    return logits


def reference_log_softmax(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """THE definition of the reference's distribution: `reference_logits` after log_softmax (float32), [completion
    tokens, vocabulary]. Every batching mode and head path is checked against this; it uses none of them."""
    return reference_logits(model, prompt_ids, completion_ids).log_softmax(-1)


def reference_logps(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """THE definition of a reference log-prob: `reference_log_softmax` at each completion token. log_softmax is
    row by row, so it runs on chunks of positions: one [tokens, vocabulary] copy fewer at a large vocabulary."""
    logits = reference_logits(model, prompt_ids, completion_ids)
    targets = torch.as_tensor(list(completion_ids), device=logits.device)[:, None]
    step = max(1, CHUNK_ELEMENTS // logits.shape[-1])
    parts = [logits[s : s + step].log_softmax(-1).gather(-1, targets[s : s + step]) for s in range(0, len(logits), step)]
    return torch.cat(parts).squeeze(-1) if parts else logits.new_zeros(0)


def reference_top_k(model, prompt_ids: list[int], completion_ids: list[int], k: int):
    """The truth for a top-k cache, from `reference_log_softmax`: per completion token the k most probable ids
    ([T, k], most probable first), their log-probs ([T, k]) and the tail, the log of the probability mass outside
    them ([T]), as a log-sum-exp over those tokens themselves (no cancellation; -inf when k is the vocabulary)."""
    return _top_k(reference_log_softmax(model, prompt_ids, completion_ids), k)


def reference_scores(model, prompt_ids: list[int], completion_ids: list[int], k: int) -> TokenScores:
    """`reference_logps` and `reference_top_k` of one completion from one forward (the probe's truth)."""
    logps = reference_log_softmax(model, prompt_ids, completion_ids)
    return TokenScores(_at_tokens(logps, completion_ids), *_top_k(logps, k))


def _at_tokens(logps: torch.Tensor, completion_ids: list[int]) -> torch.Tensor:
    return logps.gather(-1, torch.as_tensor(list(completion_ids), device=logps.device)[:, None]).squeeze(-1)


def _top_k(logps: torch.Tensor, k: int) -> tuple:
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
):
    """Log-prob of every completion token, flattened in row order (row i contributes completion_lens[i] values).

    `input_ids` are right-padded rows of prompt + completion. The first completion token is scored from the
    prompt's last position. `given`: as in token_logps, one row of ids per completion token in the same order.
    """
    got = completion_scores(model, input_ids, attention_mask, prompt_lens, completion_lens, chunk_elements,
                            given=given)
    return got.logps if given is None else (got.logps, got.top_logps, got.tail)


def completion_scores(model, input_ids, attention_mask, prompt_lens, completion_lens,
                      chunk_elements: int = CHUNK_ELEMENTS, top_k: int = 0, given=None,
                      position_ids: torch.Tensor | None = None) -> TokenScores:
    """`token_scores` of every completion token of padded rows, flattened in row order (completion_logps). Rows are
    right-padded, or left-padded with their `position_ids` given (each row's prompt starts at its first unmasked
    column)."""
    seq = torch.arange(input_ids.shape[1], device=input_ids.device)
    first = attention_mask.long().argmax(1)[:, None]  # 0 in right-padded rows
    start = first + prompt_lens.to(input_ids.device)[:, None]
    end = start + completion_lens.to(input_ids.device)[:, None]
    rows, cols = ((seq >= start) & (seq < end)).nonzero(as_tuple=True)  # row-major: row order, then position
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    return token_scores(model, inputs, rows, cols - 1, input_ids[rows, cols], chunk_elements, top_k=top_k,
                        given=given)


def pad_sequences(sequences: list[list[int]], pad_id: int, device=None,
                  left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (or left-pad) id lists into (input_ids, attention_mask)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        at = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, at] = torch.as_tensor(s, dtype=torch.long)
        mask[i, at] = 1
    return ids.to(device), mask.to(device)


def padded_scores(model, sequences: list[tuple[list[int], list[int]]], pad_id: int, top_k: int = 0,
                  left: bool = False, given: torch.Tensor | None = None) -> tuple[list[TokenScores], dict]:
    """Completion scores of (prompt, completion) sequences run as one padded batch with its attention mask: one
    TokenScores (numpy) per sequence, and {"processed": real tokens, "slots": tokens including padding}. Right
    padding is precompute-ref's full_forward layout (default positions); left padding gives each row its positions
    from the mask (audit-ref's replay of a full_forward cache runs it, a layout other than the one it checks).
    `given`: as in completion_scores, ids per completion token in sequence order (audit-ref's view scores the
    policy at a top-k cache's reference ids)."""
    device = input_device(unwrap(model))
    ids, mask = pad_sequences([list(p) + list(c) for p, c in sequences], pad_id, device, left=left)
    clen = torch.tensor([len(c) for _, c in sequences])
    positions = (mask.cumsum(1) - 1).clamp(min=0) if left else None
    flat = completion_scores(model, ids, mask, torch.tensor([len(p) for p, _ in sequences]), clen, top_k=top_k,
                             given=None if given is None else given.to(device), position_ids=positions)
    return split_scores(flat, clen), {"processed": int(mask.sum()), "slots": mask.numel()}


def split_scores(flat: TokenScores, lengths: torch.Tensor) -> list[TokenScores]:
    """Flattened scores cut into consecutive parts of `lengths`, as numpy."""
    flat = flat.map(lambda v: v.cpu().numpy() if isinstance(v, torch.Tensor) else v)
    cuts = np.cumsum(lengths.numpy())[:-1]
    fields = {k: np.split(v, cuts) for k, v in flat.fields().items()}
    return [TokenScores(**{k: parts[i] for k, parts in fields.items()}) for i in range(len(cuts) + 1)]


def effective_budget(model, token_budget: int, longest: int) -> int:
    """token_budget, lowered where the model's own head makes the logits (head.py) so that a forward's logits stay
    within HEAD_ELEMENTS (never below one sequence of the job)."""
    if verified_head(model) == "hook":
        return token_budget
    vocab = model.get_output_embeddings().weight.shape[0]
    return min(token_budget, max(longest, HEAD_ELEMENTS // vocab))


def verified_head(model) -> str:
    """The first of HEADS that reproduces the model's own log-probs (cached on the model; `logits` always does,
    it is the model's own output). Probed on the eager module: the head is the model's, compiled or not, and a probe
    through torch.compile would compile a graph of its own."""
    model = uncompiled(model)
    inner = unwrap(model)
    found = getattr(inner, "_refcache_head", None)
    if found is not None:
        return found
    vocab = inner.get_output_embeddings().weight.shape[0]
    device = input_device(inner)
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
