"""Everything train-dpo checks before it uses a single cached value, and the join of cached values to rows.

Order: cache manifest and files, model hash, tokenizer hash, encoding config, then every training row is encoded
here with the cache's encoding and its mask checksum compared with the cached one. Only then are the cached
per-token log-probs read and joined to the rows by id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import polars as pl
import pyarrow as pa

from runtime.data import Encoded, load_rows, usable_rows
from runtime.errors import JobError
from schemas.encoding import EncodingConfig
from schemas.format import Cache, CacheError, StampMismatch, open_cache, read_columns
from schemas.rules import value_findings
from schemas.stamps import model_hash, tokenizer_hash, tokenizer_parts


@dataclass
class Verified:
    """Rows ready for training: ids and token ids from our own encoding, reference values from the cache."""

    table: pa.Table  # id, prompt_ids, chosen_ids, rejected_ids[, ref_chosen_logps, ref_rejected_logps]
    fingerprint: str
    report: dict


@dataclass
class EncodedOnly:
    """Rows for a live reference: encoded, not verified (no cache to verify them against)."""

    table: pa.Table  # id, prompt_ids, chosen_ids, rejected_ids
    fingerprint: str
    report: dict  # rows and mode only


def reference_hash(model_dir: str, ref_model: str | None, ref_model_hash: str | None) -> str:
    """The model hash the cache must carry: the declared reference, else the policy's starting checkpoint."""
    hashed = model_hash(ref_model) if ref_model else None
    return declared_reference(ref_model, hashed, ref_model_hash) or model_hash(model_dir)


def declared_reference(ref_model: str | None, hashed: str | None, ref_model_hash: str | None) -> str | None:
    """The reference declared by --ref-model (`hashed`: its model hash) and/or --ref-model-hash, None when neither
    is given. They are two declarations of one reference: where they disagree, neither is taken."""
    if hashed and ref_model_hash and hashed != ref_model_hash:
        raise JobError(
            f"--ref-model {ref_model} and --ref-model-hash disagree on the reference: the folder hashes to {hashed}, "
            f"--ref-model-hash declares {ref_model_hash}; pass only the one that names the model the cache was "
            "computed with (precompute-ref records it as stamps.model_hash in the cache's manifest.json)")
    return hashed or ref_model_hash


def check_encoding(cache: Cache, requested: dict) -> EncodingConfig:
    """The cache's encoding config; a conflicting value given on the command line is an error."""
    recorded = cache.encoding
    for key, value in requested.items():
        if value is not None and getattr(recorded, key) != value:
            raise StampMismatch(
                "encoding",
                f"--{key.replace('_', '-')} {value} conflicts with the cache {cache.root}, made with "
                f"{key}={getattr(recorded, key)}",
                remedy="drop the option (the cache's value is used), or re-run precompute-ref with it into a new --out",
                expected=value,
                found=getattr(recorded, key),
            )
    return recorded


def check_values(cache: Cache, ids: list[str]) -> pa.Table:
    """Read the cached values of `ids` and check them: one value per completion token, sums equal to the
    per-token values, every value finite and <= 0."""
    want = pl.DataFrame({"id": ids, "order": range(len(ids))})
    frames = []
    for path in cache.shard_paths:
        # Read with pyarrow, which refuses a damaged file (one behind a forged manifest: the file hash matched) with
        # a CacheError; polars' own reader, and polars given metadata that is not UTF-8, can panic on such a file.
        shard = pl.from_arrow(read_columns(path, ["id", "chosen_input_ids", "rejected_input_ids", "chosen_logps",
                                                  "rejected_logps", "chosen_logp", "rejected_logp"])
                              .replace_schema_metadata(None))
        shard = shard.with_row_index("row").with_columns(pl.lit(path.name).alias("shard"))
        frames.append(shard.join(want, on="id", how="inner"))
    values = pl.concat(frames).sort("order")
    for finding in value_findings(values):  # the value rules of schemas/rules.py; the first one found is raised
        raise finding.error()
    return values.select(
        pl.col("chosen_logps").alias("ref_chosen_logps"), pl.col("rejected_logps").alias("ref_rejected_logps")
    ).to_arrow()


