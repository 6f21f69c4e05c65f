"""Training batch layouts: how a batch of pairs goes through the policy (and a live reference).

  padded         chosen and rejected as two right-padded [prompt | completion] sequences per pair: every prompt runs
                 through the forward and backward twice, plus padding.
  prefix_shared  each pair one [prompt | chosen | rejected] segment with the tree mask and restarted positions of
                 runtime.packing (the same code precompute-ref's packed mode runs), several pairs packed per row up to
                 the batch's longest pair: every prompt once.

Both give the same per-token log-probs, in the same order (chosen of every pair, then rejected of every pair), so
the loss, metrics and gradients do not depend on the layout. `auto` takes prefix_shared when the model can take the
tree mask, it is estimated to do less work on this data, and a probe on real pairs (the longest included) matches
the model's own plain forward; otherwise padded, with one log line saying why.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from runtime.logprobs import completion_logps, reference_logps, token_logps
from runtime.architecture import tree_mask_unsupported
from runtime.packing import additive_mask, pack_rows, tree_inputs
from schemas.encoding import EncodedPair


class PrefixSharedCollator:
    """Rows -> packed rows of [prompt | chosen | rejected] segments with a boolean tree mask; the scoring indices
    are reordered so the log-probs come out as the padded layout's: chosen of pairs 0..B-1, then rejected."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict:
        pairs = [EncodedPair(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]
        lengths = [len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs]
        packed = pack_rows(lengths, pack=True)
        ids, pos, allowed, score_rows, sources, targets = tree_inputs(pairs, packed, self.pad_id)
        # tree_inputs scores row by row, pair by pair, chosen then rejected: find each block and put it in place
        clen = torch.tensor([len(p.chosen_ids) for p in pairs])
        rlen = torch.tensor([len(p.rejected_ids) for p in pairs])
        visit = [i for row in packed for i in row]
        block_len = torch.stack([clen[visit], rlen[visit]], 1).ravel()
        block_start = torch.cumsum(block_len, 0) - block_len
        start = torch.empty(2 * len(pairs), dtype=torch.long)
        start[torch.tensor(visit)] = block_start[0::2]
        start[torch.tensor(visit) + len(pairs)] = block_start[1::2]
        lens = torch.cat([clen, rlen])
        order = torch.repeat_interleave(start, lens) + torch.arange(int(lens.sum())) - torch.repeat_interleave(
            torch.cumsum(lens, 0) - lens, lens)
        batch = {
            "input_ids": ids,
            "position_ids": pos,
            "tree_mask": allowed,
            "score_rows": score_rows[order],
            "score_sources": sources[order],
            "score_targets": targets[order],
            "completion_lens": lens,
        }
        if "ref_chosen_logps" in rows[0]:  # cached reference values, in the same order as the log-probs
            values = [r["ref_chosen_logps"] for r in rows] + [r["ref_rejected_logps"] for r in rows]
            batch["ref_logps"] = torch.cat([torch.as_tensor(v, dtype=torch.float32) for v in values])
        return batch


def pair_logps(model, inputs: dict) -> torch.Tensor:
    """Per-token completion log-probs of a batch from either collator: chosen of every pair, then rejected."""
    if "tree_mask" not in inputs:
        return completion_logps(model, inputs["input_ids"], inputs["attention_mask"], inputs["prompt_lens"],
                                inputs["completion_lens"])
    dtype = next(model.parameters()).dtype  # the dtype transformers builds its own masks in
    model_inputs = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"],
                    "attention_mask": additive_mask(inputs["tree_mask"], dtype)}
    return token_logps(model, model_inputs, inputs["score_rows"], inputs["score_sources"], inputs["score_targets"])


# ---------------------------------------------------------------------------------------------------------------
# choosing the layout


