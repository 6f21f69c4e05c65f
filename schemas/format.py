"""Cache format version 1: a directory with `manifest.json` and zstd Parquet shards. See FORMAT.md.

Writers use `shard_table`, `write_shard` and `write_manifest` (both atomic: temp file, fsync, rename). The pieces a
reader is made of are here too (`read_manifest`, `shard_path`, `read_footer`, `read_columns`); the reader itself is
`schemas/cache.py` (`open_cache`), which judges them by the rules of `schemas/rules.py`. The columns a shard holds are
`schemas/columns.py`'s, the 16-bit codes of its top-k log-probs `schemas/logp_codes.py`'s.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage import places, reads, writes
from storage.files import atomic_write

from .absent import absent_cache
from .columns import (PER_TOKEN, SIDES, TOP_K_COLUMNS, Column, TokenScores, _list_array, _nested_array, shard_columns,
                      shard_schema)
from .columns import SHARD_SCHEMA, per_token_columns  # noqa: F401  (re-exported for the tests)
from .encoding import EncodingConfig, row_mask_checksum
from .logp_codes import _code_steps, _code_values, decode_logps, encode_logps, normalised_top_k
from .logp_codes import LOGP_ERROR  # noqa: F401  (re-exported for the tests)
from .findings import DAMAGED, RERUN, CacheError, StampMismatch, other_format, rebuild  # noqa: F401  (re-exported)
from .stamps import canonical_json, combined_mask_checksum, ids_checksum

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SKIPPED = "skipped.jsonl"
CARD = "README.md"  # the dataset card (schemas/card.py): not part of the cache's identity
LOCK = ".refcache.lock"
STAMPS = ("model_hash", "tokenizer_hash", "mask_checksum")
SHARD_ENTRY = ("file", "rows", "bytes", "sha256", "mask_checksum", "ids_checksum")
META_PREFIX = "refcache."
SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.parquet$")

COMPUTATION_DEFAULTS = {"top_k": 0}  # a computation key a cache may leave out, and what its absence means
# computation keys that say where or how the model ran, not what it computed (the layout of --device-map or --tp-size,
# --torch-compile's compiled, compile_choice (why compiled or not) and compiled_from (auto: the shard and batch
# compiled scoring began at), the number --token-budget auto came to on this machine's memory: the request `auto`
# itself is compared; and `truth`, how the probe's reference values of sequences too long for the whole forward were
# made, runtime/truth.py): kept in the manifest only, never in a shard's footer, and never compared on a rerun, so a
# split or compiled model makes the same cache
COMPUTATION_NOTES = ("layout", "token_budget_resolved", "compiled", "compile_choice", "compiled_from", "truth")
# computation keys that say how rows were batched into forwards: every mode reproduces the model's own forward on a
# probe of the job's rows before it runs, so the shards an --update adds may record another mode than the cache's
# (one the new rows can use, e.g. full_forward for rows longer than a sliding window): their manifest entries then
# carry their own `computation`, which differs from the manifest's in these keys only
MODE_KEYS = ("mode", "batching")


def scored_computation(computation):
    """A computation without its COMPUTATION_NOTES: what a shard's footer carries (anything not a dict as it is)."""
    if not isinstance(computation, dict):
        return computation
    return {k: v for k, v in computation.items() if k not in COMPUTATION_NOTES}


def shard_computation(manifest: dict, entry: dict):
    """What scored one listed shard: its entry's own `computation` (an --update's shards scored in another mode,
    MODE_KEYS), else the manifest's."""
    own = entry.get("computation") if isinstance(entry, dict) else None
    return own if isinstance(own, dict) else manifest.get("computation")


def top_k_of(computation) -> int:
    """The K of a computation (a manifest's or a shard footer's): 0 when it records none."""
    k = computation.get("top_k", COMPUTATION_DEFAULTS["top_k"]) if isinstance(computation, dict) else 0
    return k if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else 0


# ---------------------------------------------------------------------------------------------------------------
# writing


def _scores(value, suffix: str):
    """A completion's per-token `suffix` score: from a TokenScores, or (logps) its plain values."""
    return getattr(value, suffix) if isinstance(value, TokenScores) else (value if suffix == "logps" else None)


