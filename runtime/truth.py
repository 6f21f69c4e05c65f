"""The truth at any length. `runtime.logprobs.reference_log_softmax` (the whole forward) holds one sequence's logits
over the whole vocabulary: 1 GiB at a 128k vocabulary x 2k positions in float32 (twice that with its log_softmax),
and the probe runs it on the job's longest pairs, so that pair set the job's peak memory whatever --token-budget
said.

The chunked truth keeps the model's own code: one call of the model's forward with `logits_to_keep` = the first
piece of positions runs the backbone once (its output caught by a hook); each further piece calls the same forward
again with the backbone's forward answering with that output, so the model's own head and its own final logit
transforms (soft-capping, logit scales) make every piece's logits. Nothing of the model is re-implemented, and it is
never taken on trust: before it scores a sequence too long for the whole forward, it must equal the whole forward on
the same job's sequences that fit (or on a prefix of the long one), within runtime/tolerance.py's truth_tolerance; a
model whose forward takes no `logits_to_keep`, or whose chunked values differ, keeps the whole forward."""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch

from schemas.columns import TokenScores

from .tolerance import truth_tolerance
from .logprobs import (CHUNK_ELEMENTS, _at_tokens, _top_k, input_device, reference_logps, reference_scores,
                       reset_position_state, uncompiled, unwrap)

# positions x vocabulary above which the truth runs in pieces: 128 MiB of float32 logits (and as much again for their
# log_softmax), what the scoring's own head holds at once (runtime.logprobs.CHUNK_ELEMENTS); the proof's whole
# forward stays within it too (proof_sequences)
WHOLE_ELEMENTS = CHUNK_ELEMENTS
PIECE_ELEMENTS = 2**24  # logits of one piece (64 MiB in float32)


