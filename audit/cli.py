"""audit-ref: check a reference cache end to end, without training, and report what is in it.

Without extras the cache is checked against itself: manifest, every shard file (size, sha256, schema), each shard's
metadata stamps, every row's mask checksum recomputed from its stored ids, the shard and cache checksums, unique ids,
one log-prob per completion token, sums, value ranges and skipped-row counts. `--model` compares the model and
tokenizer hashes with a checkpoint and replays the reference on a sample of rows; `--data` re-encodes the data and
compares every row; `--run` checks that a train-dpo output names this cache and holds the weights it recorded.

Every check is a named result (PASS, FAIL or SKIP) and all of them run. A check whose input is already known to be
wrong is not run on it: a shard that fails `shard_files` is left out of the row checks (its content may not even
parse), the cache checksum waits for the shard checksums, the replay for the model hash and the data comparison for
the tokenizer hash. So each corruption is reported once, by the check that owns it.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import numpy as np
import polars as pl
import pyarrow as pa

from schemas import format as fmt
from schemas.encoding import EncodingConfig, row_mask_checksum
from schemas.stamps import WeightsError, combined_mask_checksum, file_sha256, model_hash, tokenizer_hash

from runtime.cli import quiet_libraries, run_cli

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
EXIT_OK, EXIT_CHECK_FAILED = 0, 1
SECTIONS = {
    "cache": ("manifest", "shard_files", "shard_stamps", "row_checksums", "shard_checksums", "cache_checksum",
              "unique_ids", "list_lengths", "sums", "logprob_values", "skipped_counts"),
    "model": ("model_hash", "tokenizer_hash", "replay"),
    "data": ("data_rows",),
    "run": ("run_cache", "run_final_hash"),
}
DEFAULT_SAMPLE = 100
SUM_TOLERANCE = 1e-6  # stored float64 sums vs the sum of the stored float32 values
RUN_MANIFEST = "run-manifest.json"


def default_tolerance(dtype: str, recorded_device: str | None, local_device: str) -> float:
    """Per-token replay tolerance: what the recorded dtype allows, wider when replaying on another device type."""
    base = 1e-4 if dtype == "float32" else 5e-2
    if recorded_device and recorded_device != local_device:
        base *= 10 if dtype == "float32" else 2
    return base


@dataclass
class Check:
    name: str
    status: str
    detail: str
    shard: str | None = None
    row: int | None = None  # row index inside `shard`
    info: dict = field(default_factory=dict)


class Tally:
    """One check accumulated over shards or rows: how many were checked, how many failed, and the first failure."""

    def __init__(self, name: str, unit: str, what: str):
        self.name, self.unit, self.what = name, unit, what
        self.checked = self.failed = 0
        self.first: tuple | None = None  # (shard, row, detail)

    def see(self, checked: int, failed: int = 0, shard=None, row=None, detail=None) -> None:
        self.checked += checked
        self.failed += failed
        if failed and self.first is None:
            self.first = (shard, row, detail)

    def result(self, unchecked_shards: int = 0) -> Check:
        units = lambda n: f"{n:,} {self.unit}{'s' if n != 1 else ''}"  # noqa: E731
        if self.failed:
            shard, row, detail = self.first
            return Check(self.name, FAIL, f"{self.failed:,} of {units(self.checked)}: {detail}", shard, row)
        if not self.checked:
            return Check(self.name, SKIP, "nothing to check: no shard passed shard_files")
        note = f"; {unchecked_shards} shard(s) not checked (failed shard_files)" if unchecked_shards else ""
        return Check(self.name, PASS, f"{units(self.checked)}: {self.what}{note}")


# ---------------------------------------------------------------------------------------------------------------
# the cache against itself


def _short(h) -> str:
    return f"{h[:12]}…" if isinstance(h, str) and len(h) > 12 else repr(h)


def _sum64(column: str) -> pl.Expr:
    return pl.col(column).list.eval(pl.element().cast(pl.Float64)).list.sum()


def _valid(column: str) -> pl.Expr:
    return pl.col(column).list.eval((pl.element().is_finite() & (pl.element() <= 0)).fill_null(False)).list.all()


def _close(a: str, b: str) -> pl.Expr:
    return (pl.col(a) == pl.col(b)) | ((pl.col(a) - pl.col(b)).abs() <= SUM_TOLERANCE)  # == also matches NaN, inf


def _load_shard(root: Path, entry: dict) -> tuple[Path | None, pa.Table | None, str | None]:
    """(path, table, None) for a shard whose file matches its manifest entry, else (path, None, problem)."""
    try:
        path = fmt._shard_path(root, entry["file"])
    except fmt.CacheError as e:
        return None, None, e.message
    if not path.is_file():
        return path, None, "listed in the manifest but missing"
    if path.stat().st_size != entry["bytes"]:
        return path, None, f"size {path.stat().st_size:,} bytes, manifest says {entry['bytes']:,}"
    digest = file_sha256(path)
    if digest != entry["sha256"]:
        return path, None, f"sha256 {_short(digest)} differs from the manifest's {_short(entry['sha256'])}"
    try:
        table = fmt.read_columns(path).replace_schema_metadata(None)  # metadata was checked by shard_stamps
    except fmt.CacheError as e:
        return path, None, e.message
    if not table.schema.equals(fmt.SHARD_SCHEMA, check_metadata=False):
        return path, None, "columns differ from the shard schema (see schemas/FORMAT.md)"
    if table.num_rows != entry["rows"]:
        return path, None, f"{table.num_rows} rows, manifest says {entry['rows']}"
    return path, table, None


def _row_frame(table: pa.Table, shard: str) -> pl.DataFrame:
    df = pl.from_arrow(table).with_row_index("row").with_columns(
        pl.lit(shard).alias("shard"),
        pl.col("prompt_input_ids").list.len().alias("prompt_tokens"),
        pl.col("chosen_input_ids").list.len().alias("chosen_tokens"),
        pl.col("rejected_input_ids").list.len().alias("rejected_tokens"),
        pl.col("chosen_logps").list.len().alias("chosen_values"),
        pl.col("rejected_logps").list.len().alias("rejected_values"),
        _sum64("chosen_logps").alias("chosen_sum"),
        _sum64("rejected_logps").alias("rejected_sum"),
        (_valid("chosen_logps") & _valid("rejected_logps")).alias("values_ok"),
    )
    ids = zip(df["prompt_input_ids"].to_list(), df["chosen_input_ids"].to_list(), df["rejected_input_ids"].to_list())
    return df.with_columns(
        pl.Series("recomputed", [row_mask_checksum(p, c, r) for p, c, r in ids], pl.String),
        ((pl.col("chosen_values") == pl.col("chosen_tokens"))
         & (pl.col("rejected_values") == pl.col("rejected_tokens"))).alias("lengths_ok"),
    )


def _bad_value(r: dict) -> str:
    for side in ("chosen", "rejected"):
        for i, v in enumerate(r[f"{side}_logps"]):
            if v is None or not np.isfinite(v) or v > 0:
                return f"{side}_logps[{i}] = {v}"
    return "?"


ROW_CHECKS = {  # name: (what passes, failing-row filter, description of a failing row)
    "row_checksums": ("mask checksums recomputed from the stored ids match",
                      pl.col("recomputed") != pl.col("mask_checksum"),
                      lambda r: f"stored {_short(r['mask_checksum'])}, recomputed from its ids "
                                f"{_short(r['recomputed'])}"),
    "list_lengths": ("one log-prob per completion token", ~pl.col("lengths_ok"),
                     lambda r: f"chosen {r['chosen_tokens']} tokens / {r['chosen_values']} log-probs, rejected "
                               f"{r['rejected_tokens']} / {r['rejected_values']}"),
    "sums": ("chosen_logp and rejected_logp equal the sums of the per-token values",
             ~(_close("chosen_sum", "chosen_logp") & _close("rejected_sum", "rejected_logp")),
             lambda r: f"chosen_logp {r['chosen_logp']:.6f} vs sum {r['chosen_sum']:.6f}, rejected_logp "
                       f"{r['rejected_logp']:.6f} vs sum {r['rejected_sum']:.6f}"),
    "logprob_values": ("every log-prob finite and <= 0", ~pl.col("values_ok"), _bad_value),
}


def _logprob_stats(df: pl.DataFrame, shard: str) -> dict:
    values = df.select(pl.col("chosen_logps").explode().append(pl.col("rejected_logps").explode()).alias("v"))
    values = values.drop_nulls().filter(pl.col("v").is_finite())
    stats = values.select(
        tokens=pl.len(), mean=pl.col("v").mean(), p5=pl.col("v").quantile(0.05), p50=pl.col("v").median(),
        p95=pl.col("v").quantile(0.95), min=pl.col("v").min(), max=pl.col("v").max(),
    ).row(0, named=True)
    sequences = df.select(
        mean_chosen_logp=pl.col("chosen_logp").mean(), mean_rejected_logp=pl.col("rejected_logp").mean(),
        chosen_higher=(pl.col("chosen_logp") > pl.col("rejected_logp")).mean(),
    ).row(0, named=True)
    return {"shard": shard, "rows": df.height, **stats, **sequences}


@dataclass
class CacheScan:
    checks: list[Check]
    index: pl.DataFrame  # one row per cached row of the verified shards: id, shard, row, mask_checksum, lengths
    logprob_stats: list[dict]
    unverified: int  # shards that failed shard_files


INDEX_SCHEMA = {"id": pl.String, "shard": pl.String, "row": pl.UInt32, "mask_checksum": pl.String,
                "prompt_tokens": pl.UInt32, "chosen_tokens": pl.UInt32, "rejected_tokens": pl.UInt32,
                "lengths_ok": pl.Boolean}


def audit_cache(root: Path, manifest: dict) -> CacheScan:
    entries = manifest["shards"]
    enc_json = EncodingConfig.from_dict(manifest["encoding"]).to_json()
    names = [e["file"] if isinstance(e["file"], str) else repr(e["file"]) for e in entries]
    problems = []
    if len(set(names)) != len(names):
        problems.append("a shard is listed twice")
    listed_rows = sum(e["rows"] for e in entries if isinstance(e["rows"], int))
    if manifest.get("rows") != listed_rows:
        problems.append(f"rows is {manifest.get('rows')} but the shards hold {listed_rows}")
    checks = [Check("manifest", FAIL if problems else PASS, "; ".join(problems) or
                    f"format version {manifest['format_version']}, {len(entries)} shard(s), {listed_rows:,} rows")]

    files = Tally("shard_files", "shard", "sizes, sha256, schema and row counts match the manifest")
    stamps = Tally("shard_stamps", "shard", "metadata stamps, encoding and format version match the manifest")
    sums = Tally("shard_checksums", "shard", "the rows' mask checksums add up to each shard's")
    rows = {name: Tally(name, "row", what) for name, (what, _, _) in ROW_CHECKS.items()}
    frames, stats, shard_row_checks = [], [], []
    for entry in entries:
        name = entry["file"]
        path, table, problem = _load_shard(root, entry)
        files.see(1, problem is not None, name, None, f"{name}: {problem}")
        if problem:
            continue
        expected = {**manifest["stamps"], "format_version": str(fmt.FORMAT_VERSION), "encoding": enc_json,
                    "mask_checksum": entry["mask_checksum"]}
        meta = fmt.read_shard_metadata(path)
        wrong = [k for k, v in expected.items() if meta.get(k) != v]
        if wrong:
            stamps.see(1, 1, name, None, f"{name}: metadata {', '.join(wrong)} differ(s) from the manifest "
                       f"({wrong[0]} {_short(meta.get(wrong[0]))}, manifest {_short(expected[wrong[0]])})")
        else:
            stamps.see(1)
        df = _row_frame(table, name)
        try:
            got = combined_mask_checksum(df["mask_checksum"].to_list(), enc_json)
        except (ValueError, TypeError):
            got = None
        sums.see(1, got != entry["mask_checksum"], name, None,
                 f"{name}: rows add up to {_short(got)}, manifest says {_short(entry['mask_checksum'])}")
        shard_row_checks.append(df["mask_checksum"].to_list())
        for check_name, (_, bad_filter, describe) in ROW_CHECKS.items():
            bad = df.filter(bad_filter)
            first = bad.row(0, named=True) if bad.height else None
            rows[check_name].see(df.height, bad.height, name, first and first["row"],
                                 first and f"shard {name} row {first['row']} (id {first['id']!r}): {describe(first)}")
        frames.append(df.select(list(INDEX_SCHEMA)))
        stats.append(_logprob_stats(df, name))

    unlisted = sorted(p.name for p in root.glob("*.parquet") if p.name not in set(names))
    if unlisted:
        files.see(len(unlisted), len(unlisted), unlisted[0], None,
                  f"shard file(s) not listed in the manifest: {', '.join(unlisted[:5])}")
    unverified = len(entries) - len(frames)
    index = pl.concat(frames) if frames else pl.DataFrame(schema=INDEX_SCHEMA)
    checks += [files.result(), stamps.result(unverified), rows["row_checksums"].result(unverified),
               sums.result(unverified)]

    if unverified or sums.failed:
        checks.append(Check("cache_checksum", SKIP, "needs every shard to pass shard_files and shard_checksums"))
    else:
        total = combined_mask_checksum([c for shard in shard_row_checks for c in shard], enc_json)
        ok = total == manifest["stamps"]["mask_checksum"]
        detail = ("the shards' rows add up to the manifest's mask_checksum stamp" if ok else
                  f"the shards' rows add up to {_short(total)}, the manifest's stamp is "
                  f"{_short(manifest['stamps']['mask_checksum'])}")
        checks.append(Check("cache_checksum", PASS if ok else FAIL, detail))
    checks.append(_unique_ids(index, unverified))
    checks += [rows[n].result(unverified) for n in ("list_lengths", "sums", "logprob_values")]
    checks.append(_skipped_counts(root, manifest))
    return CacheScan(checks, index, stats, unverified)


def _unique_ids(index: pl.DataFrame, unverified: int) -> Check:
    tally = Tally("unique_ids", "row", "ids unique across shards")
    dups = index.with_columns(pl.int_range(pl.len()).over("id").alias("seen")).filter(pl.col("seen") > 0)
    if dups.height:
        d = dups.row(0, named=True)
        first = index.filter(pl.col("id") == d["id"]).row(0, named=True)
        tally.see(index.height, dups.height, d["shard"], d["row"], f"id {d['id']!r} at shard {d['shard']} row "
                  f"{d['row']} already appears at shard {first['shard']} row {first['row']}")
    else:
        tally.see(index.height)
    return tally.result(unverified)


def _skipped_counts(root: Path, manifest: dict) -> Check:
    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    counts = [source.get("skipped", 0), source.get("rows_in"), manifest.get("rows", 0)]
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        return Check("skipped_counts", FAIL, f"manifest counts are not integers: source.skipped={counts[0]!r}, "
                                             f"source.rows_in={counts[1]!r}, rows={counts[2]!r}")
    path = root / fmt.SKIPPED
    try:
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
            if path.exists() else []
    except ValueError as e:
        return Check("skipped_counts", FAIL, f"{fmt.SKIPPED} is not JSON Lines ({e})")
    problems = []
    if source.get("skipped") != len(lines):
        problems.append(f"manifest source.skipped is {source.get('skipped')}, {fmt.SKIPPED} lists {len(lines)}")
    reasons = dict(Counter(s.get("reason") for s in lines if isinstance(s, dict)))
    if (source.get("skipped_by_reason") or {}) != reasons:
        problems.append(f"skipped_by_reason {source.get('skipped_by_reason')} vs {fmt.SKIPPED} {reasons}")
    if source.get("rows_in") != manifest.get("rows", 0) + (source.get("skipped") or 0):
        problems.append(f"rows_in {source.get('rows_in')} != rows {manifest.get('rows')} + skipped "
                        f"{source.get('skipped')}")
    return Check("skipped_counts", FAIL if problems else PASS, "; ".join(problems) or
                 f"{len(lines)} skipped row(s), {source.get('rows_in')} rows in = {manifest.get('rows')} cached + "
                 f"{len(lines)} skipped")


# ---------------------------------------------------------------------------------------------------------------
# --model: hashes and replay


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


# ---------------------------------------------------------------------------------------------------------------
# --data and --run


def audit_data(manifest: dict, scan: CacheScan, data: str, tokenizer) -> Check:
    """Re-encode the data with the recorded encoding and compare every row's mask checksum with the cached one."""
    from runtime.data import encode_rows, load_rows

    source = load_rows(data, (manifest.get("source") or {}).get("split", "train"))
    encoded = encode_rows(source, tokenizer, EncodingConfig.from_dict(manifest["encoding"]), on_bad_row="skip")
    now = pl.DataFrame({"id": encoded.ids, "now": [p.mask_checksum for p in encoded.pairs]},
                       schema={"id": pl.String, "now": pl.String})
    joined = scan.index.select("id", "shard", "row", "mask_checksum").join(now, on="id", how="full", coalesce=True)
    added = joined.filter(pl.col("mask_checksum").is_null())
    removed = joined.filter(pl.col("now").is_null())
    changed = joined.filter(pl.col("mask_checksum").is_not_null() & pl.col("now").is_not_null()
                            & (pl.col("mask_checksum") != pl.col("now")))
    skipped_now = {s["id"]: s["reason"] for s in encoded.skipped}
    info = {"rows_encoded": len(encoded.ids), "rows_skipped": len(encoded.skipped),
            "fingerprint_matches": source.fingerprint == (manifest.get("source") or {}).get("fingerprint"),
            "added": added["id"].to_list(), "removed": removed["id"].to_list(), "changed": changed["id"].to_list(),
            "removed_now_skipped": {i: skipped_now[i] for i in removed["id"].to_list() if i in skipped_now}}
    if not (added.height or removed.height or changed.height):
        return Check("data_rows", PASS, f"{len(encoded.ids):,} rows re-encoded with the cache's encoding: all match "
                     f"({len(encoded.skipped)} skipped as at precompute)", info=info)
    listing = "; ".join(f"{kind} {len(ids)}: {', '.join(map(repr, ids[:5]))}{' …' if len(ids) > 5 else ''}"
                        for kind, ids in (("changed", info["changed"]), ("removed", info["removed"]),
                                          ("added", info["added"])) if ids)
    where = (changed if changed.height else removed).row(0, named=True) if changed.height or removed.height else {}
    return Check("data_rows", FAIL, f"the data differs from the cached rows: {listing}", where.get("shard"),
                 where.get("row"), info)


