"""Cache format version 1: a directory with `manifest.json` and zstd Parquet shards. See FORMAT.md.

Writers use `shard_table`, `write_shard` and `write_manifest` (both atomic: temp file, fsync, rename). Readers use
`open_cache`, which refuses anything that does not match the manifest with a typed `CacheError`.
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
from .findings import RERUN, CacheError, StampMismatch  # re-exported too
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


def read_shard_metadata(path: Path) -> dict[str, str]:
    meta = pq.read_schema(path).metadata or {}
    # errors="replace": bytes that are not UTF-8 cannot equal a stamp, and must fail as a mismatch, not a crash
    return {k.decode(errors="replace")[len(META_PREFIX) :]: v.decode(errors="replace") for k, v in meta.items()
            if k.startswith(META_PREFIX.encode())}


def read_columns(path: Path, columns=None) -> pa.Table:
    """A shard's columns. A file that passed its size and sha256 checks can still be damaged where the manifest was
    forged to match it; that is a CacheError like any other damage."""
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise CacheError("shard_unreadable", f"shard {path.name} is not a readable Parquet file ({e})", remedy=RERUN,
                         shard=path.name) from None


# ---------------------------------------------------------------------------------------------------------------
# reading and verifying


def _shard_path(root: Path, name) -> Path:
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


@dataclass
class Cache:
    root: Path
    manifest: dict

    @property
    def stamps(self) -> dict:
        return self.manifest["stamps"]

    @property
    def encoding(self) -> EncodingConfig:
        return EncodingConfig.from_dict(self.manifest["encoding"])

    @property
    def shard_paths(self) -> list[Path]:
        return [self.root / s["file"] for s in self.manifest["shards"]]

    def read(self, columns=None) -> pa.Table:
        return pa.concat_tables([read_columns(p, columns) for p in self.shard_paths])

    def check_stamps(self, *, model_hash=None, tokenizer_hash=None, encoding: EncodingConfig | None = None,
                     tokenizer_parts: dict | None = None):
        """Compare the cache's stamps with the caller's; raise StampMismatch naming the first that differs."""
        remedies = {
            "model_hash": "pass the reference the cache was computed from (--ref-model / --ref-model-hash), or "
            "re-run precompute-ref with this model into a new --out",
            "tokenizer_hash": "use the tokenizer the cache was made with (including its chat template), or re-run "
            "precompute-ref with this tokenizer into a new --out",
            "encoding": "drop the conflicting encoding option so the cache's value is used, or re-run precompute-ref "
            "with the new encoding into a new --out",
        }
        wanted = {"model_hash": model_hash, "tokenizer_hash": tokenizer_hash}
        for stamp, value in wanted.items():
            if value is not None and value != self.stamps[stamp]:
                raise StampMismatch(
                    stamp,
                    f"{stamp} mismatch: the cache {self.root} was not computed with this "
                    + ("model" if stamp == "model_hash" else "tokenizer" + self._tokenizer_difference(tokenizer_parts)),
                    remedy=remedies[stamp],
                    expected=value,
                    found=self.stamps[stamp],
                )
        if encoding is not None and encoding != self.encoding:
            raise StampMismatch(
                "encoding",
                f"encoding config mismatch with the cache {self.root}",
                remedy=remedies["encoding"],
                expected=encoding.to_json(),
                found=self.encoding.to_json(),
            )

    def _tokenizer_difference(self, parts: dict | None) -> str:
        recorded = (self.manifest.get("tokenizer") or {}).get("parts")
        if not parts:
            return ""
        if not isinstance(recorded, dict):
            return " (the cache records no per-part tokenizer hashes, so what differs cannot be named)"
        differ = [k for k in parts if recorded.get(k) != parts[k]]
        return f"; it differs in: {', '.join(differ)}" if differ else ""

    def check_rows(self, expected: dict[str, str]) -> None:
        """Every expected row (id -> mask checksum from the caller's own encoding) must be cached, identically."""
        table = self.read(["id", "mask_checksum"])
        cached = dict(zip(table.column("id").to_pylist(), table.column("mask_checksum").to_pylist()))
        missing = [i for i in expected if i not in cached]
        if missing:
            raise CacheError(
                "rows_missing",
                f"{len(missing)} of {len(expected)} data rows are not in the cache {self.root}; first ids: "
                + ", ".join(missing[:5]),
                remedy="precompute these rows too: re-run precompute-ref over the full data into a new --out",
            )
        for rid, checksum in expected.items():
            if cached[rid] != checksum:
                where = _row_locations(self)  # only to name the place in the error
                raise StampMismatch(
                    "mask_checksum",
                    f"mask checksum mismatch for row {rid!r}: its token ids differ from the cached ones (data edited, "
                    "or a different tokenizer or encoding)",
                    remedy=RERUN,
                    expected=checksum,
                    found=cached[rid],
                    shard=where[rid][0],
                    row=where[rid][1],
                )


def _row_locations(cache: Cache) -> dict[str, tuple[str, int]]:
    out = {}
    for path in cache.shard_paths:
        for i, rid in enumerate(read_columns(path, ["id"]).column("id").to_pylist()):
            out[rid] = (path.name, i)
    return out


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


def open_cache(root, *, verify_files: bool = True) -> Cache:
    """Open a cache and check it against its own manifest (schemas/rules.py, `cache_findings`); raise the first
    finding as a CacheError. verify_files=False skips the shards' sha256 (--fast-verify)."""
    from .rules import cache_findings

    root = Path(root)
    if not root.is_dir():
        raise CacheError("incomplete", f"{root} is not a directory", remedy="pass the --out directory of precompute-ref")
    cache = Cache(root, read_manifest(root))
    for finding in cache_findings(root, cache.manifest, hash_files=verify_files):
        raise finding.error()
    return cache


def read_cache(root, *, verify_files: bool = True):
    """The cache's rows as a polars LazyFrame over its shards in manifest order, after the manifest, shard sizes,
    sha256s and stamps have been verified (open_cache). Reading the folder directly needs a glob, because manifest.json
    sits beside the shards: pl.scan_parquet(f"{root}/*.parquet")."""
    import polars as pl

    cache = open_cache(root, verify_files=verify_files)
    return pl.scan_parquet([str(p) for p in cache.shard_paths])
