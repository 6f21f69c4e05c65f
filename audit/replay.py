"""audit-ref --model: the model and tokenizer hashes, and the replay of a seeded sample of cached rows: in padded
batches of a layout other than the cache's once they reproduce `runtime.logprobs.reference_logps` on a probe of those
rows, else one sequence at a time with reference_logps itself."""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import numpy as np
import polars as pl

from runtime.cli import heap_settled
from runtime.placed import Placement, load_placed
from runtime.placement import describe
from schemas.encoding import EncodedPair
from schemas.columns import TokenScores
from schemas.format import top_k_of
from schemas.rules import stamp_findings, top_k_allowance
from schemas.stamps import tokenizer_hash

from .cache import CacheScan, shard_rows
from .checks import FAIL, PASS, SKIP, Check
from .checks import short as _short


def audit_model(root: Path, manifest: dict, scan: CacheScan, model_dir: str, *, sample: int | None, seed: int,
                tolerance: float | None, trust_remote_code: bool, split: Placement | None = None):
    """Model and tokenizer hash checks and the replay; returns (checks, tokenizer, tokenizer_ok). `split`: the
    replay's placement (runtime/placed.py, audit-ref --device-map ...), None for the whole model on one device."""
    from runtime.checkpoint import Checkpoint

    checkpoint = Checkpoint.open(model_dir, trust_remote_code)
    stamps = manifest["stamps"]
    found_model = checkpoint.model_hash
    tokenizer = checkpoint.tokenizer
    found_tok = tokenizer_hash(tokenizer)
    differ = {f.kind: f for f in stamp_findings(stamps, {"model_hash": found_model, "tokenizer_hash": found_tok})}
    checks = []
    for name, found, what in (("model_hash", found_model, "weights and behavioural config"),
                              ("tokenizer_hash", found_tok, "tokenizer, special tokens and chat template")):
        detail = (f"{model_dir} hashes to {_short(found)}, the cache was made with {_short(differ[name].found)}"
                  if name in differ else f"{model_dir}: {what} match the cache ({_short(found)})")
        checks.append(Check(name, FAIL if name in differ else PASS, detail))
    skip = ("not replayed: this is not the model the cache was made with" if "model_hash" in differ else
            "--sample 0" if sample == 0 else "no verified rows to replay" if scan.index.height == 0 else None)
    if skip:
        checks += [Check("replay", SKIP, skip), Check("replay_top_k", SKIP, _top_k(manifest)[1] or skip)]
    else:
        checks += replay(root, manifest, scan.index, checkpoint, sample=sample, seed=seed, tolerance=tolerance,
                         split=split)
    return checks, tokenizer, "tokenizer_hash" not in differ


def _top_k(manifest: dict) -> tuple[int, str | None]:
    """The cache's K, or 0 and why its top-k columns are not replayed."""
    k = top_k_of(manifest.get("computation"))
    if not k:
        return 0, "no top-k columns (a cache made without precompute-ref --top-k)"
    if not (isinstance(k, int) and not isinstance(k, bool) and k > 0):
        return 0, f"computation.top_k is {k!r} (top_k_shape reports it)"
    return k, None