def supports_chunks(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` and has a backbone of its own (`base_model`) to hold."""
    inner = unwrap(uncompiled(model))
    base = getattr(inner, "base_model", inner)
    return base is not inner and "logits_to_keep" in inspect.signature(inner.forward).parameters


def fits(model, prompt_ids, completion_ids) -> bool:
    """Whether the whole forward's logits of this sequence stay within WHOLE_ELEMENTS."""
    vocab = unwrap(model).get_output_embeddings().weight.shape[0]
    return (len(prompt_ids) + len(completion_ids)) * vocab <= WHOLE_ELEMENTS


@contextlib.contextmanager
def _backbone_held(base):
    """Calls of `base` inside answer with the output its first call gave (caught by a forward hook): the backbone
    runs once for every piece. Whatever the module's own `forward` attribute was (accelerate's dispatch puts one on
    the instance) is put back."""
    caught = {}
    had = "forward" in vars(base)
    own = vars(base).get("forward")
    handle = base.register_forward_hook(lambda _module, _args, output: caught.setdefault("output", output))
    try:
        yield caught, lambda: setattr(base, "forward", lambda *args, **kwargs: caught["output"])
    finally:
        handle.remove()
        if had:
            base.forward = own
        elif "forward" in vars(base):
            del base.forward


@torch.no_grad()
def chunked_scores(model, prompt_ids: list[int], completion_ids: list[int], top_k: int = 0,
                   piece_elements: int = PIECE_ELEMENTS) -> TokenScores:
    """reference_scores (the log-prob of each completion token, and with top_k the k most probable ids, their
    log-probs and the tail) from the model's own forward applied piece by piece over the positions (module
    docstring); holds one piece's logits, never the sequence's."""
    model = uncompiled(model)
    inner = unwrap(model)
    vocab = inner.get_output_embeddings().weight.shape[0]
    device = input_device(inner)
    ids = torch.as_tensor([list(prompt_ids) + list(completion_ids)], device=device)
    targets = torch.as_tensor(list(completion_ids), device=device)
    start, step = len(prompt_ids) - 1, max(1, piece_elements // vocab)
    parts = []
    reset_position_state(model)
    with _backbone_held(inner.base_model) as (caught, hold):
        for s in range(0, len(completion_ids), step):
            keep = torch.arange(start + s, start + min(s + step, len(completion_ids)), device=device)
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0].float()
            if s == 0:
                hold()  # the backbone ran once, for the first piece; the rest reuse its output
            logps = logits.log_softmax(-1)  # the whole forward's own scoring functions, on one piece
            picked = _at_tokens(logps, completion_ids[s : s + len(keep)])
            parts.append((picked, *_top_k(logps, top_k)) if top_k else (picked,))
    reset_position_state(model)
    if "output" not in caught:
        raise RuntimeError("the model's forward did not call its backbone")
    joined = [torch.cat(column) for column in zip(*parts)] if parts else [targets.new_zeros(0, dtype=torch.float32)]
    return TokenScores(*joined) if top_k else TokenScores(joined[0])


def chunked_difference(model, sequences: list[tuple[list[int], list[int]]], top_k: int = 0) -> float:
    """The largest relative difference (|a - b| / max(1, |b|)) between chunked_scores, cut into at least three
    pieces, and the whole forward's reference_scores over `sequences` (log-probs, and with top_k the top-k log-probs
    and tails); NaN if any difference is."""
    worst = 0.0
    for prompt, completion in sequences:
        if top_k:
            whole = reference_scores(model, prompt, completion, top_k)
        else:
            whole = TokenScores(reference_logps(model, prompt, completion))
        piece = chunked_scores(model, prompt, completion, top_k, _vocab(model) * max(1, len(completion) // 3))
        for a, b in zip(_values(piece, top_k), _values(whole, top_k)):
            a, b = a.double().cpu().numpy(), b.double().cpu().numpy()
            if a.shape != b.shape:
                return float("nan")
            same = a == b  # a tail of -inf on both sides (k = the vocabulary)
            with np.errstate(invalid="ignore"):
                rel = np.where(same, 0.0, np.abs(a - b) / np.maximum(1.0, np.abs(b)))
            if np.isnan(rel).any():
                return float("nan")
            worst = max(worst, float(np.max(rel, initial=0.0)))
    return worst


def _vocab(model) -> int:
    return unwrap(model).get_output_embeddings().weight.shape[0]


def _values(scores: TokenScores, top_k: int) -> list[torch.Tensor]:
    return [scores.logps, scores.top_logps, scores.tail] if top_k else [scores.logps]


def proof_sequences(model, sequences: list[tuple[list[int], list[int]]], count: int = 2):
    """What the chunked truth is proven on: the longest of `sequences` whose whole forward fits, else a prefix of
    the shortest long one cut to fit (the same model, the same job's tokens)."""
    fitting = sorted((s for s in sequences if fits(model, *s)), key=lambda s: -len(s[0]) - len(s[1]))
    if fitting:
        return fitting[:count]
    prompt, completion = min(sequences, key=lambda s: len(s[0]) + len(s[1]))
    room = max(2, WHOLE_ELEMENTS // _vocab(model))
    prompt = prompt[: max(1, min(len(prompt), room // 2))]
    return [(prompt, completion[: max(1, room - len(prompt))])]


def chosen_truth(model, sequences: list[tuple[list[int], list[int]]], top_k: int = 0) -> tuple[set, dict | None]:
    """Which of `sequences` (indices) the truth scores in pieces, and the proof to record (None: every sequence
    fits, so the whole forward scores all). A model without the chunked path, or whose chunked values differ from
    its whole forward on the proof's sequences, keeps the whole forward for all (the record says why)."""
    long = {i for i, s in enumerate(sequences) if not fits(model, *s)}
    if not long:
        return set(), None
    record = {"kind": "whole forward", "long_sequences": len(long), "whole_elements": WHOLE_ELEMENTS}
    if not supports_chunks(model):
        return set(), record | {"why": "the model's forward takes no logits_to_keep"}
    proof = proof_sequences(model, sequences)
    try:
        diff = chunked_difference(model, proof, top_k)
    except Exception as e:  # a forward that rejects a held backbone or a tensor logits_to_keep
        return set(), record | {"why": f"the chunked forward failed ({type(e).__name__})"}
    proven = {"proven_on": [len(p) + len(c) for p, c in proof], "max_relative_difference": diff,
              "tolerance": truth_tolerance(unwrap(model).dtype), "piece_elements": PIECE_ELEMENTS}
    if not diff <= proven["tolerance"]:  # NaN too
        return set(), record | proven | {"why": "the chunked forward differs from the whole forward on this model"}
    return long, record | proven | {"kind": "chunked"}