def shard_table(ids, prompt_ids, chosen_ids, rejected_ids, chosen, rejected, top_k: int = 0) -> pa.Table:
    """Build a shard table from per-row sequences; `chosen`, `rejected`: per row a TokenScores (or its logps
    alone); sums and per-row checksums are derived here. Columns and types are `shard_columns(top_k)`'s."""
    sides = {"chosen": chosen, "rejected": rejected}
    values = {"id": pa.array(list(ids), pa.string()), "mask_checksum": None}
    for part, rows in (("prompt", prompt_ids), ("chosen", chosen_ids), ("rejected", rejected_ids)):
        values[f"{part}_input_ids"] = _list_array(rows, pa.int32())
    for side, rows in sides.items():
        # Sum the float32 values that are stored (not a float64 input's unrounded values), accumulating in float64.
        values[f"{side}_logp"] = pa.array(np.array(
            [np.sum(np.asarray(_scores(v, "logps"), np.float32).astype(np.float64)) for v in rows], np.float64))
    values["mask_checksum"] = pa.array([row_mask_checksum(p, c, r) for p, c, r in zip(prompt_ids, chosen_ids,
                                                                                     rejected_ids)], pa.string())
    columns = shard_columns(top_k)
    for column in columns:
        side, _, suffix = column.name.partition("_")
        if side in sides and suffix in PER_TOKEN + TOP_K_COLUMNS:
            rows = [_scores(v, suffix) for v in sides[side]]
            if any(r is None for r in rows):
                raise ValueError(f"shard_table: a row has no {suffix} scores for column {column.name}")
            tokens = chosen_ids if side == "chosen" else rejected_ids
            if column.nested and any(np.shape(r) != (len(t), top_k) for r, t in zip(rows, tokens)):
                raise ValueError(f"shard_table: {column.name} must hold {top_k} values per completion token")
            if column.codec == "logp16" and rows:  # one call over the shard's tokens (codes, steps: per token)
                codes = _code_steps(encode_logps(np.concatenate([np.asarray(r).reshape(-1, top_k) for r in rows])))
                rows = np.split(codes, np.cumsum([len(t) for t in tokens])[:-1])
            build = _nested_array if column.nested else _list_array
            values[column.name] = build(rows, column.stored.value_type)
    return pa.Table.from_arrays([values[c.name] for c in columns], schema=shard_schema(top_k))


def shard_metadata(model_hash, tokenizer_hash, encoding: EncodingConfig, shard_checksum: str, ids_sum: str,
                   computation: dict) -> dict[bytes, bytes]:
    meta = {
        "format_version": str(FORMAT_VERSION),
        "model_hash": model_hash,
        "tokenizer_hash": tokenizer_hash,
        "mask_checksum": shard_checksum,
        "ids_checksum": ids_sum,
        "encoding": encoding.to_json(),
        "computation": canonical_json(scored_computation(computation)),
    }
    return {(META_PREFIX + k).encode(): v.encode() for k, v in meta.items()}


def write_shard(path: Path, table: pa.Table, *, model_hash, tokenizer_hash, encoding: EncodingConfig,
                computation: dict) -> dict:
    """Write one shard atomically and return its manifest entry. `computation` is what scored it (the manifest's
    `computation`), carried in the footer so a resumed run can compare it before the manifest exists."""
    checksum = combined_mask_checksum(table.column("mask_checksum").to_pylist(), encoding.to_json())
    ids_sum = ids_checksum(table.column("id").to_pylist())
    table = table.replace_schema_metadata(shard_metadata(model_hash, tokenizer_hash, encoding, checksum, ids_sum,
                                                         computation))
    # Dictionary encoding helps the token ids but not the log-prob floats (its fallback costs more than plain).
    columns = shard_columns(top_k_of(computation))
    ids = [f"{c.name}.list.element" for c in columns if c.dictionary]
    split = {f"{c.name}.list.element": "BYTE_STREAM_SPLIT" for c in columns if c.split}
    levels = {f"{c.name}.list.element": c.level for c in columns if c.level}
    options = ({"column_encoding": split} if split else {}) | ({"compression_level": levels} if levels else {})
    written = write_whole(path, lambda f: pq.write_table(table, f, compression="zstd", use_dictionary=ids,
                                                               **options))
    return shard_entry(path, table.num_rows, checksum, ids_sum, measured=written)