def encoded_table(encoded: Encoded) -> pa.Table:
    return pa.table({
        "id": encoded.ids,
        "prompt_ids": [p.prompt_ids for p in encoded.pairs],
        "chosen_ids": [p.chosen_ids for p in encoded.pairs],
        "rejected_ids": [p.rejected_ids for p in encoded.pairs],
    })


def _explained(error: CacheError, cache: Cache, split: str, encoded: Encoded) -> CacheError:
    """Rows missing or differing: say why when the cache's record shows it (another split, another data format)."""
    source = cache.manifest.get("source") or {}
    hints = []
    if source.get("split") not in (None, split):
        hints.append(f"the cache holds split {source['split']!r}" + (" (the eval split's cache)" if source["split"] in (
            "test", "eval", "validation") else "") + f", not {split!r}: pass it as --eval-ref-cache, and the cache of "
            f"split {split!r} as --ref-cache")
    formats = source.get("formats")
    if isinstance(formats, dict) and formats and encoded.formats:
        cached_templated = formats.get("conversational", 0) > 0
        if cached_templated != encoded.templated:
            hints.append("the chat-template rendering differs: the cache's rows are "
                         f"{', '.join(sorted(formats))} and these are {', '.join(sorted(encoded.formats))} "
                         "(conversational rows are rendered with the chat template, standard ones are not); use the "
                         "data the cache was made from")
    if not hints:
        return error
    return type(error)(error.kind, error.message + "; " + "; ".join(hints), remedy=error.remedy,
                       expected=error.expected, found=error.found, shard=error.shard, row=error.row)


def verify_and_join(*, tokenizer, model_dir, data, split, cache_dir, ref_model=None, ref_model_hash=None,
                    expected_model_hash=None,
                    encoding_request=None, on_bad_row="error", verify_files=True, log=print) -> Verified:
    t0 = time.perf_counter()
    cache = open_cache(cache_dir, verify_files=verify_files)
    t_files = time.perf_counter() - t0
    expected_model = expected_model_hash or reference_hash(model_dir, ref_model, ref_model_hash)
    encoding = check_encoding(cache, encoding_request or {})
    cache.check_stamps(model_hash=expected_model, tokenizer_hash=tokenizer_hash(tokenizer), encoding=encoding,
                       tokenizer_parts=tokenizer_parts(tokenizer))
    if encoding.add_bos is True:
        log(f"note: {cache.root} was made with BOS always prepended (before refcache followed the tokenizer); "
            "training uses the same ids")
    source = load_rows(data, split)
    encoded = usable_rows(source, tokenizer, encoding, on_bad_row, data)
    try:
        cache.check_rows(dict(zip(encoded.ids, (p.mask_checksum for p in encoded.pairs))))
    except CacheError as e:
        raise _explained(e, cache, split, encoded) from None
    table = encoded_table(encoded)
    for name, column in zip(("ref_chosen_logps", "ref_rejected_logps"), check_values(cache, encoded.ids).columns):
        table = table.append_column(name, column)
    report = {
        "cache": str(cache.root),
        "rows": len(encoded.ids),
        "skipped": encoded.skipped_by_reason,
        "file_hashes": "sha256 checked" if verify_files else "skipped (--fast-verify)",
        "files_s": round(t_files, 3),
        "total_s": round(time.perf_counter() - t0, 3),
        "stamps": cache.stamps,
    }
    log(f"verified {cache.root}: {report['rows']} rows, model/tokenizer/mask stamps match "
        f"({report['total_s']:.2f} s; file hashes {report['files_s']:.2f} s)")
    return Verified(table, source.fingerprint, report)


def encode_only(*, tokenizer, data, split, encoding: EncodingConfig, on_bad_row="error") -> EncodedOnly:
    """Rows for live-reference mode (no cache to verify against)."""
    source = load_rows(data, split)
    encoded = usable_rows(source, tokenizer, encoding, on_bad_row, data)
    return EncodedOnly(encoded_table(encoded), source.fingerprint, {"rows": len(encoded.ids), "mode": "live reference"})
