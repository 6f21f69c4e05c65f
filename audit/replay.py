"""audit-ref --model: the model and tokenizer hashes, and the replay of a seeded sample of cached rows through the
plain forward (kept in its own file: a shared truth function may replace `replay`'s scoring later)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import polars as pl

from schemas.stamps import model_hash, tokenizer_hash

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
    from runtime.checkpoint import check_checkpoint, load_tokenizer

    check_checkpoint(model_dir, trust_remote_code)
    stamps = manifest["stamps"]
    found_model = model_hash(model_dir)
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
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
        checks.append(replay(root, manifest, scan.index, model_dir, tokenizer, sample=sample, seed=seed,
                             tolerance=tolerance, trust_remote_code=trust_remote_code))
    return checks, tokenizer, found_tok == stamps["tokenizer_hash"]


def replay(root: Path, manifest: dict, index: pl.DataFrame, model_dir: str, tokenizer, *, sample, seed, tolerance,
           trust_remote_code) -> Check:
    """Score a seeded sample of cached rows again with the definition of a reference log-prob
    (`runtime.logprobs.reference_logps`: the unpadded sequence alone through the model's own forward, whatever
    mode made the cache), in the recorded dtype on this machine's device, and compare per token with the cached
    values. `sample=None` replays every row."""
    from runtime.checkpoint import load_model, preserved_rng, resolve_device, resolve_dtype
    from runtime.logprobs import reference_logps

    t0 = time.perf_counter()
    comp = manifest.get("computation") or {}
    dtype = comp.get("dtype", "float32")
    device = resolve_device("auto")
    tol = tolerance if tolerance is not None else default_tolerance(dtype, comp.get("device_type"), device.type)
    count = index.height if sample is None else min(sample, index.height)
    picks = np.sort(np.random.default_rng(seed).choice(index.height, size=count, replace=False))
    token_diffs, seq_diffs, first, beyond, uncomparable = [], [], None, 0, 0
    with preserved_rng():
        try:
            model = load_model(model_dir, resolve_dtype(dtype, device), device, comp.get("attn_implementation"),
                               trust_remote_code)
        except (ImportError, ValueError):  # e.g. flash_attention_2 recorded, not installed here
            model = load_model(model_dir, resolve_dtype(dtype, device), device, "sdpa", trust_remote_code)
        for (shard,), group in index[picks].group_by("shard", maintain_order=True):
            rows = pl.read_parquet(root / shard).with_row_index("row").filter(
                pl.col("row").is_in(group["row"].implode())).to_dicts()
            chosen = [reference_logps(model, r["prompt_input_ids"], r["chosen_input_ids"]).cpu().numpy() for r in rows]
            rejected = [reference_logps(model, r["prompt_input_ids"], r["rejected_input_ids"]).cpu().numpy()
                        for r in rows]
            for r, new_c, new_r in zip(rows, chosen, rejected):
                for side, new in (("chosen", new_c.astype(np.float64)), ("rejected", new_r.astype(np.float64))):
                    old = np.asarray(r[f"{side}_logps"], np.float64)
                    if len(old) != len(new):
                        uncomparable += 1  # list_lengths reports it
                        continue
                    diff = np.abs(new - old)
                    token_diffs.append(diff)
                    seq_diffs.append(abs(new.sum() - r[f"{side}_logp"]))
                    bad = ~(diff <= tol)  # NaN counts as beyond
                    beyond += int(bad.sum())
                    if bad.any() and first is None:
                        j = int(np.argmax(bad))
                        first = Check("replay", FAIL, f"shard {shard} row {r['row']} (id {r['id']!r}) {side} token "
                                      f"{j}: cached {old[j]:.6f}, replayed {new[j]:.6f}, |diff| {diff[j]:.1e}",
                                      shard, r["row"])
    tokens = np.concatenate(token_diffs) if token_diffs else np.zeros(0)
    seqs = np.asarray(seq_diffs) if seq_diffs else np.zeros(0)
    stat = lambda a, f: float(f(a)) if a.size else 0.0  # noqa: E731
    info = {"rows": count, "tokens": int(tokens.size), "dtype": dtype, "device": str(device),
            "recorded_device_type": comp.get("device_type"), "tolerance": tol, "seed": seed,
            "sampled": index[picks]["id"].to_list(),
            "token_max_abs_diff": stat(tokens, np.max), "token_mean_abs_diff": stat(tokens, np.mean),
            "sequence_max_abs_diff": stat(seqs, np.max), "sequence_mean_abs_diff": stat(seqs, np.mean),
            "tokens_beyond_tolerance": beyond, "sequences_not_comparable": uncomparable,
            "seconds": round(time.perf_counter() - t0, 3)}
    summary = (f"{count:,} rows ({tokens.size:,} tokens) in {dtype} on {device}: per token max "
               f"{info['token_max_abs_diff']:.1e} mean {info['token_mean_abs_diff']:.1e}, per sequence max "
               f"{info['sequence_max_abs_diff']:.1e} mean {info['sequence_mean_abs_diff']:.1e}; tolerance {tol:.0e}")
    if first:
        first.detail = f"{beyond:,} token(s) beyond tolerance; first: {first.detail}; {summary}"
        first.info = info
        return first
    return Check("replay", PASS, summary, info=info)
