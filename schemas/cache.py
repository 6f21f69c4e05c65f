"""The reader: a cache opened once. `open_cache` reads the manifest, each shard's footer once and its id and
mask_checksum columns once, judges them by the rules of schemas/rules.py (`cache_findings`) and raises the first
finding as a CacheError; the `Cache` it returns keeps what it read, so comparing it with a caller
(`rules.use_findings`) reads nothing again, and `Cache.scan` reads each further column once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from storage import places

from . import format as fmt
from . import history
from .encoding import EncodingConfig
from .findings import CacheError  # noqa: F401  (re-exported)
from .rules import INDEX, cache_findings  # INDEX: the columns open_cache reads (the checksum rules need them)


@dataclass
class Cache:
    root: Path  # or a places.StorePath
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
    def top_k(self) -> int:
        """K of a top-k cache (computation.top_k), 0 without one."""
        return fmt.top_k_of(self.manifest.get("computation"))

    @property
    def shard_paths(self) -> list[Path]:
        return [self.root / s["file"] for s in self.manifest["shards"]]

    def scan(self, columns=None) -> pa.Table:
        """`columns` (default: every column of a shard) beside the index, each shard read once, in manifest order;
        the index's columns are not read again."""
        names = fmt.shard_schema(self.top_k).names
        extra = [c for c in (columns or names) if c not in INDEX]
        tables = [self._columns(entry["file"], p, extra) for entry, p in zip(self.manifest["shards"], self.shard_paths)]
        table = pa.concat_tables(tables) if tables else pa.table({c: [] for c in extra})
        for name in self.index.column_names:
            table = table.append_column(name, self.index.column(name))
        return table

    @property
    def columns(self) -> list[fmt.Column]:
        """The shard columns of this cache; their `logical` types are what every reader here returns."""
        return fmt.shard_columns(self.top_k)

    def rows(self, columns=None):
        """The current version's rows, shard by shard in manifest order, as pyarrow tables of `columns` (default:
        every shard column, in the shard's order) in their logical types: log-probs as float32 log-probs (a top-k
        cache's 16-bit codes decoded by `format.read_columns`, the one codec), top-k ids and log-probs as one list per
        token. What every public reader (`read_cache`, `to_dataset`) reads; the stored form stays below it."""
        names = [c.name for c in self.columns]
        wanted = list(names if columns is None else columns)
        unknown = [c for c in wanted if c not in names]
        if unknown:
            raise KeyError(f"no column {unknown[0]!r} in this cache; its columns: {', '.join(names)}")
        extra = [c for c in wanted if c not in INDEX]
        start = 0
        for entry, path in zip(self.manifest["shards"], self.shard_paths):
            index = self.index.slice(start, entry["rows"])  # (read and checked by open_cache)
            start += entry["rows"]
            table = self._columns(entry["file"], path, extra) if extra else None
            yield pa.table([index.column(c) if c in INDEX else table.column(c) for c in wanted],
                           schema=self._schema(wanted))

    def lazy(self):
        """`rows` as a polars LazyFrame: read when collected, shard by shard, only the columns the query selects."""
        import polars as pl
        from polars.io.plugins import register_io_source

        names = [c.name for c in self.columns]

        def source(with_columns, predicate, n_rows, batch_size):
            wanted = names if with_columns is None else list(with_columns)
            left = n_rows
            for table in self.rows(wanted or names[:1]):  # (no column asked for: the rows are still counted)
                if left is not None and left <= 0:
                    return
                frame = pl.from_arrow(table)
                if predicate is not None:
                    frame = frame.filter(predicate)
                if left is not None:
                    frame = frame.head(left)
                    left -= frame.height
                yield frame if wanted else frame.select([])

        return register_io_source(source, schema=pl.from_arrow(self._schema(names).empty_table()).schema)

    def _schema(self, names: list[str]) -> pa.Schema:
        logical = {c.name: c.logical for c in self.columns}
        return pa.schema([(n, logical[n]) for n in names])

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
    root = places.location(root)
    if not places.is_remote(root) and not root.is_dir():  # a prefix without a manifest is refused below
        raise fmt.no_manifest(root)
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
    """The current version's rows as a polars LazyFrame, after the manifest, shard sizes, sha256s and stamps have
    been verified (open_cache). `root`: a folder or an object-store URL (storage/places.py). Every column is in its
    logical type, the same values and types as `open_cache(root).scan()`: per-token log-probs as float32 log-probs,
    a top-k cache's top-k ids and log-probs as one list of K per token (decoded here: the shards store them flat,
    the log-probs as 16-bit codes). Only the shards the manifest lists are read, shard by shard, with the columns
    the query selects. Never read a cache's folder with a `*.parquet` glob: after `precompute-ref --update` it also
    holds the earlier versions' shards, and the raw files hold a top-k cache's storage codes, not log-probs."""
    return open_cache(root, verify_files=verify_files).lazy()


def to_dataset(root, *, verify_files: bool = True):
    """The current version's rows as a `datasets.Dataset` (in memory), after verifying them: the columns and values
    of `read_cache`. `datasets.load_dataset(CACHE_DIR)` through the dataset card reads the shards as stored and so
    leaves out the columns whose stored form is not their value (a top-k cache's top-k ids and log-probs)."""
    import datasets

    cache = open_cache(root, verify_files=verify_files)
    tables = list(cache.rows())
    table = pa.concat_tables(tables) if tables else cache._schema([c.name for c in cache.columns]).empty_table()
    return datasets.Dataset(datasets.table.InMemoryTable(table))