def shard_entry(path: Path, rows: int, mask_checksum: str, ids_sum: str, measured: tuple | None = None) -> dict:
    """A shard's line in the manifest; `measured`: its (size, sha256) when known (an upload's), else read."""
    size, digest = measured or reads.measure(path)
    return {"file": path.name, "rows": rows, "bytes": size, "sha256": digest, "mask_checksum": mask_checksum,
            "ids_checksum": ids_sum}


def write_manifest(root: Path, manifest: dict) -> None:
    """Locally atomic; on a store written only if absent or unchanged since this writer read it (writes.write_whole)."""
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
    write_whole(places.location(root) / MANIFEST, lambda f: f.write(data), conditional=True)


def write_whole(path, write, *, conditional: bool = False) -> tuple[int, str] | None:
    """Locally atomic_write (looked up in this module, where the fault kit replaces it); on a store
    writes.write_whole, which returns the (size, sha256) it uploaded."""
    if places.is_remote(path):
        return writes.write_whole(path, write, conditional=conditional)
    atomic_write(path, write)
    return None


@dataclass
class Footer:
    """What a shard's Parquet footer says: its refcache metadata (without the prefix), row count and schema."""

    meta: dict[str, str]
    rows: int
    schema: pa.Schema


def read_footer(path: Path) -> Footer:
    """A shard's footer, read once (the one reader of Parquet footers). Raises what pyarrow raises on a damaged
    file (pa.ArrowException, OSError, ValueError)."""
    with reads.source(path) as src, pq.ParquetFile(src) as file:
        # the Arrow schema's metadata (what pq.read_table and other readers see), not the Parquet key-value list
        # beside it: a damaged footer can make the two differ
        schema, rows = file.schema_arrow, file.metadata.num_rows
    # errors="replace": bytes that are not UTF-8 cannot equal a stamp, and must fail as a mismatch, not a crash
    meta = {k.decode(errors="replace")[len(META_PREFIX) :]: v.decode(errors="replace")
            for k, v in (schema.metadata or {}).items() if k.startswith(META_PREFIX.encode())}
    return Footer(meta, rows, schema)


def read_shard_metadata(path: Path) -> dict[str, str]:
    return read_footer(path).meta


def read_columns(path: Path, columns=None) -> pa.Table:
    """A shard's columns, in their logical types (shard_columns: the top-k columns as [T, K] lists of float32 and
    int32, whatever their storage; each side's top-k log-probs and tail normalised together, `normalised_top_k`). A
    file that passed its size and sha256 checks can still be damaged where the
    manifest was forged to match it; that is a CacheError like any other damage."""
    # a side's top-k log-probs are normalised with its tail (normalised_top_k), so the tail is read with them
    wanted = list(columns) if columns is not None else None
    if wanted is not None:
        wanted += [f"{side}_tail" for side in SIDES if f"{side}_top_logps" in wanted and f"{side}_tail" not in wanted]
        wanted += [f"{side}_top_logps" for side in SIDES if f"{side}_tail" in wanted and f"{side}_top_logps" not in wanted]
    try:
        with reads.source(path) as src:
            table = pq.read_table(src, columns=wanted)
        table.validate(full=True)  # Parquet's reader leaves e.g. a string's UTF-8 unchecked until it is used
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CacheError("shard_unreadable", f"shard {path.name} is not a readable Parquet file ({e})", remedy=RERUN,
                         shard=path.name) from None
    meta = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (table.schema.metadata or {}).items()}
    try:
        k = top_k_of(json.loads(meta.get(META_PREFIX + "computation", "{}")))
    except ValueError:
        k = 0
    for column in shard_columns(k):
        if column.name in table.column_names and column.physical is not None:
            at = table.column_names.index(column.name)
            try:
                logical = _logical(table.column(at), column, k)
            except (pa.ArrowException, ValueError) as e:
                raise CacheError("shard_unreadable", f"shard {path.name}: column {column.name} does not hold {k} "
                                 f"values per token ({e})", remedy=RERUN, shard=path.name) from None
            table = table.set_column(at, pa.field(column.name, column.logical), logical)
    for side in SIDES:
        if f"{side}_top_logps" in table.column_names and f"{side}_tail" in table.column_names:
            table = _normalised(table, side, k)
    return table.select(list(columns)) if columns is not None else table


