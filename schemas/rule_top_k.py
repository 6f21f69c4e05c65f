"""The top-k rules (schemas/rules.py registers them): the top-k columns of a `--top-k` cache (precompute-ref --top-k K:
per completion token the reference's K most probable ids, their log-probs and the log of the mass outside them,
`tail`, from the forward that gave the token's own log-prob), judged vectorised over every position of every row.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from .logp_codes import mass_allowance
from .findings import Finding
from .format import TOP_K_COLUMNS

# The storage may round a top-k log-prob v for size (FORMAT.md: by at most 2**-12 above -24, 2**-12 of |v| below),
# and the reader normalises the decoded distribution (shifting every value by log Z, |log Z| within that bound), so a
# stored value may be TOP_K_TOLERANCE x max(1, |v|) from the one it stands for (`top_k_allowance`, 2x the two
# together); the mass may be from 1 only what the codes' rounding explains (logp_codes.mass_allowance). Unrounded float32
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

