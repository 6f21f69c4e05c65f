"""audit-ref --model: the model and tokenizer hashes, and the replay of a seeded sample of cached rows through the
plain forward (kept in its own file: a shared truth function may replace `replay`'s scoring later)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import polars as pl

from schemas.stamps import tokenizer_hash

from .cache import CacheScan
from .checks import FAIL, PASS, SKIP, Check
from .checks import short as _short


def default_tolerance(dtype: str, recorded_device: str | None, local_device: str) -> float:
    """Per-token replay tolerance: what the recorded dtype allows, wider when replaying on another device type."""
    base = 1e-4 if dtype == "float32" else 5e-2
    if recorded_device and recorded_device != local_device:
        base *= 10 if dtype == "float32" else 2
    return base



def audit_model(root: Path, manifest: dict, scan: CacheScan, model_dir: str, *, sample: int | None, seed: int,
                tolerance: float | None, trust_remote_code: bool):
    """Model and tokenizer hash checks and the replay; returns (checks, tokenizer, tokenizer_ok)."""
    from runtime.checkpoint import Checkpoint

    checkpoint = Checkpoint.open(model_dir, trust_remote_code)
    stamps = manifest["stamps"]
    found_model = checkpoint.model_hash
    tokenizer = checkpoint.tokenizer
    found_tok = tokenizer_hash(tokenizer)
    checks = []
    for name, found, what in (("model_hash", found_model, "weights and behavioural config"),
                              ("tokenizer_hash", found_tok, "tokenizer, special tokens and chat template")):
        ok = found == stamps[name]
        detail = (f"{model_dir}: {what} match the cache ({_short(found)})" if ok else
                  f"{model_dir} hashes to {_short(found)}, the cache was made with {_short(stamps[name])}")
        checks.append(Check(name, PASS if ok else FAIL, detail))
    if found_model != stamps["model_hash"]:
        checks.append(Check("replay", SKIP, "not replayed: this is not the model the cache was made with"))
    elif sample == 0:
        checks.append(Check("replay", SKIP, "--sample 0"))
    elif scan.index.height == 0:
        checks.append(Check("replay", SKIP, "no verified rows to replay"))
    else:
        checks.append(replay(root, manifest, scan.index, checkpoint, sample=sample, seed=seed, tolerance=tolerance))
    return checks, tokenizer, found_tok == stamps["tokenizer_hash"]


def replay(root: Path, manifest: dict, index: pl.DataFrame, checkpoint, *, sample, seed, tolerance) -> Check:
    """Score a seeded sample of cached rows again with the definition of a reference log-prob
    (`runtime.logprobs.reference_logps`: the unpadded sequence alone through the model's own forward, whatever
    mode made the cache), in the recorded dtype on this machine's device, and compare per token with the cached
    values. `checkpoint`: a runtime.checkpoint.Checkpoint; `sample=None` replays every row."""
    from runtime.checkpoint import preserved_rng, resolve_device, resolve_dtype

    t0 = time.perf_counter()
    comp = manifest.get("computation") or {}
    dtype = comp.get("dtype", "float32")
    device = resolve_device("auto")
    tol = tolerance if tolerance is not None else default_tolerance(dtype, comp.get("device_type"), device.type)
    count = index.height if sample is None else min(sample, index.height)
    picks = np.sort(np.random.default_rng(seed).choice(index.height, size=count, replace=False))
    found = Differences(tol)
    with preserved_rng():
        try:
            model = checkpoint.load_model(resolve_dtype(dtype, device), device, comp.get("attn_implementation"))
        except (ImportError, ValueError):  # e.g. flash_attention_2 recorded, not installed here
            model = checkpoint.load_model(resolve_dtype(dtype, device), device, "sdpa")
        for (shard,), group in index[picks].group_by("shard", maintain_order=True):
            _replay_shard(model, root / shard, group["row"], found)
    info = {"rows": count, "dtype": dtype, "device": str(device), "recorded_device_type": comp.get("device_type"),
            "tolerance": tol, "seed": seed, "sampled": index[picks]["id"].to_list()}
    return found.check(info, time.perf_counter() - t0)


def _replay_shard(model, path: Path, rows: pl.Series, found: "Differences") -> None:
    """Replay the given rows of one shard and add their differences from the cached values to `found`."""
    from runtime.logprobs import reference_logps

    for r in pl.read_parquet(path).with_row_index("row").filter(pl.col("row").is_in(rows.implode())).to_dicts():
        for side in ("chosen", "rejected"):
            new = reference_logps(model, r["prompt_input_ids"], r[f"{side}_input_ids"]).cpu().numpy()
            found.add(path.name, r, side, new.astype(np.float64))


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
        summary = (f"{info['rows']:,} rows ({tokens.size:,} tokens) in {info['dtype']} on {info['device']}: per token "
                   f"max {info['token_max_abs_diff']:.1e} mean {info['token_mean_abs_diff']:.1e}, per sequence max "
                   f"{info['sequence_max_abs_diff']:.1e} mean {info['sequence_mean_abs_diff']:.1e}; tolerance "
                   f"{self.tol:.0e}")
        if self.first:
            self.first.detail = f"{self.beyond:,} token(s) beyond tolerance; first: {self.first.detail}; {summary}"
            self.first.info = info
            return self.first
        return Check("replay", PASS, summary, info=info)