def audit_run(root: Path, manifest: dict, run_dir: str) -> list[Check]:
    path = Path(run_dir) / RUN_MANIFEST
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
        cache = (run.get("reference") or {}).get("cache")
    except (OSError, ValueError, AttributeError) as e:
        raise click.BadParameter(f"{path} is missing or not a train-dpo run manifest ({e})", param_hint="--run")
    if not cache:
        checks = [Check("run_cache", FAIL, f"{run_dir} was trained against a live reference, not a cache")]
    else:
        problems = []
        sha = file_sha256(root / fmt.MANIFEST)
        if cache.get("manifest_sha256") != sha:
            problems.append(f"it names a cache manifest with sha256 {_short(cache.get('manifest_sha256'))}, this "
                            f"cache's is {_short(sha)}")
        recorded = cache.get("stamps") or {}
        wrong = [k for k in fmt.STAMPS if recorded.get(k) != manifest["stamps"][k]]
        if wrong:
            problems.append(f"its stamps {', '.join(wrong)} differ from this cache's")
        detail = "; ".join(problems) or f"trained on this cache (manifest sha256 {_short(sha)} and stamps match)"
        checks = [Check("run_cache", FAIL if problems else PASS, f"{run_dir}: {detail}")]
    recorded = run.get("final_model_hash")
    try:
        final = model_hash(run_dir)
    except (WeightsError, OSError, ValueError) as e:
        checks.append(Check("run_final_hash", FAIL, f"the checkpoint in {run_dir} cannot be hashed: {e}"))
        return checks
    if final == recorded:
        checks.append(Check("run_final_hash", PASS, f"the checkpoint in {run_dir} matches final_model_hash "
                            f"{_short(final)}"))
    else:
        checks.append(Check("run_final_hash", FAIL, f"the checkpoint in {run_dir} hashes to {_short(final)}, the run "
                            f"recorded {_short(recorded)}"))
    return checks


