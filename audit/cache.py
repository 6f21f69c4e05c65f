"""audit-ref's scan of a cache against itself: every rule of schemas/rules.py over every shard and row, each
corruption reported once, by the rule that owns it. A shard that fails `shard_files` is left out of the row checks
(its content may not even parse) and the cache checksum waits for every shard checksum."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from schemas import format as fmt
from schemas import rules
from schemas.encoding import EncodingConfig

from .checks import FAIL, PASS, SKIP, Check, from_findings

INDEX_SCHEMA = {"id": pl.String, "shard": pl.String, "row": pl.UInt32, "mask_checksum": pl.String,
                "prompt_tokens": pl.UInt32, "chosen_tokens": pl.UInt32, "rejected_tokens": pl.UInt32}
WHAT = {
    "shard_files": ("shard", "sizes, sha256, schema and row counts match the manifest"),
    "shard_stamps": ("shard", "metadata stamps, encoding, computation and file format match the manifest"),
    "shard_checksums": ("shard", "the rows' mask checksums and ids add up to each shard's"),
    "row_checksums": ("row", "mask checksums recomputed from the stored ids match"),
    "unique_ids": ("row", "ids unique across shards"),
    **{n: ("row", w) for n, w in rules.VALUE_WHAT.items()},
    **{n: ("row", w) for n, w in rules.TOP_K_RULES.items()},
}
NO_TOP_K = "no top-k columns (a cache made without precompute-ref --top-k)"


@dataclass
class CacheScan:
    checks: list[Check]
    index: pl.DataFrame  # one row per cached row of the verified shards: id, shard, row, mask_checksum, lengths
    logprob_stats: list[dict]
    unverified: int  # shards that failed shard_files


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


def _shard(root: Path, manifest: dict, entry: dict, found: dict, checked: dict) -> pl.DataFrame | None:
    """One listed shard through every rule; its rows as a frame, or None when it failed shard_files."""
    checked["shard_files"] += 1
    path, problems = rules.shard_file_findings(root, entry)
    meta = {}  # the footer, once the file passed (its computation's top_k says whether there are top-k columns)
    if not problems:
        want = rules.expected_footer(manifest["stamps"], EncodingConfig.from_dict(manifest["encoding"]), entry,
                                     manifest.get("computation"))
        meta, problems = rules.shard_footer_findings(path, want, entry["rows"])
    files = [f for f in problems if f.rule == "shard_files"]
    if not files:
        try:
            table = fmt.read_columns(path).replace_schema_metadata(None)
        except fmt.CacheError as e:
            files = [rules.Finding("shard_files", e.kind, e.message, shard=entry["file"])]
    found["shard_files"] += files
    if files:
        return None
    checked["shard_stamps"] += 1
    found["shard_stamps"] += problems[:1]  # one per shard: the first key that differs
    name = entry["file"]
    df = pl.from_arrow(table).with_row_index("row").with_columns(pl.lit(name).alias("shard"))
    checked["shard_checksums"] += 1
    found["shard_checksums"] += rules.shard_checksum_findings(name, entry, df["mask_checksum"].to_list(),
                                                              df["id"].to_list(), EncodingConfig.from_dict(
                                                                  manifest["encoding"]).to_json())[:1]
    for rule_findings in (rules.row_checksum_findings(df, name), rules.value_findings(df, name)):
        for f in rule_findings:
            found[f.rule].append(f)
    for rule in ("row_checksums", *rules.VALUE_RULES):
        checked[rule] += df.height
    k = fmt.top_k_of(rules.footer_computation(meta))
    if k:
        for f in rules.top_k_findings(df, k, _vocabulary(manifest), name):
            found[f.rule].append(f)
        for rule in rules.TOP_K_RULES:
            checked[rule] += df.height
    return df


def _vocabulary(manifest: dict) -> int | None:
    """The bound of a top-k id: the tokenizer's size as the manifest records it (None when it records none)."""
    size = (manifest.get("tokenizer") or {}).get("size") if isinstance(manifest.get("tokenizer"), dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def audit_cache(root: Path, manifest: dict, current: bool = True) -> CacheScan:
    """`current`: False when `manifest` is an earlier version of an updated cache (schemas/history.py), whose
    skipped.jsonl and dataset card are the current version's, not its own: those two checks are skipped."""
    found, checked = defaultdict(list), defaultdict(int)
    frames, stats, ids_by_shard = [], [], []
    for entry in manifest["shards"]:
        df = _shard(root, manifest, entry, found, checked)
        if df is None:
            continue
        frames.append(df)
        ids_by_shard.append((entry["file"], df["id"].to_list()))
        stats.append(_logprob_stats(df, entry["file"]))
    unlisted = rules.unlisted_findings(root, [e["file"] for e in manifest["shards"]])
    found["shard_files"] += unlisted
    checked["shard_files"] += sum(f.count for f in unlisted)
    unverified = len(manifest["shards"]) - len(frames)
    manifest_problems = rules.manifest_findings(manifest)
    checks = [Check("manifest", FAIL, "; ".join(f.message for f in manifest_problems)) if manifest_problems else
              Check("manifest", PASS, f"refcache file format {manifest['format_version']}, "
                    f"{len(manifest['shards'])} "
                    f"shard(s), {sum(e['rows'] for e in manifest['shards']):,} rows")]
    result = lambda n: from_findings(n, found[n], checked[n], *WHAT[n], unchecked_shards=unverified)
    checks += [result("shard_files"), result("shard_stamps"), result("row_checksums"), result("shard_checksums")]
    if unverified or found["shard_checksums"]:
        checks.append(Check("cache_checksum", SKIP, "needs every shard to pass shard_files and shard_checksums"))
    else:
        every = [c for df in frames for c in df["mask_checksum"].to_list()]
        bad = rules.cache_checksum_findings(every, manifest)
        checks.append(Check("cache_checksum", FAIL, bad[0].message) if bad else
                      Check("cache_checksum", PASS, "the shards' rows add up to the manifest's mask_checksum stamp"))
    found["unique_ids"] = rules.unique_id_findings(ids_by_shard)
    checked["unique_ids"] = sum(len(ids) for _, ids in ids_by_shard)
    checks += [result(n) for n in ("unique_ids", *rules.VALUE_RULES)]
    with_top_k = any(checked[n] for n in rules.TOP_K_RULES) or fmt.top_k_of(manifest.get("computation"))
    checks += [result(n) if with_top_k else Check(n, SKIP, NO_TOP_K) for n in rules.TOP_K_RULES]
    if current:
        listed, skipped = rules.skipped_findings(root, manifest)
        checks.append(Check("skipped_counts", FAIL, skipped[0].message) if skipped else Check(
            "skipped_counts", PASS, f"{listed} skipped row(s), {(manifest.get('source') or {}).get('rows_in')} rows "
            f"in = {manifest.get('rows')} cached + {listed} skipped"))
        checks.append(_card(root, manifest, failed=[c.name for c in checks if c.status == FAIL]))
    else:
        later = "of the cache's current version (manifest.json), not of the earlier version audited here"
        checks += [Check("skipped_counts", SKIP, f"{fmt.SKIPPED} is {later}"), Check("card", SKIP,
                                                                                      f"{fmt.CARD} is {later}")]
    index = pl.concat([_index(df) for df in frames]) if frames else pl.DataFrame(schema=INDEX_SCHEMA)
    return CacheScan(checks, index, stats, unverified)


def _card(root: Path, manifest: dict, failed: list[str]) -> Check:
    """The dataset card against the manifest, once the cache itself passed: a damaged or edited manifest is reported
    by its own check, not again as a card that disagrees with it."""
    present, found = rules.card_findings(root, manifest)
    if present and failed:
        return Check("card", SKIP, f"compared with the manifest once the cache passes (failed: {', '.join(failed)})")
    if found:
        f = found[0]
        detail = f.message + (f" (expected {f.expected}, found {f.found})" if f.expected is not None else "")
        return Check("card", FAIL, f"{detail}; {f.remedy}")
    if not present:
        return Check("card", SKIP, f"no dataset card ({fmt.CARD}): a cache made before precompute-ref wrote cards")
    return Check("card", PASS, f"{fmt.CARD}'s metadata (the shards it names, stamps, encoding, computation, counts) "
                 "agrees with the manifest")


def _index(df: pl.DataFrame) -> pl.DataFrame:
    return df.select("id", "shard", "row", "mask_checksum",
                     pl.col("prompt_input_ids").list.len().alias("prompt_tokens"),
                     pl.col("chosen_input_ids").list.len().alias("chosen_tokens"),
                     pl.col("rejected_input_ids").list.len().alias("rejected_tokens")).cast(INDEX_SCHEMA)


def shard_rows(path: Path, rows: pl.Series) -> list[dict]:
    """The given rows of one shard, in shard order, each with its index in the shard as "row"."""
    table = pl.from_arrow(fmt.read_columns(path).replace_schema_metadata(None))
    return table.with_row_index("row").filter(pl.col("row").is_in(rows.implode())).to_dicts()
