"""Cache format version 1: a directory with `manifest.json` and zstd Parquet shards. See FORMAT.md.

Writers use `shard_table`, `write_shard` and `write_manifest` (both atomic: temp file, fsync, rename). The pieces a
reader is made of are here too (`read_manifest`, `shard_path`, `read_footer`, `read_columns`); the reader itself is
`schemas/cache.py` (`open_cache`), which judges them by the rules of `schemas/rules.py`.
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

from .encoding import EncodingConfig, row_mask_checksum
from .files import atomic_write
from .findings import RERUN, CacheError, StampMismatch  # noqa: F401  (re-exported)
from .stamps import canonical_json, combined_mask_checksum, file_sha256, ids_checksum

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SKIPPED = "skipped.jsonl"
LOCK = ".refcache.lock"
STAMPS = ("model_hash", "tokenizer_hash", "mask_checksum")
SHARD_ENTRY = ("file", "rows", "bytes", "sha256", "mask_checksum", "ids_checksum")
META_PREFIX = "refcache."
SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.parquet$")

SHARD_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt_input_ids", pa.list_(pa.int32())),
        ("chosen_input_ids", pa.list_(pa.int32())),
        ("rejected_input_ids", pa.list_(pa.int32())),
        ("chosen_logps", pa.list_(pa.float32())),
        ("rejected_logps", pa.list_(pa.float32())),
        ("chosen_logp", pa.float64()),
        ("rejected_logp", pa.float64()),
        ("mask_checksum", pa.string()),
    ]
)




# ---------------------------------------------------------------------------------------------------------------
# writing


def _list_array(values: list, value_type) -> pa.ListArray:
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([np.asarray(v) for v in values]) if values else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(value_type.to_pandas_dtype())))


def shard_table(ids, prompt_ids, chosen_ids, rejected_ids, chosen_logps, rejected_logps) -> pa.Table:
    """Build a shard table from per-row sequences; sums and per-row checksums are derived here."""
    # Sum the float32 values that are stored (not a float64 input's unrounded values), accumulating in float64.
    chosen_sum = np.array([np.sum(np.asarray(v, np.float32).astype(np.float64)) for v in chosen_logps], np.float64)
    rejected_sum = np.array([np.sum(np.asarray(v, np.float32).astype(np.float64)) for v in rejected_logps], np.float64)
    checks = [row_mask_checksum(p, c, r) for p, c, r in zip(prompt_ids, chosen_ids, rejected_ids)]
    columns = [
        pa.array(list(ids), pa.string()),
        _list_array(prompt_ids, pa.int32()),
        _list_array(chosen_ids, pa.int32()),
        _list_array(rejected_ids, pa.int32()),
        _list_array(chosen_logps, pa.float32()),
        _list_array(rejected_logps, pa.float32()),
        pa.array(chosen_sum),
        pa.array(rejected_sum),
        pa.array(checks, pa.string()),
    ]
    return pa.Table.from_arrays(columns, schema=SHARD_SCHEMA)


def shard_metadata(model_hash, tokenizer_hash, encoding: EncodingConfig, shard_checksum: str, ids_sum: str,
                   computation: dict) -> dict[bytes, bytes]:
    meta = {
        "format_version": str(FORMAT_VERSION),
        "model_hash": model_hash,
        "tokenizer_hash": tokenizer_hash,
        "mask_checksum": shard_checksum,
        "ids_checksum": ids_sum,
        "encoding": encoding.to_json(),
        "computation": canonical_json(computation),
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
    ids = [f"{c}.list.element" for c in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")]
    atomic_write(path, lambda f: pq.write_table(table, f, compression="zstd", use_dictionary=ids))
    return shard_entry(path, table.num_rows, checksum, ids_sum)


def shard_entry(path: Path, rows: int, mask_checksum: str, ids_sum: str) -> dict:
    """A shard's line in the manifest."""
    return {"file": path.name, "rows": rows, "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "mask_checksum": mask_checksum, "ids_checksum": ids_sum}


def write_manifest(root: Path, manifest: dict) -> None:
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
    atomic_write(Path(root) / MANIFEST, lambda f: f.write(data))


@dataclass
class Footer:
    """What a shard's Parquet footer says: its refcache metadata (without the prefix), row count and schema."""

    meta: dict[str, str]
    rows: int
    schema: pa.Schema


def read_footer(path: Path) -> Footer:
    """A shard's footer, read once (the one reader of Parquet footers). Raises what pyarrow raises on a damaged
    file (pa.ArrowException, OSError, ValueError)."""
    with pq.ParquetFile(path) as file:
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
    """A shard's columns. A file that passed its size and sha256 checks can still be damaged where the manifest was
    forged to match it; that is a CacheError like any other damage."""
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CacheError("shard_unreadable", f"shard {path.name} is not a readable Parquet file ({e})", remedy=RERUN,
                         shard=path.name) from None


# ---------------------------------------------------------------------------------------------------------------
# reading


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
    if not path.is_file():
        raise CacheError(
            "incomplete",
            f"{root} has no {MANIFEST}: the cache is incomplete (precompute-ref is still running or was interrupted)",
            remedy="wait for precompute-ref to finish, or re-run the same precompute-ref command to resume it",
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CacheError("manifest", f"{path} is not valid JSON ({e})", remedy=RERUN) from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise CacheError("manifest", f"{path} has no integer format_version", remedy=RERUN)
    if version != FORMAT_VERSION:
        raise CacheError(
            "format_version",
            f"{path} has format version {version}; this refcache reads version {FORMAT_VERSION}",
            remedy="upgrade refcache" if version > FORMAT_VERSION else RERUN,
            expected=FORMAT_VERSION,
            found=version,
        )
    for key, kind in (("stamps", dict), ("encoding", dict), ("shards", list)):
        if not isinstance(manifest.get(key), kind):
            raise CacheError("manifest", f"{path}: '{key}' is missing or malformed", remedy=RERUN)
    if any(not isinstance(manifest["stamps"].get(s), str) for s in STAMPS):
        raise CacheError("manifest", f"{path}: stamps must hold {', '.join(STAMPS)}", remedy=RERUN)
    try:
        EncodingConfig.from_dict(manifest["encoding"])
    except (TypeError, ValueError) as e:
        raise CacheError("manifest", f"{path}: bad encoding config ({e})", remedy=RERUN) from None
    for s in manifest["shards"]:
        if not isinstance(s, dict) or not set(SHARD_ENTRY) <= set(s):
            raise CacheError("manifest", f"{path}: malformed shard entry {s!r}", remedy=RERUN)
        counts_ok = all(isinstance(s[k], int) and not isinstance(s[k], bool) and s[k] >= 0 for k in ("rows", "bytes"))
        if not counts_ok or not all(isinstance(s[k], str) for k in ("sha256", "mask_checksum", "ids_checksum")):
            # (the file name is judged per shard, kind shard_path)
            raise CacheError("manifest", f"{path}: shard entry {s!r} has a field of the wrong type (sha256, mask_checksum "
                             "and ids_checksum are strings; rows and bytes are counts)", remedy=RERUN)
    return manifest
