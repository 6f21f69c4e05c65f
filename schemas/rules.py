"""Every rule that says whether a cache is sound, and every comparison of a cache with its caller, each defined once,
each returning findings (schemas/findings.py).

Who uses them: `open_cache` (schemas/cache.py, train-dpo's reader) raises the first finding of `cache_findings`;
train-dpo then compares the open cache with itself in one call, `use_findings` (encoding options, model and tokenizer
hashes, its own rows), and checks the values it trains on (`VALUE_RULES`); audit-ref runs every rule and reports all
findings per rule; precompute-ref's resume judges the shards it would keep with `shard_file_findings` (against the
previous manifest), `shard_footer_findings` and `computation_findings`, and rescored or refuses on any finding.
Stamps are compared by `stamp_findings` only. A caller supplies only its remedy text. One tolerance per check:
`SUM_TOLERANCE`, `TOP_K_TOLERANCE`. The top-k columns of a `--top-k` cache are judged by `top_k_findings`
(audit-ref on every row; train-dpo may run it on the rows it trains on).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from storage import places, reads

from . import format as fmt
from . import history
from .card import DEFINED, card_metadata, read_card_metadata
from .format import TOP_K_COLUMNS
from .encoding import EncodingConfig, row_mask_checksum
from .findings import CACHE_SIDE, RERUN, RUN_SIDE, CacheError, Finding
from .logp_codes import mass_allowance
from .stamps import canonical_json, combined_mask_checksum, ids_checksum

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
    computation = manifest.get("computation") if isinstance(manifest.get("computation"), dict) else {}
    batching_aside = lambda c: {k: v for k, v in fmt.scored_computation(c).items() if k not in fmt.MODE_KEYS}
    for e in manifest["shards"]:  # a shard's own computation (an --update's mode) differs in the mode keys only
        own = e.get("computation", computation)
        if not isinstance(own, dict) or batching_aside(own) != batching_aside(computation):
            out.append(Finding("manifest", "manifest", f"the manifest's entry of shard {e['file']} records a "
                               "computation that differs from the cache's in more than the batching mode",
                               expected=computation, found=own, shard=e["file"]))
            break
    listed = sum(e["rows"] for e in manifest["shards"])
    if "rows" in manifest and manifest["rows"] != listed:
        out.append(Finding("manifest", "manifest", "the manifest's rows differ from the sum of its shards' rows",
                           expected=listed, found=manifest["rows"]))
    return out


def shard_file_findings(root: Path, entry: dict, *, hash_files: bool = True) -> tuple[Path | None, list[Finding]]:
    """A listed shard's file: a plain name inside the cache, present, its size and (unless hash_files=False) its
    sha256 equal to the entry's. Returns the path when the name is acceptable (an object on a store: holding the
    bytes that were hashed, so the footer and columns are read from them: storage/reads.py)."""
    name = entry["file"]
    try:
        path = fmt.shard_path(root, name)
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
        digest, path = reads.hashed(path)
        if digest != entry["sha256"]:
            return path, [Finding("shard_files", "shard_hash", f"shard {name} content differs from the manifest "
                                  "(file sha256)", expected=entry["sha256"], found=digest, shard=name)]
    return path, []


def expected_footer(stamps: dict, encoding: EncodingConfig, entry: dict, computation, *,
                    with_computation: bool = True) -> dict:
    """The footer metadata a shard must carry: the cache's stamps, its own checksums, the encoding and the
    computation that scored it (the manifest's; a manifest without one matches no shard). Resume compares the
    computation key by key instead (with_computation=False)."""
    if isinstance(entry.get("computation"), dict):  # a shard an --update scored in another mode (fmt.MODE_KEYS)
        computation = entry["computation"]
    want = {"format_version": str(fmt.FORMAT_VERSION), "model_hash": stamps["model_hash"],
            "tokenizer_hash": stamps["tokenizer_hash"], "mask_checksum": entry["mask_checksum"],
            "ids_checksum": entry["ids_checksum"], "encoding": encoding.to_json()}
    if with_computation:
        want["computation"] = canonical_json(fmt.scored_computation(computation))
    return want


def shard_footer_findings(path: Path, want: dict, rows: int) -> tuple[dict, list[Finding]]:
    """A shard's Parquet footer: readable, the shard schema, the row count (rule shard_files), and every metadata
    key of `want` (rule shard_stamps). Returns the footer metadata it read."""
    name = path.name
    try:
        footer = fmt.read_footer(path)
        meta, count, schema = footer.meta, footer.rows, footer.schema
    except (pa.ArrowException, OSError, ValueError) as e:
        return {}, [Finding("shard_files", "shard_unreadable", f"shard {name} is not a readable Parquet file ({e})",
                            shard=name)]
    # the columns of the K its own footer records (a footer that disagrees with the manifest is a finding below)
    if not schema.equals(fmt.shard_schema(fmt.top_k_of(footer_computation(meta))), check_metadata=False):
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
    """Shard files in `root` that neither this manifest (`listed`) nor any version of the cache (manifest.json and
    its manifest-NNNNN.json history, schemas/history.py) names: an update keeps every file an earlier version names,
    and the shards of an update to the next version (running, or killed before its manifest) are not stray either."""
    listed = set(listed) | history.named_shards(root) | history.pending_shards(root)
    unlisted = sorted(p.name for p in root.glob("*.parquet") if p.name not in listed)
    if not unlisted:
        return []
    lost = history.gone(root)  # the shards of a version whose manifest is gone are its, not strays
    return [Finding("shard_files", "shard_unlisted", f"{root} holds shard files the manifest does not list: "
                    + ", ".join(unlisted[:5]) + (f" (the history lists a version it cannot read: {lost})"
                                                 if lost else ""), shard=unlisted[0], count=len(unlisted),
                    remedy="put the version's manifest back from a copy of the cache" if lost else
                    "remove the stray files, or " + RERUN)]


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


# ---------------------------------------------------------------------------------------------------------------
# top-k columns (precompute-ref --top-k K): per completion token the reference's K most probable ids, their
# log-probs and the log of the mass outside them (`tail`), from the forward that gave the token's own log-prob

# The storage may round a top-k log-prob v for size (FORMAT.md: by at most 2**-12 above -24, 2**-12 of |v| below),
# and the reader normalises the decoded distribution (shifting every value by log Z, |log Z| within that bound), so a
# stored value may be TOP_K_TOLERANCE x max(1, |v|) from the one it stands for (`top_k_allowance`, 2x the two
# together); the mass may be from 1 only what the codes' rounding explains (format.mass_allowance). Unrounded float32
# values agree within about 1e-6; a smaller edit of a value is the replay's to find (audit-ref --model).
TOP_K_TOLERANCE = 1e-3

# name: what it checks. A position that fails a rule is not judged by the rules after it (a duplicate id makes its
# mass meaningless), so each damage is reported once, by the first rule that sees it.
TOP_K_RULES = {
    "top_k_shape": "K ids, K log-probs and one tail per completion token, none missing",
    "top_k_ids": "top-k ids inside the vocabulary and unique at each position",
    "top_k_order": "top-k log-probs most probable first and <= 0, the tail <= 0",
    "top_k_mass": "the top-k mass plus the tail's is 1",
    "top_k_dataset": "the dataset token's log-prob equals its top-k entry, or is at most the k-th when absent",
}


def top_k_allowance(values, tolerance: float = TOP_K_TOLERANCE) -> np.ndarray:
    """How far a stored top-k log-prob (or tail) may be from the value it stands for: tolerance x max(1, |v|); 0
    for an infinite one (an empty tail is stored exactly)."""
    v = np.abs(np.asarray(values, np.float64))
    return np.where(np.isfinite(v), tolerance * np.maximum(1.0, v), 0.0)


def _lengths(column) -> np.ndarray:
    return pc.fill_null(pc.list_value_length(column), -1).to_numpy(zero_copy_only=False)


def _parents(column) -> np.ndarray:
    return pc.list_parent_indices(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _nulls(array) -> np.ndarray:
    return array.is_null().to_numpy(zero_copy_only=False)


def _per_row(rows: int, parents: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """A flag per row: any of its elements (parents: each element's row) flagged."""
    return np.bincount(parents[bad], minlength=rows).astype(bool)


def _shape_bad(table: pa.Table, side: str, k: int) -> np.ndarray:
    """Per row: a top-k list per completion token, each of K ids and K log-probs, and a tail per token, no nulls."""
    rows, tokens = table.num_rows, _lengths(table[f"{side}_input_ids"])
    bad = tokens < 0
    for suffix in TOP_K_COLUMNS:
        column = table[f"{side}_{suffix}"].combine_chunks()
        bad |= _lengths(column) != tokens
        inner = column.flatten()
        if suffix == "tail":
            bad |= _per_row(rows, _parents(column), _nulls(inner))
            continue
        position = (_lengths(inner) != k) | _per_row(len(inner), _parents(inner), _nulls(inner.flatten()))
        bad |= _per_row(rows, _parents(column), position)
    return bad


def _side_flags(table: pa.Table, side: str, k: int, vocab, tol: float):
    """Over the positions of one side of `table`'s rows (whose shape must be sound), vectorised: the row of each
    position, its index in its row, the flags of each rule but top_k_shape, and the values (for a description)."""
    ids_col = table[f"{side}_top_ids"].combine_chunks()
    rows = _parents(ids_col)
    flat = lambda column: table[column].combine_chunks().flatten().flatten().to_numpy(zero_copy_only=False)
    ids = flat(f"{side}_top_ids").astype(np.int64).reshape(-1, k)
    lp = flat(f"{side}_top_logps").astype(np.float64).reshape(-1, k)
    tail = table[f"{side}_tail"].combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.float64)
    token = table[f"{side}_input_ids"].combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    own = np.full(len(rows), np.nan)  # the dataset token's log-prob where its row has one per token
    counted = _lengths(table[f"{side}_logps"]) == _lengths(table[f"{side}_input_ids"])
    own[counted[rows]] = table.filter(pa.array(counted))[f"{side}_logps"].combine_chunks().flatten().to_numpy(
        zero_copy_only=False)
    index = np.arange(len(rows)) - np.searchsorted(rows, rows)

    flags, live = {}, np.ones(len(rows), bool)
    bad = (ids < 0).any(1) | ((ids >= vocab).any(1) if vocab is not None else False)
    ordered = np.sort(ids, axis=1)
    flags["top_k_ids"] = bad | (ordered[:, 1:] == ordered[:, :-1]).any(1)
    live &= ~flags["top_k_ids"]
    flags["top_k_order"] = live & (np.isnan(lp).any(1) | (lp > 0).any(1) | (lp[:, 1:] > lp[:, :-1]).any(1)
                                   | ~(tail <= 0))
    live &= ~flags["top_k_order"]
    every = np.concatenate([lp, tail[:, None]], axis=1)
    top = np.maximum(lp[:, 0], tail)  # the largest term on a live (sorted) position
    with np.errstate(invalid="ignore", divide="ignore"):
        mass = top + np.log(np.exp(every - top[:, None]).sum(1))
    # the codes' own bound: read_columns normalises every position within it (format.normalised_top_k), so what
    # is left beyond it is damage
    flags["top_k_mass"] = live & ~(np.abs(np.expm1(mass)) <= mass_allowance(lp, tail))
    live &= ~flags["top_k_mass"]
    judged = live & np.isfinite(own) & (own <= 0)  # a bad own log-prob is logprob_values' (or list_lengths')
    match = ids == token[:, None]
    present = match.any(1)
    entry = lp[np.arange(len(rows)), match.argmax(1)]
    kth = lp[:, -1]
    flags["top_k_dataset"] = judged & np.where(present, ~(np.abs(entry - own) <= top_k_allowance(entry, tol)),
                                               ~(own <= kth + top_k_allowance(kth, tol)))
    return rows, index, flags, {"ids": ids, "lp": lp, "tail": tail, "mass": mass, "token": token, "own": own,
                                "present": present, "entry": entry}


def _describe_top_k(rule: str, side: str, j: int, p: int, v: dict, vocab) -> str:
    ids, lp = v["ids"][p].tolist(), v["lp"][p].tolist()
    where = f"{side} token {j}"
    if rule == "top_k_ids":
        outside = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
        twice = [i for n, i in enumerate(ids) if i in ids[:n]]
        return f"{where}: id {outside[0]} outside 0..{vocab - 1 if vocab is not None else '?'}" if outside else \
            f"{where}: id {twice[0]} twice"
    if rule == "top_k_order":
        return f"{where}: top_logps {lp}, tail {v['tail'][p]}"
    if rule == "top_k_mass":
        return f"{where}: the top-k mass plus the tail's is {np.exp(v['mass'][p]):.6f}"
    if v["present"][p]:
        return (f"{where} (id {v['token'][p]}): its log-prob {v['own'][p]:.6f}, its top-k entry "
                f"{v['entry'][p]:.6f}")
    return f"{where} (id {v['token'][p]}): not among the top-k, its log-prob {v['own'][p]:.6f} > the k-th {lp[-1]:.6f}"


def top_k_findings(table, k, vocab: int | None = None, name: str | None = None, *,
                   tolerance: float = TOP_K_TOLERANCE) -> list[Finding]:
    """The top-k rules (TOP_K_RULES) over a table of cached rows (pyarrow or polars; the token ids, the log-probs
    and the six top-k columns; `id`, and `row` and `shard` where known), K = `k` (the shard footer's
    computation.top_k), ids below `vocab` when it is given. One finding per failing rule: the first row, and the
    count of rows failing it. Rows are judged TOP_K_CHUNK values at a time, so memory stays bounded."""
    table = table.to_arrow() if isinstance(table, pl.DataFrame) else table
    rows = table.num_rows
    if not (isinstance(k, int) and not isinstance(k, bool) and k > 0):
        return [Finding("top_k_shape", "top_k", f"shard {name}: computation.top_k is {k!r}, not a count of top-k "
                        "entries: the cache was edited or damaged", shard=name, count=rows)]
    failing = {rule: np.zeros(rows, bool) for rule in TOP_K_RULES}
    first = {}  # rule -> (row, description)
    tokens = sum(np.maximum(_lengths(table[f"{side}_input_ids"]), 0) for side in ("chosen", "rejected"))
    ends = np.searchsorted(np.cumsum(tokens * k), np.arange(TOP_K_CHUNK, tokens.sum() * k, TOP_K_CHUNK), "right")
    bounds = np.unique(np.concatenate([[0], ends, [rows]]))
    for start, stop in zip(bounds[:-1], bounds[1:]):
        _judge(table.slice(start, stop - start), int(start), k, vocab, tolerance, failing, first)
    out = []
    for rule in TOP_K_RULES:
        if rule not in first:
            continue
        r, detail = first[rule]
        if rule == "top_k_shape":
            detail = _describe_shape(table.slice(r, 1).to_pylist()[0], detail, k)
        shard = table["shard"][r].as_py() if "shard" in table.column_names else name
        row = table["row"][r].as_py() if "row" in table.column_names else r
        out.append(Finding(rule, "top_k", f"top-k columns of row {table['id'][r].as_py()!r} are inconsistent: the "
                           f"cache was edited or damaged [{rule}: {detail}]", shard=shard, row=row,
                           count=int(failing[rule].sum())))
    return out


TOP_K_CHUNK = 2**22  # top-k values judged at once (a few float64 copies of them: ~100 MiB)


def _judge(table: pa.Table, offset: int, k: int, vocab, tol: float, failing: dict, first: dict) -> None:
    """The rules over rows offset.. of the whole table: their failures marked in `failing` (rule -> row flags),
    the first row of each rule and its description in `first` (for top_k_shape: the side, described later)."""
    for side in ("chosen", "rejected"):
        shape = _shape_bad(table, side, k)
        failing["top_k_shape"][offset:offset + table.num_rows] |= shape
        at = offset + int(np.argmax(shape))
        if shape.any() and ("top_k_shape" not in first or at < first["top_k_shape"][0]):
            first["top_k_shape"] = (at, side)
        sound = np.flatnonzero(~shape)
        positions, index, flags, values = _side_flags(table.take(pa.array(sound)), side, k, vocab, tol)
        for rule, bad in flags.items():
            if not bad.any():
                continue
            failing[rule][offset + sound[positions[bad]]] = True
            p = int(np.argmax(bad))
            row = offset + int(sound[positions[p]])
            if rule not in first or row < first[rule][0]:
                first[rule] = (row, _describe_top_k(rule, side, int(index[p]), p, values, vocab))


def _describe_shape(r: dict, side: str, k: int) -> str:
    tokens = len(r[f"{side}_input_ids"] or [])
    for suffix in TOP_K_COLUMNS:
        values = r[f"{side}_{suffix}"]
        if values is None or len(values) != tokens:
            return f"{side}: {tokens} completion tokens, {None if values is None else len(values)} {side}_{suffix}"
        for j, v in enumerate(values):
            if v is None or (suffix != "tail" and (len(v) != k or None in v)):
                return f"{side} token {j}: {side}_{suffix} is {v} (K = {k})"
    return side


# ---------------------------------------------------------------------------------------------------------------
# computation


def computation_findings(recorded: dict, now: dict, *, partial: bool = False, where: str = "the cache",
                         remedy: str = RERUN) -> list[Finding]:
    """Every key of the recorded computation (dtype, device type, attention implementation, mode, head path, token
    budget, ...) against this run's. With partial=True keys this run does not know yet are not compared. A key of
    fmt.COMPUTATION_DEFAULTS (top_k) left out means its default, on either side; fmt.COMPUTATION_NOTES (the layout
    of a split model) are not compared. `remedy`: the caller's (precompute-ref's resume: precompute/resume.COMPUTATION)."""
    out = []
    defaults = fmt.COMPUTATION_DEFAULTS
    for key in sorted((set(recorded) | set(now)) - set(fmt.COMPUTATION_NOTES)):
        if partial and key not in now and key not in defaults:
            continue
        was, uses = recorded.get(key, defaults.get(key)), now.get(key, defaults.get(key))
        if was != uses:
            out.append(Finding("computation", "computation", f"{where} was computed with {key}={was!r}, "
                               f"this run uses {key}={uses!r}", expected={key: was}, found={key: uses},
                               remedy=remedy, sides=(CACHE_SIDE, RUN_SIDE)))
    return out


def footer_computation(meta: dict) -> dict | None:
    try:
        value = json.loads(meta.get("computation", ""))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------------------------------------------------------
# a whole cache


def cache_findings(root: Path, manifest: dict, *, hash_files: bool = True, read: dict | None = None, keep=()):
    """Every rule open_cache applies, lazily in order (so a reader can stop at the first): manifest, each shard's
    file and footer, unlisted files, shard checksums and ids, unique ids, the cache checksum. Values are checked by
    the reader on the rows it uses (VALUE_RULES). `read` (shard name -> table) receives the id and mask_checksum
    columns read here, so the reader does not read them again; and, for a shard on an object store whose bytes were
    hashed, the `keep` columns read from those bytes too."""
    yield from manifest_findings(manifest)
    encoding = EncodingConfig.from_dict(manifest["encoding"])
    sound, held = [], {}
    names = fmt.shard_schema(fmt.top_k_of(manifest.get("computation"))).names
    columns = ["id", "mask_checksum", *[c for c in keep if c in names and c not in ("id", "mask_checksum")]]
    for entry in manifest["shards"]:
        path, found = shard_file_findings(root, entry, hash_files=hash_files)
        if not found:
            want = expected_footer(manifest["stamps"], encoding, entry, manifest.get("computation"))
            found = shard_footer_findings(path, want, entry["rows"])[1]
            if not found and getattr(path, "content", None) is not None:  # an object's verified bytes, read now
                held[entry["file"]] = fmt.read_columns(path, columns)
        yield from found
        sound += [entry] if not found else []
    yield from unlisted_findings(root, [e["file"] for e in manifest["shards"]])
    if len(sound) < len(manifest["shards"]):
        return  # the checksums below need every shard
    every, ids_by_shard = [], []
    for entry in manifest["shards"]:
        name = entry["file"]
        table = held.pop(name) if name in held else fmt.read_columns(root / name, ["id", "mask_checksum"])
        if read is not None:
            read[entry["file"]] = table
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


CARD_REMEDY = ("re-run the same precompute-ref command: it writes the card from the manifest (a README.md that is "
               "not this cache's card is refused: move it away first)")


def card_findings(root: Path, manifest: dict) -> tuple[bool, list[Finding]]:
    """The dataset card (README.md, schemas/card.py) against the manifest: (whether there is one, findings). The
    metadata refcache defines (`configs`: the shards, `refcache`: the identity) must be what the manifest gives; the
    rest of the metadata and the text are not compared. No card is no finding (caches made before cards)."""
    path = root / fmt.CARD
    if not (path.exists() if places.is_remote(path) else os.path.lexists(path)):
        return False, []
    meta = read_card_metadata(path) if path.is_file() and not path.is_symlink() else None
    if meta is None:
        return True, [Finding("card", "card", f"{fmt.CARD} is not a dataset card huggingface_hub can read (or not a "
                              "plain file)", remedy=CARD_REMEDY)]
    want = card_metadata(manifest)
    differ = [k for k in DEFINED if meta.get(k) != want[k]]
    if not differ:
        return True, []
    k = differ[0]
    found, expected = meta.get(k), want[k]
    if k == "refcache" and isinstance(found, dict):  # name the fields that differ, not two blocks
        keys = [f for f in expected if found.get(f) != expected[f]] + [f for f in found if f not in expected]
        found, expected = {f: found.get(f) for f in keys}, {f: expected.get(f) for f in keys}
    return True, [Finding("card", "card", f"{fmt.CARD}'s metadata '{k}' differs from the manifest", expected=expected,
                          found=found, remedy=CARD_REMEDY)]


# ---------------------------------------------------------------------------------------------------------------
# a cache against its caller (train-dpo's run, precompute-ref's resume, audit-ref's model, a run's record)
#
# Each caller supplies only its own remedy text (`remedies`, by finding kind) and, where its words differ, how it
# names an option; what is compared, and the message's first line, are the rule's.


STAMP_WHAT = {"model_hash": "model", "tokenizer_hash": "tokenizer"}


def stamp_findings(stamps: dict, now: dict, *, where: str = "the cache", remedies: dict | None = None,
                   tokenizer_parts: dict | None = None) -> list[Finding]:
    """The one comparison of stamps: each stamp the caller knows (`now`, key -> value) against the recorded one
    (`stamps`: a manifest's, plus `encoding` where the caller compares it).
    expected = the caller's value, found = the recorded one. With `tokenizer_parts` (this tokenizer's per-part
    hashes) a tokenizer mismatch names the parts that differ from the manifest's `tokenizer.parts`, given in
    `stamps["tokenizer"]`."""
    stamps = stamps if isinstance(stamps, dict) else {}
    out = []
    for key, value in now.items():
        found = stamps.get(key)
        if value == found:
            continue
        if key == "encoding":
            message = f"encoding config mismatch with {where}"
        elif key in STAMP_WHAT:
            message = f"{key} mismatch: {where} was not computed with this {STAMP_WHAT[key]}"
            if key == "tokenizer_hash":
                message += _tokenizer_difference(stamps.get("tokenizer"), tokenizer_parts)
        else:
            message = f"{key} mismatch with {where}"
        out.append(Finding("stamps", key, message, expected=value, found=found,
                           remedy=(remedies or {}).get(key, RERUN), sides=(RUN_SIDE, CACHE_SIDE)))
    return out


def _tokenizer_difference(tokenizer: dict | None, parts: dict | None) -> str:
    recorded = (tokenizer or {}).get("parts") if isinstance(tokenizer, dict) else None
    if not parts:
        return ""
    if not isinstance(recorded, dict):
        return " (the cache records no per-part tokenizer hashes, so what differs cannot be named)"
    differ = [k for k in parts if recorded.get(k) != parts[k]]
    return f"; it differs in: {', '.join(differ)}" if differ else ""


def option_findings(recorded: EncodingConfig, requested: dict, *, where: str = "the cache", option=str,
                    remedy: str = RERUN) -> list[Finding]:
    """Encoding values the caller asks for (None: not asked) against the cache's encoding config; `option` names a
    key the caller's way (train-dpo: its command-line option)."""
    out = []
    for key, value in requested.items():
        if value is not None and getattr(recorded, key) != value:
            out.append(Finding("stamps", "encoding", f"{option(key)} {value} conflicts with {where}, made with "
                               f"{key}={getattr(recorded, key)}", expected=value, found=getattr(recorded, key),
                               remedy=remedy, sides=(RUN_SIDE, CACHE_SIDE)))
    return out


def row_findings(index, expected: dict[str, str], *, where: str = "the cache",
                 remedies: dict | None = None) -> list[Finding]:
    """The caller's rows (id -> mask checksum of its own encoding) against the cached ones: every row cached, with
    the same token ids. `index`: the cache's id, mask_checksum, shard and row columns (a pyarrow table)."""
    remedies = remedies or {}
    ids, checks = index.column("id").to_pylist(), index.column("mask_checksum").to_pylist()
    cached = {rid: i for i, rid in enumerate(ids)}
    missing = [i for i in expected if i not in cached]
    if missing:
        return [Finding("rows", "rows_missing", f"{len(missing)} of {len(expected)} data rows are not in {where}; "
                        "first ids: " + ", ".join(map(repr, missing[:5])), count=len(missing),
                        remedy=remedies.get("rows_missing", RERUN))]
    for rid, checksum in expected.items():
        i = cached[rid]
        if checks[i] != checksum:
            return [Finding("rows", "mask_checksum", f"mask checksum mismatch for row {rid!r}: its token ids differ "
                            "from the cached ones (data edited, or a different tokenizer or encoding)",
                            expected=checksum, found=checks[i], shard=index.column("shard")[i].as_py(),
                            row=index.column("row")[i].as_py(), remedy=remedies.get("mask_checksum", RERUN),
                            sides=(RUN_SIDE, CACHE_SIDE))]
    return []


def use_findings(cache, *, model_hash=None, tokenizer_hash=None, tokenizer_parts=None, encoding_request=None,
                 rows=None, option=str, remedies: dict | None = None):
    """An open cache (schemas/cache.py) against what its user will train on, lazily in order (so the user stops
    at the first, before it encodes a row): the encoding options it asks for, its model and tokenizer hashes, then
    its rows, `rows(encoding)` -> id -> mask checksum, encoded with the cache's encoding. A hash or request given as
None is not compared."""
    where, remedies = f"the cache {cache.root}", remedies or {}
    yield from option_findings(cache.encoding, encoding_request or {}, where=where, option=option,
                               remedy=remedies.get("encoding", RERUN))
    known = {k: v for k, v in (("model_hash", model_hash), ("tokenizer_hash", tokenizer_hash)) if v is not None}
    yield from stamp_findings({**cache.stamps, "tokenizer": cache.manifest.get("tokenizer")}, known, where=where,
                              remedies=remedies, tokenizer_parts=tokenizer_parts)
    if rows is not None:
        yield from row_findings(cache.index, rows(cache.encoding), where=where, remedies=remedies)
