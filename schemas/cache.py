"""The reader: a cache opened once. `open_cache` reads the manifest, each shard's footer once and its id and
mask_checksum columns once, judges them by the rules of schemas/rules.py (`cache_findings`) and raises the first
finding as a CacheError; the `Cache` it returns keeps what it read, so comparing it with a caller
(`rules.use_findings`) reads nothing again, and `Cache.scan` reads each further column once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from . import format as fmt
from . import history
from . import store
from .encoding import EncodingConfig
from .findings import CacheError
from .rules import cache_findings

INDEX = ("id", "mask_checksum")  # the columns open_cache reads (the checksum rules need them)


@dataclass
class Cache:
    root: Path  # or a store.StorePath
    manifest: dict
    index: pa.Table  # id, mask_checksum, shard, row of every cached row, in manifest order
    # shard -> the columns open_cache(keep=) read from an object's verified bytes (a cache on a store), which scan
    # takes from here rather than fetching them again
    held: dict = field(default_factory=dict)
    # which version of the cache `manifest` is (schemas/history.py version_report: version, file, current, line)
    version: dict = field(default_factory=dict)

    @property
    def stamps(self) -> dict:
        return self.manifest["stamps"]

    @property
    def encoding(self) -> EncodingConfig:
        return EncodingConfig.from_dict(self.manifest["encoding"])

    @property
    def shard_paths(self) -> list[Path]:
        return [self.root / s["file"] for s in self.manifest["shards"]]

    def scan(self, columns=None) -> pa.Table:
        """`columns` (default: every column of a shard) beside the index, each shard read once, in manifest order;
        the index's columns are not read again."""
        names = fmt.shard_schema(fmt.top_k_of(self.manifest.get("computation"))).names
        extra = [c for c in (columns or names) if c not in INDEX]
        tables = [self._columns(entry["file"], p, extra) for entry, p in zip(self.manifest["shards"], self.shard_paths)]
        table = pa.concat_tables(tables) if tables else pa.table({c: [] for c in extra})
        for name in self.index.column_names:
            table = table.append_column(name, self.index.column(name))
        return table

    def _columns(self, name: str, path, columns: list[str]) -> pa.Table:
        held = self.held.get(name)
        if held is not None and all(c in held.column_names for c in columns):
            return held.select(columns)
        return fmt.read_columns(path, columns).replace_schema_metadata(None)


def open_cache(root, *, verify_files: bool = True, keep=None, version: int | None = None) -> Cache:
    """Open a cache and check it against its own manifest (schemas/rules.py, `cache_findings`); raise the first
    finding as a CacheError. verify_files=False skips the shards' sha256 (--fast-verify). `keep(manifest)`: columns
    the caller will scan; on a store they are read from the bytes that were hashed, so no shard is fetched twice.
    `version`: an earlier version of an updated cache (--cache-version N: its kept manifest, schemas/history.py),
    refused naming the versions kept when it is not one of them; default the current one."""
    root = store.location(root)
    if not store.is_remote(root) and not root.is_dir():  # a prefix without a manifest is refused below
        raise CacheError("incomplete", f"{root} is not a directory", remedy="pass the --out directory of precompute-ref")
    current = manifest = fmt.read_manifest(root)
    name = history.CURRENT
    if version is not None:
        _, name, manifest = history.by_number(root, current, version)
    read: dict[str, pa.Table] = {}
    for finding in cache_findings(root, manifest, hash_files=verify_files, read=read,
                                  keep=keep(manifest) if keep else ()):
        raise finding.error()
    parts, held = [], {}
    for entry in manifest["shards"]:
        table = read[entry["file"]].replace_schema_metadata(None)
        if table.num_columns > len(INDEX):
            held[entry["file"]] = table.drop_columns(list(INDEX))
            table = table.select(list(INDEX))
        parts.append(table.append_column("shard", pa.array([entry["file"]] * table.num_rows, pa.string()))
                     .append_column("row", pa.array(range(table.num_rows), pa.uint32())))
    schema = pa.schema([("id", pa.string()), ("mask_checksum", pa.string()), ("shard", pa.string()),
                        ("row", pa.uint32())])
    return Cache(root, manifest, pa.concat_tables(parts) if parts else schema.empty_table(), held,
                 history.version_report(manifest, name, current))


def read_cache(root, *, verify_files: bool = True):
    """The cache's rows as a polars LazyFrame over its shards in manifest order, after the manifest, shard sizes,
    sha256s and stamps have been verified (open_cache). `root`: a folder or an object-store URL (schemas/store.py).
    Reading the folder directly needs a glob, because manifest.json sits beside the shards:
    pl.scan_parquet(f"{root}/*.parquet")."""
    import polars as pl

    cache = open_cache(root, verify_files=verify_files)
    if store.is_remote(cache.root):  # pyarrow's reader on the store: only the columns the query selects are fetched
        import pyarrow.dataset as ds

        return pl.scan_pyarrow_dataset(ds.dataset([p.key for p in cache.shard_paths], format="parquet",
                                                  filesystem=cache.root.fs))
    return pl.scan_parquet([str(p) for p in cache.shard_paths])