def replay(root: Path, manifest: dict, index: pl.DataFrame, checkpoint, *, sample, seed, tolerance,
           split: Placement | None = None) -> list[Check]:
    """Score a seeded sample of cached rows again, in the recorded dtype on this machine's device, and compare per
    token with the cached values; with top-k columns, also those (check replay_top_k). `checkpoint`: a
    runtime.checkpoint.Checkpoint; `sample=None` replays every row.

    The rows run in length-sorted padded batches of a layout other than the one that wrote the cache (`_layout`),
    once that layout reproduces the definition of a reference log-prob (`runtime.logprobs.reference_logps`: the
    unpadded sequence alone through the model's own forward) on a probe of the sampled rows, the longest included,
    at the tolerance of runtime/tolerance.py; otherwise (or for a model whose numbers depend on the batch's shape)
    one sequence at a time with reference_logps itself, the reason in the check's info. With `split` the model is
    dispatched by its device map (runtime/placement.py): probe, truth and batches all run on the split model."""
    from runtime.checkpoint import preserved_rng, resolve_device, resolve_dtype
    from runtime.tolerance import replay_tolerance

    t0 = time.perf_counter()
    comp = manifest.get("computation") or {}
    dtype = comp.get("dtype", "float32")
    device = split.main_device(resolve_device("auto")) if split else resolve_device("auto")
    tol = tolerance if tolerance is not None else replay_tolerance(dtype, comp.get("device_type"), device.type)
    count = index.height if sample is None else min(sample, index.height)
    picks = np.sort(np.random.default_rng(seed).choice(index.height, size=count, replace=False))
    found = Differences(tol)
    k, no_top_k = _top_k(manifest)
    top_k = TopKDifferences(tol, k) if k else None
    with preserved_rng(), contextlib.ExitStack() as held:  # held: a split model's offload folder
        load = functools.partial(_load, checkpoint, resolve_dtype(dtype, device), None if split else device,
                                 comp.get("attn_implementation"))
        if split:
            model, layout = load_placed(load, f"--model {checkpoint.path}", split, held)
        else:
            model = load()
        heap_settled()  # the libraries and the model: alive until the audit ends (audit.cli.process_main)
        vocab = model.get_output_embeddings().weight.shape[0]
        if top_k and top_k.k > vocab:  # top_k_shape reports the lists
            top_k, no_top_k = None, f"computation.top_k is {k}, more than the model's {vocab} tokens"
        t1 = time.perf_counter()
        way = _replay_way(root, model, comp, index[picks], checkpoint.pad_id, top_k.k if top_k else 0)
        for (shard,), group in index[picks].group_by("shard", maintain_order=True):
            rows = shard_rows(root / shard, group["row"])
            scores = way.score([(r["prompt_input_ids"], r[f"{side}_input_ids"]) for r in rows for side in SIDES])
            for n, (r, side) in enumerate((r, side) for r in rows for side in SIDES):
                found.add(shard, r, side, np.asarray(scores[n].logps, np.float64))
                if top_k:
                    top_k.add(shard, r, side, scores[n].top_ids, scores[n].top_logps, scores[n].tail, model)
    scoring = time.perf_counter() - t1
    info = {"rows": count, "dtype": dtype, "device": str(device), "recorded_device_type": comp.get("device_type"),
            "tolerance": tol, "seed": seed, "sampled": index[picks]["id"].to_list(), **way.info(count, scoring),
            **({"split": layout} if split else {})}
    seconds = time.perf_counter() - t0
    return [found.check(info, seconds),
            top_k.check(info) if top_k else Check("replay_top_k", SKIP, no_top_k)]


def _load(checkpoint, dtype, device, attn: str | None, **placed):
    """The model with the recorded attention implementation, or sdpa where that one is not available here (e.g.
    flash_attention_2 recorded, not installed); `placed`: a split's from_pretrained options (runtime/placed.py)."""
    try:
        return checkpoint.load_model(dtype, device, attn, **placed)
    except (ImportError, ValueError):
        return checkpoint.load_model(dtype, device, "sdpa", **placed)


SIDES = ("chosen", "rejected")
PROBE_ROWS = 4  # the two longest and the two shortest of the replayed rows


def recorded_budget(comp: dict) -> int:
    """The padded tokens per batch the cache was computed with (its manifest's `computation`; what `auto` came to on
    the machine that wrote it), else precompute-ref's default: the replay's and a view's batches, before
    runtime.logprobs.effective_budget bounds them by the model's head."""
    from runtime.budget import DEFAULT_TOKEN_BUDGET

    recorded = comp.get("token_budget")
    if recorded == "auto":  # a note beside it says what it came to
        resolved = comp.get("token_budget_resolved")
        recorded = resolved.get("tokens") if isinstance(resolved, dict) else None
    return recorded if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0 else \
        DEFAULT_TOKEN_BUDGET


def _layout(comp: dict) -> tuple[bool, str]:
    """(left padding?, its name): the padded layout the replay runs, never the one that wrote the cache, so that a
    mistake of that layout on some rows (a padded slot seen, a position shifted) is not made again by the replay
    and passed off as agreement."""
    mode = comp.get("mode")
    if mode == "full_forward":  # right-padded batches wrote it: pad on the left, positions given from the mask
        return True, "left-padded batches (the cache was written from right-padded ones, full_forward)"
    return False, f"right-padded batches (the cache was written with {mode or 'an unrecorded mode'})"


class _Way:
    """How the replay scores: `score(sequences)` gives a TokenScores (numpy) per (prompt, completion), in order."""

    def __init__(self, model, pad_id: int, top_k: int, budget: int, left: bool | None, name: str, why: str | None):
        self.model, self.pad_id, self.top_k, self.budget, self.left = model, pad_id, top_k, budget, left
        self.name, self.why = name, why

    def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[TokenScores]:
        if self.left is None:
            return [_truth(self.model, p, c, self.top_k) for p, c in sequences]
        from runtime.logprobs import padded_scores
        from runtime.packing import length_batches

        out = [None] * len(sequences)
        for batch in length_batches([len(p) + len(c) for p, c in sequences], self.budget):
            scores, _ = padded_scores(self.model, [sequences[i] for i in batch], self.pad_id, self.top_k, self.left)
            for i, s in zip(batch, scores):
                out[i] = s
        return out

    def info(self, rows: int, seconds: float) -> dict:
        return {"layout": self.name, "fallback": self.why, "scoring_seconds": round(seconds, 3),
                "rows_per_s": round(rows / seconds, 2) if seconds > 0 else None}


