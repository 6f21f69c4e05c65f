"""The rules over a cache's rows (schemas/rules.py registers them): each shard's row checksums and ids adding up to
its own, ids unique across shards, every row adding up to the cache's mask checksum, each row's checksum against its
token ids, and the cached values (one log-prob per token, sums, finite log-probs <= 0).
"""

from __future__ import annotations

import polars as pl

from .encoding import EncodingConfig, row_mask_checksum
from .findings import Finding
from .rule_caller import stamp_findings
from .stamps import combined_mask_checksum, ids_checksum

SUM_TOLERANCE = 1e-6  # a stored float64 sum vs the float64 sum of the stored float32 values


def _short(h) -> str:
    return f"{h[:12]}…" if isinstance(h, str) and len(h) > 12 else repr(h)


def shard_checksum_findings(name: str, entry: dict, row_checks: list, ids: list, encoding_json: str) -> list[Finding]:
    """The shard's stored row checksums add up to its mask checksum, and its ids to its ids checksum."""
    out = []
    try:
        got = combined_mask_checksum(row_checks, encoding_json)
    except (ValueError, TypeError):
        got = None
    if got != entry["mask_checksum"]:
        out.append(Finding("shard_checksums", "mask_checksum", f"shard {name}: its rows' mask checksums do not add up "
                           "to the shard's (rows edited, reordered or moved)", expected=entry["mask_checksum"],
                           found=got, shard=name))
    got_ids = ids_checksum(ids)
    if got_ids != entry["ids_checksum"]:
        out.append(Finding("shard_checksums", "ids_checksum", f"shard {name}: its row ids do not add up to the "
                           "shard's ids checksum (rows renamed, reordered or moved)", expected=entry["ids_checksum"],
                           found=got_ids, shard=name))
    return out


def unique_id_findings(ids_by_shard: list[tuple[str, list]]) -> list[Finding]:
    seen, out = {}, []
    for name, ids in ids_by_shard:
        for i, rid in enumerate(ids):
            if rid in seen:
                if not out:
                    out.append(Finding("unique_ids", "duplicate_id", f"row id {rid!r} appears twice (also at shard "
                                       f"{seen[rid][0]} row {seen[rid][1]})", shard=name, row=i, count=0))
                out[0].count += 1
            else:
                seen[rid] = (name, i)
    return out


def cache_checksum_findings(row_checks: list, manifest: dict) -> list[Finding]:
    total = combined_mask_checksum(row_checks, EncodingConfig.from_dict(manifest["encoding"]).to_json())
    return [Finding("cache_checksum", "mask_checksum", "the shards' rows do not add up to the manifest's mask checksum "
                    "(rows moved between shards?)", expected=f.found, found=f.expected)
            for f in stamp_findings(manifest["stamps"], {"mask_checksum": total})]


def row_checksum_findings(df: pl.DataFrame, name: str) -> list[Finding]:
    """Each row's stored mask checksum recomputed from its stored token ids (audit-ref; train-dpo compares its own
    encoding of the data instead). `df` needs a `row` index column."""
    ids = zip(df["prompt_input_ids"].to_list(), df["chosen_input_ids"].to_list(), df["rejected_input_ids"].to_list())
    recomputed = pl.Series("recomputed", [row_mask_checksum(p, c, r) for p, c, r in ids], pl.String)
    bad = df.with_columns(recomputed).filter(pl.col("recomputed") != pl.col("mask_checksum"))
    if not bad.height:
        return []
    r = bad.row(0, named=True)
    return [Finding("row_checksums", "mask_checksum", f"shard {name} row {r['row']} (id {r['id']!r}): stored "
                    f"{_short(r['mask_checksum'])}, recomputed from its ids {_short(r['recomputed'])}",
                    shard=name, row=r["row"], count=bad.height)]


# ---------------------------------------------------------------------------------------------------------------
# values


def _sum64(column: str) -> pl.Expr:
    return pl.col(column).list.eval(pl.element().cast(pl.Float64)).list.sum()


def _valid(column: str) -> pl.Expr:
    return pl.col(column).list.eval((pl.element().is_finite() & (pl.element() <= 0)).fill_null(False)).list.all()


def _close(side: str) -> pl.Expr:
    s, stored = _sum64(f"{side}_logps"), pl.col(f"{side}_logp")
    return (s == stored) | ((s - stored).abs() <= SUM_TOLERANCE)  # == also matches NaN and inf (reported as values)


# name: an expression true for a failing row (null, from a null list or sum, counts as failing)
VALUE_RULES = {
    "list_lengths": ((pl.col("chosen_logps").list.len() != pl.col("chosen_input_ids").list.len())
                     | (pl.col("rejected_logps").list.len() != pl.col("rejected_input_ids").list.len())).fill_null(True),
    "sums": (~(_close("chosen") & _close("rejected"))).fill_null(True),
    "logprob_values": (~(_valid("chosen_logps") & _valid("rejected_logps"))).fill_null(True),
}
VALUE_WHAT = {
    "list_lengths": "one log-prob per completion token",
    "sums": "chosen_logp and rejected_logp equal the sums of the per-token values",
    "logprob_values": "every log-prob finite and <= 0",
}


def _describe(rule: str, r: dict) -> str:
    if rule == "list_lengths":
        n = lambda v: None if v is None else len(v)
        return (f"chosen {n(r['chosen_input_ids'])} tokens / {n(r['chosen_logps'])} log-probs, rejected "
                f"{n(r['rejected_input_ids'])} / {n(r['rejected_logps'])}")
    if rule == "sums":
        return f"chosen_logp {r['chosen_logp']} vs its values, rejected_logp {r['rejected_logp']} vs its values"
    for side in ("chosen", "rejected"):
        for i, v in enumerate(r[f"{side}_logps"] or [None]):
            if v is None or not (v == v and abs(v) != float("inf")) or v > 0:
                return f"{side}_logps[{i}] = {v}"
    return "?"


def value_findings(df: pl.DataFrame, name: str | None = None) -> list[Finding]:
    """The value rules over a frame of cached rows (`id`, `row`, `shard` columns, the token ids, values and sums)."""
    flags = df.select(*(e.alias(n) for n, e in VALUE_RULES.items()))
    out = []
    for rule in VALUE_RULES:
        if not flags[rule].any():
            continue
        bad = df.filter(flags[rule])
        if bad.height:
            r = bad.row(0, named=True)
            shard = r.get("shard", name)
            out.append(Finding(rule, "values", f"cached log-probs of row {r['id']!r} are inconsistent (wrong count, sum "
                               "differing from the per-token values, or a NaN, infinite, positive or missing log-prob): "
                               f"the cache was edited or damaged [{rule}: {_describe(rule, r)}]", shard=shard,
                               row=r["row"], count=bad.height))
    return out

