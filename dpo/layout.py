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
import itertools
from functools import partial

import numpy as np
import torch

from runtime import cost
from runtime.logprobs import completion_logps, token_logps, unwrap
from runtime.architecture import tree_mask_unsupported
from runtime.packing import additive_mask, pack_rows, tree_inputs
from runtime.placement import input_device
from runtime.probe import disagreement
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
        return batch | reference_columns(rows)  # cached reference values, in the same order as the log-probs


def reference_columns(rows: list[dict]) -> dict:
    """Every cached per-token pair of columns `ref_chosen_X` / `ref_rejected_X` of the rows as `batch["ref_X"]`:
    the chosen rows' values, then the rejected rows', flattened over tokens in the order of the log-probs (both
    collators). Ids (X ending in `ids`) are long, values float32: `ref_logps` [N], `ref_top_ids` / `ref_top_logps`
    [N, K], `ref_tail` [N]."""
    batch = {}
    for name in rows[0] if rows else ():
        if not name.startswith("ref_chosen_"):
            continue
        x = name.removeprefix("ref_chosen_")
        dtype = np.int64 if x.endswith("ids") else np.float32
        tokens = itertools.chain.from_iterable([r[name] for r in rows] + [r[f"ref_rejected_{x}"] for r in rows])
        batch[f"ref_{x}"] = torch.from_numpy(np.array(list(tokens), dtype=dtype))  # one array: ~2.5x faster
    return batch


def pair_logps(model, inputs: dict, given: torch.Tensor | None = None):
    """Per-token completion log-probs of a batch from either collator: chosen of every pair, then rejected. With
    `given` ([N, K] ids per completion token, e.g. `batch["ref_top_ids"]`), (log-probs, log-probs of those ids,
    log of the mass outside them) from the same forward (runtime.logprobs.token_logps)."""
    if "tree_mask" not in inputs:
        return completion_logps(model, inputs["input_ids"], inputs["attention_mask"], inputs["prompt_lens"],
                                inputs["completion_lens"], given=given)
    dtype = next(model.parameters()).dtype  # the dtype transformers builds its own masks in
    model_inputs = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"],
                    "attention_mask": additive_mask(inputs["tree_mask"], dtype)}
    return token_logps(model, model_inputs, inputs["score_rows"], inputs["score_sources"], inputs["score_targets"],
                       given=given)


# ---------------------------------------------------------------------------------------------------------------
# choosing the layout


def estimated_work(lengths: np.ndarray, batch_size: int, hidden: int, seed: int = 0, max_batches: int = 256) -> dict:
    """Token-equivalent work per layout over random batches like the Trainer's sampler draws (`lengths`: [pairs, 3]
    prompt, chosen, rejected), by runtime/cost.py, the model precompute-ref's modes are weighed by: padded is
    right-padded rows of sequences, prefix_shared rows of packed pairs under the tree mask."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    work = {"padded": 0.0, "prefix_shared": 0.0}
    for start in range(0, min(len(order), batch_size * max_batches), batch_size):
        P, C, R = lengths[order[start:start + batch_size]].T
        seqs = np.concatenate([P + C, P + R])
        work["padded"] += cost.work(*cost.padded_rows(seqs), hidden)
        rows = pack_rows((P + C + R).tolist(), pack=True)
        work["prefix_shared"] += cost.work(*cost.tree_rows([int(sum(P[i] + C[i] + R[i] for i in r)) for r in rows]),
                                           hidden)
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
def prefix_shared_logps(model, pairs: list[EncodedPair], pad_id: int) -> list[torch.Tensor]:
    """Per-token log-probs of `pairs` from one prefix_shared batch, in the probe's order (chosen, rejected of each
    pair)."""
    device = input_device(unwrap(model))  # a reference split by --ref-device-map: where its inputs go
    rows = [{"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids, "rejected_ids": p.rejected_ids} for p in pairs]
    batch = {k: v.to(device) for k, v in PrefixSharedCollator(pad_id)(rows).items()}
    lens = [len(p.chosen_ids) for p in pairs] + [len(p.rejected_ids) for p in pairs]
    parts = pair_logps(model, batch).cpu().split(lens)
    return [parts[k] for i in range(len(pairs)) for k in (i, len(pairs) + i)]


def probe_reasons(models: list, sample: list[EncodedPair], pad_id: int, autocast: torch.dtype | None) -> list[str]:
    """Why the probe (runtime/probe.py) rejects prefix_shared, or []: each model in its own dtype, then (mixed
    precision) under the autocast the Trainer runs the forward in, where kernels, mask dtype and rounding differ; the
    tolerance is that of the dtype the forward computes in."""
    for dtype in [None] + ([autocast] if autocast is not None else []):
        where = f" under {str(dtype).removeprefix('torch.')} autocast" if dtype else ""
        for m in models:  # a live reference under --bf16 is loaded in bf16, the policy in float32
            device = input_device(unwrap(m)).type
            with torch.autocast(device, dtype=dtype) if dtype else contextlib.nullcontext():
                reason = disagreement(m, partial(prefix_shared_logps, m, pad_id=pad_id), sample, dtype=dtype,
                                      where=where)
            if reason:
                return [reason]
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