# ---------------------------------------------------------------------------------------------------------------
# statistics, the whole audit, and the report


def token_stats(index: pl.DataFrame) -> list[dict]:
    lengths = index.select("prompt_tokens", "chosen_tokens", "rejected_tokens").cast(pl.Int64)
    long = pl.concat([
        lengths.unpivot(variable_name="part", value_name="n"),
        lengths.select("chosen_tokens", "rejected_tokens").unpivot(value_name="n").select(
            pl.lit("completion_tokens").alias("part"), "n"),
    ])
    return long.group_by("part", maintain_order=True).agg(
        total=pl.col("n").sum(), mean=pl.col("n").mean().round(2),
        p50=pl.col("n").quantile(0.5, "nearest").cast(pl.Int64),
        p95=pl.col("n").quantile(0.95, "nearest").cast(pl.Int64), max=pl.col("n").max(),
    ).with_columns(pl.col("part").str.strip_suffix("_tokens")).to_dicts()


def run_audit(cache_dir, *, model=None, data=None, run=None, sample=DEFAULT_SAMPLE, seed=0, tolerance=None,
              trust_remote_code=False) -> dict:
    """The whole audit as a JSON-ready report. A missing or unreadable manifest raises CacheError."""
    t0 = time.perf_counter()
    root = Path(cache_dir)
    manifest = fmt.read_manifest(root)
    timing = {}
    scan = audit_cache(root, manifest)
    checks = list(scan.checks)
    timing["cache_s"] = time.perf_counter() - t0
    tokenizer, tokenizer_ok = None, False
    if model:
        t = time.perf_counter()
        more, tokenizer, tokenizer_ok = audit_model(root, manifest, scan, model, sample=sample, seed=seed,
                                                    tolerance=tolerance, trust_remote_code=trust_remote_code)
        checks += more
        timing["model_s"] = time.perf_counter() - t
    else:
        checks += [Check(n, SKIP, "not requested (--model)") for n in SECTIONS["model"]]
    if not data:
        checks.append(Check("data_rows", SKIP, "not requested (--data)"))
    elif not tokenizer_ok:
        checks.append(Check("data_rows", SKIP, "needs the tokenizer the cache was made with (tokenizer_hash)"))
    elif scan.unverified:
        checks.append(Check("data_rows", SKIP, "needs every shard to pass shard_files"))
    else:
        t = time.perf_counter()
        checks.append(audit_data(manifest, scan, data, tokenizer))
        timing["data_s"] = time.perf_counter() - t
    if run:
        t = time.perf_counter()
        checks += audit_run(root, manifest, run)
        timing["run_s"] = time.perf_counter() - t
    else:
        checks += [Check(n, SKIP, "not requested (--run)") for n in SECTIONS["run"]]
    failed = [c.name for c in checks if c.status == FAIL]
    timing["total_s"] = time.perf_counter() - t0
    return {
        "cache": str(root.resolve()),
        "result": FAIL if failed else PASS,
        "failed": failed,
        "checks": [asdict(c) for c in checks],
        "stats": {"rows": scan.index.height, "bytes": sum(e["bytes"] for e in manifest["shards"]),
                  "tokens": token_stats(scan.index), "logprobs_per_shard": scan.logprob_stats},
        "made": {k: manifest.get(k) for k in ("created_at", "software", "model", "tokenizer", "computation", "source")}
        | {"encoding": manifest["encoding"], "stamps": manifest["stamps"]},
        "options": {"model": model, "data": data, "run": run, "sample": sample, "seed": seed, "tolerance": tolerance},
        "timing": {k: round(v, 3) for k, v in timing.items()},
    }