def _normalised(table: pa.Table, side: str, k: int) -> pa.Table:
    """`table` with one side's top-k log-probs and tail through normalised_top_k (the decoded distribution)."""
    top, tail = table[f"{side}_top_logps"].combine_chunks(), table[f"{side}_tail"].combine_chunks()
    torn = (top.null_count or tail.null_count or tail.flatten().null_count
            or not np.array_equal(_offsets(top).to_numpy(), _offsets(tail).to_numpy()))
    if torn:  # a tail missing or not one per token: left as it is for the top-k rules (top_k_shape) to name
        return table
    values = top.flatten().flatten().to_numpy(zero_copy_only=False).reshape(-1, k)
    tails = tail.flatten().to_numpy(zero_copy_only=False)
    values, tails = normalised_top_k(values, tails)
    tokens = pa.ListArray.from_arrays(pa.array(np.arange(0, values.size + 1, k, dtype=np.int32)),
                                      pa.array(values.ravel()))
    top = pa.ListArray.from_arrays(_offsets(top), tokens)
    tail = pa.ListArray.from_arrays(_offsets(tail), pa.array(tails))
    for name, column in ((f"{side}_top_logps", top), (f"{side}_tail", tail)):
        table = table.set_column(table.column_names.index(name), table.schema.field(name), column)
    return table


def _offsets(rows: pa.ListArray) -> pa.Array:
    offsets = rows.offsets.to_numpy()
    return pa.array((offsets - offsets[0]).astype(np.int32))


def stored_rows(path: Path, rows) -> pa.Table:
    """Rows of a shard (`rows`: their indices, in the order wanted) as stored, without decoding or re-encoding
    anything: what a writer copies into a new shard (precompute-ref --update), so the copied values are the cached
    ones bit for bit."""
    try:
        with reads.source(path) as src:
            table = pq.read_table(src)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CacheError("shard_unreadable", f"shard {path.name} is not a readable Parquet file ({e})", remedy=RERUN,
                         shard=path.name) from None
    return table.take(pa.array(rows, pa.int64())).replace_schema_metadata(None)


