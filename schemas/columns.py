"""What a cache's shard holds: THE list of its columns (`shard_columns`), each with its logical type (what
`schemas.format.read_columns` returns) and its stored one; the Arrow list arrays a column's values are stored as (one
list per row, K per token stored flat); and `TokenScores`, the one shape of a completion's per-token scores. The
writer, its encodings, the reader and the schema all derive from `shard_columns` (schemas/format.py); FORMAT.md's
tables describe them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


SIDES = ("chosen", "rejected")
PER_TOKEN = ("logps",)  # per-token scores every cache holds: shard columns f"{side}_{suffix}"
TOP_K_COLUMNS = ("top_ids", "top_logps", "tail")  # and those a cache made with --top-k K > 0 holds


@dataclass(frozen=True)
class Column:
    """One shard column: `logical` is what `read_columns` returns, `physical` what the file stores (they differ
    only where storage is chosen for size); `dictionary`: Parquet dictionary encoding of its values, `split`:
    BYTE_STREAM_SPLIT encoding of its values (floats), `nested`: values are stored flat, K per token."""

    name: str
    logical: pa.DataType
    physical: pa.DataType | None = None
    dictionary: bool = False
    split: bool = False
    nested: bool = False
    codec: str | None = None  # "logp16": log-probs as 16-bit codes (encode_logps)
    level: int | None = None  # a zstd level other than the writer's default (1)

    @property
    def stored(self) -> pa.DataType:
        return self.physical or self.logical


TOP_K_LEVEL = 9  # zstd level of the top-k ids and log-probs: 4-5% smaller than 1, about 4 us per token to write


def _ints():
    return pa.list_(pa.int32())


def _per_token(suffix: str) -> list[Column]:
    """The chosen and rejected column of one per-token score."""
    kinds = {
        "logps": dict(logical=pa.list_(pa.float32())),
        # ids: dictionary-encoded (indices bit-packed to the distinct ids of a row group), K per token stored flat
        "top_ids": dict(logical=pa.list_(pa.list_(pa.int32())), physical=pa.list_(pa.int32()), dictionary=True,
                        nested=True, level=TOP_K_LEVEL),
        # log-probs: 16-bit codes, error <= 2**-12 nats down to -24 (encode_logps; FORMAT.md: what it does to a
        # KL), byte-split
        "top_logps": dict(logical=pa.list_(pa.list_(pa.float32())), physical=pa.list_(pa.uint16()), split=True,
                          nested=True, codec="logp16", level=TOP_K_LEVEL),
        "tail": dict(logical=pa.list_(pa.float32())),
    }
    return [Column(f"{side}_{suffix}", **kinds[suffix]) for side in SIDES]


def shard_columns(top_k: int = 0) -> list[Column]:
    """THE list of a shard's columns, for a cache made with `--top-k top_k` (0: none of the top-k columns)."""
    return [
        Column("id", pa.string()),
        *[Column(f"{part}_input_ids", _ints(), dictionary=True) for part in ("prompt", *SIDES)],
        *[c for suffix in per_token_suffixes(top_k) for c in _per_token(suffix)],
        Column("chosen_logp", pa.float64()),
        Column("rejected_logp", pa.float64()),
        Column("mask_checksum", pa.string()),
    ]


def per_token_suffixes(top_k: int = 0) -> tuple[str, ...]:
    """The per-token scores of a cache made with --top-k top_k."""
    return PER_TOKEN + (TOP_K_COLUMNS if top_k else ())


def per_token_columns(top_k: int = 0) -> list[str]:
    """The shard's per-token columns (f"{side}_{suffix}"), aligned token for token with its completion ids."""
    return [f"{side}_{suffix}" for suffix in per_token_suffixes(top_k) for side in SIDES]


def shard_schema(top_k: int = 0) -> pa.Schema:
    """The schema stored in a shard of a cache made with --top-k top_k."""
    return pa.schema([(c.name, c.stored) for c in shard_columns(top_k)])


SHARD_SCHEMA = shard_schema(0)


@dataclass
class TokenScores:
    """One shape for the per-token scores of a completion (or of a flat batch of them): `logps` [T] and, with a
    top-k, `top_ids` [T, K], `top_logps` [T, K] and `tail` [T]. Fields are PER_TOKEN + TOP_K_COLUMNS; numpy or
    torch values alike."""

    logps: object
    top_ids: object = None
    top_logps: object = None
    tail: object = None

    def fields(self) -> dict:
        """The scores it holds, by suffix."""
        return {k: getattr(self, k) for k in PER_TOKEN + TOP_K_COLUMNS if getattr(self, k) is not None}

    def map(self, fn) -> TokenScores:
        """Every score it holds, through `fn` (a slice, a device move, a conversion)."""
        return TokenScores(**{k: fn(v) for k, v in self.fields().items()})

    @classmethod
    def join(cls, parts: list[TokenScores], cat) -> TokenScores:
        """Parts of one completion (or batch), token after token; `cat`: numpy's or torch's concatenate."""
        return cls(**{k: cat([p.fields()[k] for p in parts]) for k in parts[0].fields()})


def _list_array(values: list, value_type) -> pa.ListArray:
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([np.asarray(v) for v in values]) if values else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(value_type.to_pandas_dtype())))


def _nested_array(values: list, value_type) -> pa.ListArray:
    """Per-row [T, K] values stored flat (T x K per row)."""
    return _list_array([np.asarray(v).reshape(-1) for v in values], value_type)
