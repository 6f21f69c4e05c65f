"""Every rule that says whether a cache is sound, each defined once, each returning findings (schemas/findings.py).

Who uses them: `open_cache` (train-dpo) raises the first finding of `cache_findings`; audit-ref runs every rule and
reports all findings per rule; precompute-ref's resume judges the shards it would keep with `shard_file_findings`
(against the previous manifest), `shard_footer_findings` and `computation_findings`, and rescored or refuses on any
finding. The value rules (`VALUE_RULES`) are polars expressions, used by train-dpo on the rows it joins and by
audit-ref on every row. One tolerance per check: `SUM_TOLERANCE`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from . import format as fmt
from .encoding import EncodingConfig, row_mask_checksum
from .findings import RERUN, CacheError, Finding
from .stamps import canonical_json, combined_mask_checksum, file_sha256, ids_checksum

SUM_TOLERANCE = 1e-6  # a stored float64 sum vs the float64 sum of the stored float32 values


def _short(h) -> str:
    return f"{h[:12]}…" if isinstance(h, str) and len(h) > 12 else repr(h)


# ---------------------------------------------------------------------------------------------------------------
# manifest and shard files


def manifest_findings(manifest: dict) -> list[Finding]:
    """The manifest against itself (its structure is read_manifest's): no shard listed twice, rows adding up."""
    names = [e["file"] if isinstance(e["file"], str) else repr(e["file"]) for e in manifest["shards"]]
    out = []
    if len(set(names)) != len(names):
        twice = next(n for n, c in Counter(names).items() if c > 1)
        out.append(Finding("manifest", "manifest", f"the manifest lists shard {twice} twice", shard=twice))
    listed = sum(e["rows"] for e in manifest["shards"])
    if "rows" in manifest and manifest["rows"] != listed:
        out.append(Finding("manifest", "manifest", "the manifest's rows differ from the sum of its shards' rows",
                           expected=listed, found=manifest["rows"]))
    return out


def shard_file_findings(root: Path, entry: dict, *, hash_files: bool = True) -> tuple[Path | None, list[Finding]]:
    """A listed shard's file: a plain name inside the cache, present, its size and (unless hash_files=False) its
    sha256 equal to the entry's. Returns the path when the name is acceptable."""
    name = entry["file"]
    try:
        path = fmt._shard_path(root, name)
    except CacheError as e:
        return None, [Finding("shard_files", e.kind, e.message, shard=e.shard or str(name), remedy=e.remedy)]
    if not path.is_file():
        return path, [Finding("shard_files", "shard_missing", f"shard {name} listed in the manifest is missing",
                              shard=name)]
    size = path.stat().st_size
    if size != entry["bytes"]:
        return path, [Finding("shard_files", "shard_size", f"shard {name} has the wrong size", expected=entry["bytes"],
                              found=size, shard=name)]
    if hash_files:
        digest = file_sha256(path)
        if digest != entry["sha256"]:
            return path, [Finding("shard_files", "shard_hash", f"shard {name} content differs from the manifest "
                                  "(file sha256)", expected=entry["sha256"], found=digest, shard=name)]
    return path, []


def expected_footer(stamps: dict, encoding: EncodingConfig, entry: dict, computation, *,
                    with_computation: bool = True) -> dict:
    """The footer metadata a shard must carry: the cache's stamps, its own checksums, the encoding and the
    computation that scored it (the manifest's; a manifest without one matches no shard). Resume compares the
    computation key by key instead (with_computation=False)."""
    want = {"format_version": str(fmt.FORMAT_VERSION), "model_hash": stamps["model_hash"],
            "tokenizer_hash": stamps["tokenizer_hash"], "mask_checksum": entry["mask_checksum"],
            "ids_checksum": entry["ids_checksum"], "encoding": encoding.to_json()}
    if with_computation:
        want["computation"] = canonical_json(computation)
    return want


def shard_footer_findings(path: Path, want: dict, rows: int) -> tuple[dict, list[Finding]]:
    """A shard's Parquet footer: readable, the shard schema, the row count (rule shard_files), and every metadata
    key of `want` (rule shard_stamps). Returns the footer metadata it read."""
    name = path.name
    try:
        meta = fmt.read_shard_metadata(path)
        count = pq.ParquetFile(path).metadata.num_rows
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        return {}, [Finding("shard_files", "shard_unreadable", f"shard {name} is not a readable Parquet file ({e})",
                            shard=name)]
    if not schema.equals(fmt.SHARD_SCHEMA, check_metadata=False):
        return meta, [Finding("shard_files", "shard_unreadable", f"shard {name} does not have the columns of a format "
                              f"version {fmt.FORMAT_VERSION} shard (found "
                              + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")", shard=name)]
    out = []
    for key, value in want.items():
        if meta.get(key) != value:
            kind = key if key in fmt.STAMPS or key in ("ids_checksum", "computation") else "shard_metadata"
            expected, got = value, meta.get(key)
            if key == "computation":  # name the settings that differ, not two JSON blobs
                recorded = json.loads(value)
                diff = computation_findings(recorded if isinstance(recorded, dict) else {"computation": recorded},
                                            footer_computation(meta) or {})
                expected = {k: v for f in diff for k, v in f.expected.items()}
                got = {k: v for f in diff for k, v in f.found.items()}
            out.append(Finding("shard_stamps", kind, f"shard {name}: metadata '{fmt.META_PREFIX}{key}' differs from "
                               "the manifest", expected=expected, found=got, shard=name))
    if count != rows:
        out.append(Finding("shard_files", "shard_rows", f"shard {name} row count differs", expected=rows, found=count,
                           shard=name))
    return meta, out


def unlisted_findings(root: Path, listed) -> list[Finding]:
    unlisted = sorted(p.name for p in root.glob("*.parquet") if p.name not in set(listed))
    if not unlisted:
        return []
    return [Finding("shard_files", "shard_unlisted", f"{root} holds shard files the manifest does not list: "
                    + ", ".join(unlisted[:5]), shard=unlisted[0], count=len(unlisted),
                    remedy="remove the stray files, or " + RERUN)]


# ---------------------------------------------------------------------------------------------------------------
# checksums and ids


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
    if total == manifest["stamps"]["mask_checksum"]:
        return []
    return [Finding("cache_checksum", "mask_checksum", "the shards' rows do not add up to the manifest's mask checksum "
                    "(rows moved between shards?)", expected=manifest["stamps"]["mask_checksum"], found=total)]


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


# ---------------------------------------------------------------------------------------------------------------
# computation


def computation_findings(recorded: dict, now: dict, *, partial: bool = False, where: str = "the cache") -> list[Finding]:
    """Every key of the recorded computation (dtype, device type, attention implementation, mode, head path, token
    budget, ...) against this run's. With partial=True keys this run does not know yet are not compared."""
    out = []
    for key in sorted(set(recorded) | set(now)):
        if partial and key not in now:
            continue
        if recorded.get(key) != now.get(key):
            out.append(Finding("computation", "computation", f"{where} was computed with {key}={recorded.get(key)!r}, "
                               f"this run uses {key}={now.get(key)!r}", expected={key: recorded.get(key)},
                               found={key: now.get(key)},
                               remedy="run with the recorded settings to resume, or pass --overwrite to start over"))
    return out


def footer_computation(meta: dict) -> dict | None:
    try:
        value = json.loads(meta.get("computation", ""))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------------------------------------------------------
# a whole cache


def cache_findings(root: Path, manifest: dict, *, hash_files: bool = True):
    """Every rule open_cache applies, lazily in order (so a reader can stop at the first): manifest, each shard's
    file and footer, unlisted files, shard checksums and ids, unique ids, the cache checksum. Values are checked by
    the reader on the rows it uses (VALUE_RULES)."""
    yield from manifest_findings(manifest)
    encoding = EncodingConfig.from_dict(manifest["encoding"])
    sound = []
    for entry in manifest["shards"]:
        path, found = shard_file_findings(root, entry, hash_files=hash_files)
        if not found:
            want = expected_footer(manifest["stamps"], encoding, entry, manifest.get("computation"))
            found = shard_footer_findings(path, want, entry["rows"])[1]
        yield from found
        sound += [entry] if not found else []
    yield from unlisted_findings(root, [e["file"] for e in manifest["shards"]])
    if len(sound) < len(manifest["shards"]):
        return  # the checksums below need every shard
    every, ids_by_shard = [], []
    for entry in manifest["shards"]:
        table = fmt.read_columns(root / entry["file"], ["id", "mask_checksum"])
        checks, ids = table.column("mask_checksum").to_pylist(), table.column("id").to_pylist()
        yield from shard_checksum_findings(entry["file"], entry, checks, ids, encoding.to_json())
        every.extend(checks)
        ids_by_shard.append((entry["file"], ids))
    yield from unique_id_findings(ids_by_shard)
    yield from cache_checksum_findings(every, manifest)


def skipped_findings(root: Path, manifest: dict) -> tuple[int, list[Finding]]:
    """skipped.jsonl against the manifest's counts: (rows listed, findings)."""
    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    counts = [source.get("skipped", 0), source.get("rows_in"), manifest.get("rows", 0)]
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        return 0, [Finding("skipped_counts", "manifest", f"manifest counts are not integers: source.skipped="
                           f"{counts[0]!r}, source.rows_in={counts[1]!r}, rows={counts[2]!r}")]
    path = root / fmt.SKIPPED
    try:
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
            if path.exists() else []
    except ValueError as e:
        return 0, [Finding("skipped_counts", "manifest", f"{fmt.SKIPPED} is not JSON Lines ({e})")]
    problems = []
    if source.get("skipped") != len(lines):
        problems.append(f"manifest source.skipped is {source.get('skipped')}, {fmt.SKIPPED} lists {len(lines)}")
    reasons = dict(Counter(s.get("reason") for s in lines if isinstance(s, dict)))
    if (source.get("skipped_by_reason") or {}) != reasons:
        problems.append(f"skipped_by_reason {source.get('skipped_by_reason')} vs {fmt.SKIPPED} {reasons}")
    if source.get("rows_in") != manifest.get("rows", 0) + (source.get("skipped") or 0):
        problems.append(f"rows_in {source.get('rows_in')} != rows {manifest.get('rows')} + skipped "
                        f"{source.get('skipped')}")
    return len(lines), [Finding("skipped_counts", "manifest", "; ".join(problems))] if problems else []