def _truth(model, prompt: list[int], completion: list[int], top_k: int) -> TokenScores:
    """The definition's own values of one sequence: reference_logps (and reference_top_k)."""
    from runtime.probe import reference_value

    value = reference_value(model, prompt, completion, top_k)
    return value if top_k else TokenScores(value)


def _replay_way(root: Path, model, comp: dict, picked: pl.DataFrame, pad_id: int, top_k: int) -> _Way:
    """Batches of `_layout`, if they reproduce reference_logps (and reference_top_k) on probe rows of `picked`, the
    longest included (runtime/probe.py, at the probe's tolerance); else one sequence at a time, saying why."""
    from runtime.architecture import shape_dependent
    from runtime.logprobs import effective_budget
    from runtime.probe import disagreement, reference_values

    left, name = _layout(comp)
    size = picked.with_columns(n=pl.col("prompt_tokens") + pl.max_horizontal("chosen_tokens", "rejected_tokens"))
    size = size.with_row_index("at").sort("n", "at")
    probe_at = sorted(set(size["at"].head(PROBE_ROWS // 2).to_list() + size["at"].tail(PROBE_ROWS // 2).to_list()))
    longest = int(size["n"].max()) if size.height else 0
    way = _Way(model, pad_id, top_k, effective_budget(model, recorded_budget(comp), longest), left, name, None)
    why = shape_dependent(model, longest)
    if why is None:
        probe = picked[probe_at]
        rows = [r for (shard,), g in probe.group_by("shard", maintain_order=True) for r in shard_rows(root / shard, g["row"])]
        pairs = [EncodedPair(r["prompt_input_ids"], r["chosen_input_ids"], r["rejected_input_ids"]) for r in rows]
        fast = lambda ps: way.score([(p.prompt_ids, c) for p in ps for c in (p.chosen_ids, p.rejected_ids)])
        why = disagreement(model, fast, pairs, truth=reference_values(model, pairs, top_k))
        if why is None:
            way.name = f"{name}, matching reference_logps on {len(pairs)} probe rows (the longest included)"
            return way
    return _Way(model, pad_id, top_k, 0, None, f"one sequence at a time (reference_logps): {name.split(' (')[0]} "
                f"not used, {why}", why)


class Differences:
    """Per-token and per-sequence differences between replayed and cached values, and the first token beyond the
    tolerance."""

    def __init__(self, tolerance: float):
        self.tol = tolerance
        self.tokens, self.seqs, self.first, self.beyond, self.uncomparable = [], [], None, 0, 0

    def add(self, shard: str, r: dict, side: str, new: np.ndarray) -> None:
        old = np.asarray(r[f"{side}_logps"], np.float64)
        if len(old) != len(new):
            self.uncomparable += 1  # list_lengths reports it
            return
        diff = np.abs(new - old)
        self.tokens.append(diff)
        self.seqs.append(abs(new.sum() - r[f"{side}_logp"]))
        bad = ~(diff <= self.tol)  # NaN counts as beyond
        self.beyond += int(bad.sum())
        if bad.any() and self.first is None:
            j = int(np.argmax(bad))
            self.first = Check("replay", FAIL, f"shard {shard} row {r['row']} (id {r['id']!r}) {side} token {j}: "
                               f"cached {old[j]:.6f}, replayed {new[j]:.6f}, |diff| {diff[j]:.1e}", shard, r["row"])

    def check(self, info: dict, seconds: float) -> Check:
        """The replay check: PASS, or FAIL at the first token beyond the tolerance; `info` gains the statistics."""
        tokens = np.concatenate(self.tokens) if self.tokens else np.zeros(0)
        seqs = np.asarray(self.seqs) if self.seqs else np.zeros(0)
        stat = lambda a, f: float(f(a)) if a.size else 0.0
        info = {"rows": info["rows"], "tokens": int(tokens.size), **info,
                "token_max_abs_diff": stat(tokens, np.max), "token_mean_abs_diff": stat(tokens, np.mean),
                "sequence_max_abs_diff": stat(seqs, np.max), "sequence_mean_abs_diff": stat(seqs, np.mean),
                "tokens_beyond_tolerance": self.beyond, "sequences_not_comparable": self.uncomparable,
                "seconds": round(seconds, 3)}
        summary = (f"{info['rows']:,} rows ({tokens.size:,} tokens) in {info['dtype']} on {info['device']}, "
                   f"{info['rows_per_s'] or 0:,.1f} rows/s through {info['layout']}: per token "
                   f"max {info['token_max_abs_diff']:.1e} mean {info['token_mean_abs_diff']:.1e}, per sequence max "
                   f"{info['sequence_max_abs_diff']:.1e} mean {info['sequence_mean_abs_diff']:.1e}; tolerance "
                   f"{self.tol:.0e}" + (f"; the model split by {describe(info['split'])}" if info.get("split") else ""))
        return _outcome("replay", self.first, self.beyond, summary, info)


def _gap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|, 0 where both are the same infinity (an empty tail replayed as empty)."""
    with np.errstate(invalid="ignore"):
        return np.where(a == b, 0.0, np.abs(a - b))


class TopKDifferences:
    """Cached top-k columns against `reference_top_k` of the same sequence: per token, the values rank by rank and
    the tail, and an id that differs only where it is a tie (its own replayed log-prob, from
    `reference_log_softmax`, equal to the cached one within the tolerance: the same value in another order, or a
    tie with the k-th). Each cached value may differ by the replay's tolerance plus its storage's rounding
    (schemas.rules.top_k_allowance)."""

    def __init__(self, tolerance: float, k: int):
        self.tol, self.k = tolerance, k
        self.tokens, self.first, self.beyond, self.uncomparable, self.ties = [], None, 0, 0, 0

    def add(self, shard: str, r: dict, side: str, ids, logps, tail, model) -> None:
        try:
            old_ids = np.asarray(r[f"{side}_top_ids"], np.int64).reshape(ids.shape)
            old = np.asarray(r[f"{side}_top_logps"], np.float64).reshape(logps.shape)
            old_tail = np.asarray(r[f"{side}_tail"], np.float64).reshape(tail.shape)
        except (TypeError, ValueError):
            self.uncomparable += 1  # top_k_shape reports it
            return
        diff = _gap(old, logps.astype(np.float64))
        other = old_ids != ids
        if other.any():  # each cached id's own replayed log-prob
            from runtime.logprobs import reference_log_softmax

            full = reference_log_softmax(model, r["prompt_input_ids"], r[f"{side}_input_ids"]).cpu().numpy()
            inside = (old_ids >= 0) & (old_ids < full.shape[1])
            own = np.take_along_axis(full, np.where(inside, old_ids, 0), axis=1).astype(np.float64)
            id_diff = np.where(inside, _gap(old, own), np.inf)
            diff = np.where(other, np.maximum(diff, id_diff), diff)
        allowed = self.tol + top_k_allowance(old)
        if other.any():
            self.ties += int((other & (id_diff <= allowed)).sum())
        tail_diff = _gap(old_tail, tail.astype(np.float64))
        self.tokens.append(np.maximum(diff.max(1, initial=0.0), tail_diff))
        beyond = ~(diff <= allowed)  # NaN counts as beyond
        bad = beyond.any(1) | ~(tail_diff <= self.tol + top_k_allowance(old_tail))
        self.beyond += int(bad.sum())
        if bad.any() and self.first is None:
            j = int(np.argmax(bad))
            ranks = np.flatnonzero(beyond[j])
            what = (f"rank {ranks[0]}: cached id {old_ids[j, ranks[0]]} log-prob {old[j, ranks[0]]:.6f}, replayed id "
                    f"{ids[j, ranks[0]]} log-prob {logps[j, ranks[0]]:.6f}" if ranks.size else
                    f"tail: cached {old_tail[j]:.6f}, replayed {tail[j]:.6f}")
            self.first = Check("replay_top_k", FAIL, f"shard {shard} row {r['row']} (id {r['id']!r}) {side} token {j} "
                               f"{what}", shard, r["row"])

    def check(self, info: dict) -> Check:
        """The replay_top_k check: PASS, or FAIL at the first token beyond the tolerance."""
        tokens = np.concatenate(self.tokens) if self.tokens else np.zeros(0)
        stat = lambda f: float(f(tokens)) if tokens.size else 0.0
        info = {"rows": info["rows"], "tokens": int(tokens.size), "k": self.k, "tolerance": self.tol,
                "token_max_abs_diff": stat(np.max), "token_mean_abs_diff": stat(np.mean),
                "tokens_beyond_tolerance": self.beyond, "ids_tied": self.ties,
                "sequences_not_comparable": self.uncomparable}
        summary = (f"{info['rows']:,} rows ({tokens.size:,} tokens), K = {self.k}: ids equal but {self.ties} tie(s), "
                   f"log-probs and tail per token max {info['token_max_abs_diff']:.1e} mean "
                   f"{info['token_mean_abs_diff']:.1e}; tolerance {self.tol:.0e} + the storage's rounding")
        return _outcome("replay_top_k", self.first, self.beyond, summary, info)


def _outcome(name: str, first: Check | None, beyond: int, summary: str, info: dict) -> Check:
    """A replay's check: its first token beyond tolerance (FAIL, with the count and the summary), else PASS."""
    if first:
        first.detail = f"{beyond:,} token(s) beyond tolerance; first: {first.detail}; {summary}"
        first.info = info
        return first
    return Check(name, PASS, summary, info=info)