def _logical(chunks: pa.ChunkedArray, column: Column, k: int) -> pa.ChunkedArray:
    """A stored column in its logical type: values decoded or cast back, K per token regrouped into per-token
    lists."""
    parts = []
    for rows in chunks.chunks:
        flat = rows.flatten()
        if rows.null_count or flat.null_count:
            raise ValueError("a row or a value is null")
        offsets = rows.offsets.to_numpy()
        offsets = (offsets - offsets[0]).astype(np.int32)
        if column.nested and (k <= 0 or (offsets % k).any()):
            raise ValueError("the stored values are not a multiple of K per row")
        if column.codec == "logp16":
            codes = _code_values(flat.to_numpy(zero_copy_only=False).reshape(-1, k))
            flat = pa.array(decode_logps(codes).ravel())
        else:
            value_type = column.logical.value_type.value_type if column.nested else column.logical.value_type
            flat = flat.cast(value_type)
        if column.nested:
            tokens = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, k, dtype=np.int32)), flat)
            parts.append(pa.ListArray.from_arrays(pa.array(offsets // k), tokens))
        else:
            parts.append(pa.ListArray.from_arrays(pa.array(offsets), flat))
    return pa.chunked_array(parts, type=column.logical)


# ---------------------------------------------------------------------------------------------------------------
# reading


def no_manifest(root) -> CacheError:
    """Why a folder or prefix without a manifest is not a cache: one that shows a cache was being written there (a
    shard, a writer's temporary file, skipped.jsonl, the writer's lock or lease) is incomplete; anything else (a
    data folder, an empty or mistyped prefix, no such folder) holds no cache, and is never called an interrupted
    job."""
    from storage.files import TEMP
    from storage.nearby import nearby

    try:
        names = [p.name for p in root.iterdir()] if root.is_dir() else None
    except OSError:
        names = None
    if names and any(n in (SKIPPED, LOCK) or TEMP.match(n) or SHARD_NAME.match(n) for n in names):
        return CacheError(
            "incomplete",
            f"{root} has no {MANIFEST}: the cache is incomplete (precompute-ref is still running or was interrupted)",
            remedy="wait for precompute-ref to finish, or re-run the same precompute-ref command to resume it")
    if names:
        what = f"no {MANIFEST} and no shard among its {len(names)} entries"
    elif names is not None:
        what = "it is empty"
    elif places.is_remote(root):
        what = "no object under this prefix"
    else:
        what = ("a file, not a folder" if os.path.exists(root) else
                f"a symbolic link to {os.readlink(root)}, which does not exist" if os.path.islink(root) else
                "no such folder")
    near = nearby(root) if what == "no such folder" else ""  # a typo: the closest name, what the folder holds
    return CacheError("no_cache", f"{root} holds no cache ({what}){near}",
                      remedy="pass the --out of a finished precompute-ref run (a folder or an object-store prefix), "
                             "or make a cache there with precompute-ref")


def shard_path(root: Path, name) -> Path:
    """A manifest's shard name, trusted only if it is a plain file name that stays inside the cache directory."""
    if not isinstance(name, str) or not SHARD_NAME.match(name):
        raise CacheError(
            "shard_path",
            f"manifest names shard {name!r}, which is not a plain .parquet file name inside the cache",
            remedy="the manifest was edited or forged; " + RERUN,
        )
    path = root / name
    if path.is_symlink() and path.resolve().parent != root.resolve():
        raise CacheError(
            "shard_path",
            f"shard {name} is a symlink leaving the cache directory (to {os.readlink(path)})",
            remedy="copy the real file into the cache directory, or " + RERUN,
            shard=name,
        )
    return path


def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file() and (isinstance(root, places.StorePath) or not os.path.lexists(path)):  # (a FIFO: below)
        absent = absent_cache(root) if isinstance(root, places.StorePath) else None
        if absent is not None:  # a missing bucket, an unreachable endpoint: named with its cause, not a missing cache
            raise absent
        raise no_manifest(root)
    try:
        manifest = json.loads(reads.record_bytes(path))
    except reads.NotARecord as e:  # a FIFO, a folder, a device: never opened for a read that could wait
        raise CacheError("manifest", f"{e}", remedy=rebuild(root)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CacheError("manifest", f"{path} is not valid JSON ({e})", remedy=rebuild(root)) from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise CacheError("manifest", f"{path} has no integer format_version", remedy=rebuild(root, manifest))
    if version != FORMAT_VERSION:
        raise other_format(root, path, manifest, version, reads=FORMAT_VERSION)
    remedy = rebuild(root, manifest)
    for key, kind in (("stamps", dict), ("encoding", dict), ("shards", list)):
        if not isinstance(manifest.get(key), kind):
            raise CacheError("manifest", f"{path}: '{key}' is missing or malformed", remedy=remedy)
    if any(not isinstance(manifest["stamps"].get(s), str) for s in STAMPS):
        raise CacheError("manifest", f"{path}: stamps must hold {', '.join(STAMPS)}", remedy=remedy)
    try:
        EncodingConfig.from_dict(manifest["encoding"])
    except (TypeError, ValueError) as e:
        raise CacheError("manifest", f"{path}: bad encoding config ({e})", remedy=remedy) from None
    for s in manifest["shards"]:
        if not isinstance(s, dict) or not set(SHARD_ENTRY) <= set(s):
            raise CacheError("manifest", f"{path}: malformed shard entry {s!r}", remedy=remedy)
        counts_ok = all(isinstance(s[k], int) and not isinstance(s[k], bool) and s[k] >= 0 for k in ("rows", "bytes"))
        if not counts_ok or not all(isinstance(s[k], str) for k in ("sha256", "mask_checksum", "ids_checksum")):
            # (the file name is judged per shard, kind shard_path)
            raise CacheError("manifest", f"{path}: shard entry {s!r} has a field of the wrong type (sha256, mask_checksum "
                             "and ids_checksum are strings; rows and bytes are counts)", remedy=remedy)
    return manifest
