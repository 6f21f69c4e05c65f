"""audit-ref's scan of a cache against itself: the rule registry's collect-all walk (schemas/rules.py `collect`) over
every shard and row, each corruption reported once, by the rule that owns it, one check per rule in the registry's
order. A shard that fails `shard_files` is left out of the row checks (its content may not even parse) and a rule
waits for what it needs (the cache checksum for every shard checksum)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from schemas import format as fmt
from schemas import rules

from .checks import FAIL, PASS, SKIP, Check, from_findings

INDEX_SCHEMA = {"id": pl.String, "shard": pl.String, "row": pl.UInt32, "mask_checksum": pl.String,
                "prompt_tokens": pl.UInt32, "chosen_tokens": pl.UInt32, "rejected_tokens": pl.UInt32}
LATER = "of the cache's current version (manifest.json), not of the earlier version audited here"


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


def audit_cache(root: Path, manifest: dict, current: bool = True) -> CacheScan:
    """Every rule of the registry (schemas/rules.py, `collect`) over the cache, one check per rule in the registry's
    order. `current`: False when `manifest` is an earlier version of an updated cache (schemas/history.py), whose
    skipped.jsonl and dataset card are the current version's, not its own: those two checks are skipped."""
    cache = rules.CacheView(root, manifest, columns=None, current=current)
    tallies = rules.collect(cache)
    sound = cache.passed("shard_files")
    unverified = len(cache.shards) - len(sound)
    checks = []
    for name, tally in tallies.items():
        rule = rules.REGISTRY[name]
        if rule.current and not current:
            checks.append(Check(name, SKIP, f"{_file(name)} is {LATER}"))
        elif name == "card":
            checks.append(_card(cache, tally.findings, failed=[c.name for c in checks if c.status == FAIL]))
        elif rule.unit == rules.CACHE and not tally.ran:
            checks.append(Check(name, SKIP, f"needs every shard to pass {' and '.join(rule.needs)}"))
        elif rule.only and not tally.checked and not fmt.top_k_of(manifest.get("computation")):
            checks.append(Check(name, SKIP, rules.ONLY[rule.only]))
        elif not rule.per:  # one judgement of the whole: its findings, or what it checks
            checks.append(Check(name, FAIL, "; ".join(f.message for f in tally.findings)) if tally.findings else
                          Check(name, PASS, _passed(name, cache)))
        else:
            checks.append(from_findings(name, tally.findings, tally.checked, rule.per, rule.what,
                                        unchecked_shards=unverified))
    frames = [s.frame for s in sound]
    index = pl.concat([_index(df) for df in frames]) if frames else pl.DataFrame(schema=INDEX_SCHEMA)
    return CacheScan(checks, index, [_logprob_stats(s.frame, s.name) for s in sound], unverified)


def _file(name: str) -> str:
    return {"skipped_counts": fmt.SKIPPED, "card": fmt.CARD}.get(name, name)


def _passed(name: str, cache) -> str:
    """The line of a passing check that judges the cache as a whole (its rule's `what`, with counts where known)."""
    manifest = cache.manifest
    if name == "manifest":
        return (f"refcache file format {manifest['format_version']}, {len(manifest['shards'])} shard(s), "
                f"{sum(e['rows'] for e in manifest['shards']):,} rows")
    if name == "skipped_counts":
        listed = cache.info["skipped_listed"]
        return (f"{listed} skipped row(s), {(manifest.get('source') or {}).get('rows_in')} rows in = "
                f"{manifest.get('rows')} cached + {listed} skipped")
    return rules.REGISTRY[name].what


def _card(cache, found: list, failed: list[str]) -> Check:
    """The dataset card against the manifest, once the cache itself passed: a damaged or edited manifest is reported
    by its own check, not again as a card that disagrees with it."""
    present = cache.info["card_present"]
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