def estimated_work(lengths: np.ndarray, batch_size: int, hidden: int, seed: int = 0, max_batches: int = 256) -> dict:
    """Token-equivalent work per layout over random batches like the Trainer's sampler draws (`lengths`: [pairs, 3]
    prompt, chosen, rejected). Slots through the layers (padding included) plus attention scores weighted
    1 / (6 * hidden) of a token, as precompute's estimate; a custom or padding mask makes the kernel compute every
    score, causal attention without padding about half."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    work = {"padded": 0.0, "prefix_shared": 0.0}
    for start in range(0, min(len(order), batch_size * max_batches), batch_size):
        P, C, R = lengths[order[start:start + batch_size]].T
        seqs = np.concatenate([P + C, P + R])
        width = seqs.max()
        share = 0.5 if (seqs == width).all() else 1.0
        work["padded"] += len(seqs) * width + len(seqs) * width**2 * share / (6 * hidden)
        rows = pack_rows((P + C + R).tolist(), pack=True)
        row_width = max(int(sum(P[i] + C[i] + R[i] for i in r)) for r in rows)
        work["prefix_shared"] += len(rows) * row_width + len(rows) * row_width**2 / (6 * hidden)
    return work


def table_lengths(table) -> np.ndarray:
    """[pairs, 3] prompt, chosen and rejected lengths of a rows table, without materialising the ids."""
    import pyarrow.compute as pc

    return np.stack([pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False)
                     for c in ("prompt_ids", "chosen_ids", "rejected_ids")], axis=1).astype(np.int64)


def probe_pairs(table, lengths: np.ndarray) -> list[EncodedPair]:
    """Real pairs, whole: the longest, the shortest and one whose prompt length differs from both."""
    total = lengths.sum(1)
    picks = [int(np.argmax(total)), int(np.argmin(total))]
    other = np.flatnonzero(~np.isin(lengths[:, 0], lengths[picks, 0]))
    if len(other):
        picks.append(int(other[np.argmax(total[other])]))
    rows = table.take(sorted(set(picks))).select(["prompt_ids", "chosen_ids", "rejected_ids"]).to_pylist()
    return [EncodedPair(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]


@torch.no_grad()
def probe_difference(model, pairs: list[EncodedPair], pad_id: int) -> float:
    """Largest |packed - plain| per-token log-prob over `pairs`, the packed values from one prefix_shared batch."""
    device = next(model.parameters()).device
    rows = [{"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids} for p in pairs]
    batch = {k: v.to(device) for k, v in PrefixSharedCollator(pad_id)(rows).items()}
    got = pair_logps(model, batch).cpu()
    want = torch.cat([reference_logps(model, p.prompt_ids, c).cpu() for side in ("chosen_ids", "rejected_ids")
                      for p in pairs for c in [getattr(p, side)]])
    return float((got - want).abs().max())


LOW_PRECISION_TOLERANCE = 0.25  # per-token log-prob, bf16/fp16 weights or autocast (8 or 11 significant bits)


def probe_reasons(models: list, sample: list[EncodedPair], pad_id: int, autocast: torch.dtype | None) -> list[str]:
    """Why the probe rejects prefix_shared, or []: each model in its own dtype, then (mixed precision) under the
    autocast the Trainer runs the forward in, where kernels, mask dtype and rounding differ."""
    for dtype in [None] + ([autocast] if autocast is not None else []):
        where = f" under {str(dtype).removeprefix('torch.')} autocast" if dtype else ""
        for m in models:  # a live reference under --bf16 is loaded in bf16, the policy in float32
            exact = dtype is None and m.dtype == torch.float32
            tolerance = 1e-4 if exact else LOW_PRECISION_TOLERANCE
            device = next(m.parameters()).device.type
            try:
                with torch.autocast(device, dtype=dtype) if dtype else contextlib.nullcontext():
                    diff = probe_difference(m, sample, pad_id)
            except Exception as e:  # an architecture whose forward rejects the tree inputs
                return [f"not supported by this model{where} ({type(e).__name__}: {' '.join(str(e).split())[:200]})"]
            if not diff <= tolerance:
                return [f"differs from the plain forward by {diff:.2e}{where} on the probe pairs"]
    return []


def choose_layout(requested: str, models: list, table, batch_size: int, pad_id: int, log,
                  can_probe: bool = True, autocast: torch.dtype | None = None) -> str:
    """The layout to train with. prefix_shared (asked for or picked by auto) must pass the model checks and the probe
    for every model that runs on the batch (the policy, and a live reference), also under the mixed-precision
    autocast training runs in (`autocast`: its dtype); otherwise padded, logged once."""
    if requested == "padded":
        log("batch layout: padded (requested)")
        return "padded"
    lengths = table_lengths(table)
    longest = int((lengths[:, 0] + lengths[:, 1:].max(1)).max())
    reasons = [r for r in (tree_mask_unsupported(m, longest) for m in models) if r]
    ratio = None
    if not reasons:
        hidden = getattr(models[0].config.get_text_config(), "hidden_size", 1024)
        work = estimated_work(lengths, batch_size, hidden)
        ratio = work["padded"] / work["prefix_shared"]
        if requested == "auto" and ratio <= 1.0:
            reasons.append(f"no less work on this data (estimated {ratio:.2f}x)")
    if not reasons and not can_probe:
        reasons.append("the probe needs the whole model on one device (FSDP/DeepSpeed)")
    if not reasons:
        reasons += probe_reasons(models, probe_pairs(table, lengths), pad_id, autocast)
    if reasons:
        log(f"batch layout: padded ({'; '.join(reasons)})" if requested == "auto" else
            f"batch layout: padded, although prefix_shared was requested ({'; '.join(reasons)})")
        return "padded"
    work = f"; estimated {ratio:.2f}x less work than padded" if ratio else ""
    mixed = f", also under {str(autocast).removeprefix('torch.')} autocast" if autocast else ""
    log(f"batch layout: prefix_shared ({models[0].config._attn_implementation} attention{work}; matches the plain "
        f"forward on a probe of real pairs, the longest included{mixed})")
    return "prefix_shared"