def _jsonable(v):
    """Strict JSON: NaN and infinities (a damaged cache's values) become strings."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "" if v is None else str(v)


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[_cell(v) for v in r] for r in rows]
    numeric = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    right = [bool(rows) and all(numeric(r[i]) for r in rows) for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values):
        return "  " + "  ".join(v.rjust(w) if a else v.ljust(w) for v, w, a in zip(values, widths, right)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def render(report: dict) -> str:
    made = report["made"]
    sw = made.get("software") or {}
    comp = made.get("computation") or {}
    src = made.get("source") or {}
    out = [f"audit-ref {report['cache']}",
           f"  made {made.get('created_at')} by refcache {sw.get('refcache')} (" +
           ", ".join(f"{k} {v}" for k, v in sw.items() if k != "refcache") + ")",
           f"  reference {(made.get('model') or {}).get('name')} in {comp.get('dtype')} on {comp.get('device_type')} "
           f"({comp.get('attn_implementation')} attention, {comp.get('mode')} batching); data {src.get('data')} split "
           f"{src.get('split')}; "
           f"{report['stats']['rows']:,} rows, {report['stats']['bytes'] / 2**20:.2f} MiB", ""]
    by_name = {c["name"]: c for c in report["checks"]}
    titles = {"cache": "Cache integrity", "model": "Reference model (--model)", "data": "Data (--data)",
              "run": "Training run (--run)"}
    for section, names in SECTIONS.items():
        rows = []
        for n in names:
            c = by_name[n]
            where = " ".join(x for x in (c["shard"], None if c["row"] is None else f"row {c['row']}") if x)
            rows.append([n, c["status"], where, c["detail"]])
        out += [titles[section], table(["check", "status", "where", "detail"], rows), ""]
    tok = report["stats"]["tokens"]
    out += ["Tokens", table(["tokens", "total", "mean", "p50", "p95", "max"],
                            [[t["part"], t["total"], t["mean"], t["p50"], t["p95"], t["max"]] for t in tok]), ""]
    lp = report["stats"]["logprobs_per_shard"]
    out += ["Log-probs per shard (per token; mean sequence sums; share of pairs the reference prefers chosen)",
            table(["shard", "rows", "tokens", "mean", "p5", "p50", "p95", "min", "max", "chosen_logp", "rejected_logp",
                   "chosen_higher"],
                  [[s["shard"], s["rows"], s["tokens"], s["mean"], s["p5"], s["p50"], s["p95"], s["min"], s["max"],
                    s["mean_chosen_logp"], s["mean_rejected_logp"], s["chosen_higher"]] for s in lp]), ""]
    counts = Counter(c["status"] for c in report["checks"])
    verdict = f"FAIL: {', '.join(report['failed'])}" if report["failed"] else "PASS"
    out.append(f"{verdict} ({counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped) in "
               f"{report['timing']['total_s']:.2f} s")
    return "\n".join(out)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.option("--model", type=click.Path(exists=True, file_okay=False),
              help="Reference checkpoint: compare model and tokenizer hashes, and replay the reference on a sample.")
@click.option("--data", type=click.Path(exists=True),
              help="Preference data: re-encode every row (needs --model for the tokenizer) and compare.")
@click.option("--run", "run_dir", type=click.Path(exists=True, file_okay=False),
              help="A train-dpo --output-dir: check that its run-manifest.json names this cache and its weights.")
@click.option("--sample", type=click.IntRange(min=0), default=None,
              help=f"Rows to replay with --model, drawn at random (0: no replay). [default: {DEFAULT_SAMPLE}]")
@click.option("--all", "replay_all", is_flag=True, help="Replay every row.")
@click.option("--seed", default=0, help="Seed of the replay sample.")
@click.option("--tolerance", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Per-token replay tolerance. [default: 1e-4 for float32, 5e-2 for bfloat16/float16, wider when "
                   "the recorded device type differs]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report as JSON here.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom model code from the checkpoint folder.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(cache, model, data, run_dir, sample, replay_all, seed, tolerance, json_path, trust_remote_code, debug):
    """Audit a precompute-ref cache: integrity, stamps, values, and optionally the model (replay), data and a
    training run that used it. Exit 0 when every check passes, 1 when any fails, 2 on a usage error or an
    unreadable cache."""
    if replay_all and sample is not None:
        raise click.UsageError("give --sample N or --all, not both")
    if data and not model:
        raise click.UsageError("--data needs --model: the rows are re-encoded with the cache's tokenizer")

    if json_path and not Path(json_path).resolve().parent.is_dir():
        raise click.UsageError(f"--json {json_path}: its folder does not exist")

    def body():
        if model or data:
            quiet_libraries()
        report = run_audit(cache, model=model, data=data, run=run_dir, sample=None if replay_all else
                           (DEFAULT_SAMPLE if sample is None else sample), seed=seed, tolerance=tolerance,
                           trust_remote_code=trust_remote_code)
        click.echo(render(report))
        if json_path:
            Path(json_path).write_text(json.dumps(_jsonable(report), indent=2) + "\n", encoding="utf-8")
        sys.exit(EXIT_CHECK_FAILED if report["failed"] else EXIT_OK)

    run_cli(body, debug)


if __name__ == "__main__":
    main()
