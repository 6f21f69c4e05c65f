"""Everything train-dpo checks before it uses a single cached value, and the join of cached values to rows.

One call into the rules (schemas/rules.py) after the cache is opened (schemas/cache.py: manifest, files, footers,
checksums): the encoding options asked for, model hash, tokenizer hash, then every training row encoded here with
the cache's encoding and its mask checksum compared with the cached one. Then one scan of the columns it trains on
(`check_values`), every cached per-token column (`chosen_X` / `rejected_X`: log-probs, and a top-k cache's ids,
log-probs and tail) joined to the rows by id as `ref_chosen_X` / `ref_rejected_X`.
"""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass

import polars as pl
import pyarrow as pa

from runtime.data import DataError, Encoded, load_rows, recorded_config, usable_rows
from runtime.errors import JobError
from runtime.terminal import echo
from storage.quoting import shell_word
from runtime import remedies
from schemas import history
from schemas import run_manifest as rm
from schemas.encoding import EncodingConfig
from schemas.cache import Cache, open_cache
from schemas.findings import CacheError
from schemas.columns import per_token_columns
from schemas.format import top_k_of
from schemas.rules import top_k_findings, use_findings, value_findings
from schemas.stamps import model_hash, tokenizer_hash, tokenizer_parts


@dataclass
class Verified:
    """Rows ready for training: ids and token ids from our own encoding, reference values from the cache."""

    table: pa.Table  # id, prompt_ids, chosen_ids, rejected_ids[, ref_chosen_X, ref_rejected_X per cached column]
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


# train-dpo's remedies for what the rules find (schemas/rules.py, use_findings); the rules' own are precompute-ref's
REMEDIES = {
    "model_hash": "pass the reference the cache was computed from (--ref-model / --ref-model-hash), or re-run "
    "precompute-ref with this model into a new --out",
    "tokenizer_hash": "use the tokenizer the cache was made with (including its chat template), or re-run "
    "precompute-ref with this tokenizer into a new --out",
    "encoding": "drop the option (the cache's value is used), or re-run precompute-ref with it into a new --out",
}  # rows missing or changed: runtime/remedies.py, with the cache, data and model of this run (_remedied)
TRAINED_ON = ("chosen_input_ids", "rejected_input_ids", "chosen_logps", "rejected_logps", "chosen_logp",
              "rejected_logp")  # what the value rules read; the per-token columns joined are the cache's own


def cached_columns(cache: Cache) -> list[str]:
    """The per-token columns of the cache (schemas.format.per_token_columns of its top_k), joined as ref_<name>."""
    return per_token_columns(cache.top_k)


def scanned_columns(manifest: dict) -> list[str]:
    """Every column check_values reads: what the value rules read, and the per-token columns joined."""
    return list(dict.fromkeys([*TRAINED_ON, *per_token_columns(top_k_of(manifest.get("computation")))]))


def option_name(key: str) -> str:
    return f"--{key.replace('_', '-')}"


def check_values(cache: Cache, ids: list[str]) -> pa.Table:
    """The one scan of the columns train-dpo uses: the cached values of `ids`, checked by the value rules (one
    value per completion token, sums equal to the per-token values, every value finite and <= 0) and, in a top-k
    cache, the top-k rules (schemas/rules.py top_k_findings, as audit-ref runs them). Returns every
    per-token column of the cache as ref_<column>, in the order of `ids`."""
    want = pl.DataFrame({"id": ids, "order": range(len(ids))})
    # Read with pyarrow (Cache.scan), which refuses a damaged file (one behind a forged manifest: the file hash
    # matched) with a CacheError; polars' own reader, and polars given metadata that is not UTF-8, can panic on one.
    columns = cached_columns(cache)
    values = pl.from_arrow(cache.scan(scanned_columns(cache.manifest))).join(want, on="id", how="inner").sort("order")
    k = cache.top_k
    tokenizer = cache.manifest.get("tokenizer") or {}
    found = value_findings(values)  # the value rules of schemas/rules.py; the first one found is raised
    if k:  # the top-k rules too: ids in the vocabulary and unique, sorted, mass plus tail 1, the dataset token
        found += top_k_findings(values, k, tokenizer.get("size") if isinstance(tokenizer, dict) else None,
                                str(cache.root))
    for finding in found:
        raise finding.error()
    return values.select([pl.col(c).alias(f"ref_{c}") for c in columns]).to_arrow()


def encoded_table(encoded: Encoded) -> pa.Table:
    return pa.table({
        "id": encoded.ids,
        "prompt_ids": [p.prompt_ids for p in encoded.pairs],
        "chosen_ids": [p.chosen_ids for p in encoded.pairs],
        "rejected_ids": [p.rejected_ids for p in encoded.pairs],
    })


def _explained(error: CacheError, cache: Cache, split: str, encoded: Encoded, data, cache_option: str,
               model=None) -> CacheError:
    """Rows missing or differing: say why when the cache's record shows it (another split, another data format), and
    then that reason's remedy in place of the generic one (re-running precompute-ref over these rows would be
    another cache, not the one this run is missing). A single data file has no splits: its split says nothing."""
    source = cache.manifest.get("source") or {}
    facts, ways = [], []
    if source.get("split") not in (None, split) and not _one_file(data):
        facts.append(f"the cache holds split {source['split']!r}" + (" (the eval split's cache)" if source["split"] in (
            "test", "eval", "validation") else "") + f", not {split!r}")
        if cache_option == "--eval-ref-cache":  # a cache of the other split given for the eval rows
            ways.append(remedies.eval_cache(model, data, split))
        else:
            ways.append(f"pass it as --eval-ref-cache, and the cache of split {split!r} as --ref-cache "
                            f"(precompute-ref --split {split} makes one)")
    formats = source.get("formats")
    if isinstance(formats, dict) and formats and encoded.formats:
        cached_templated = formats.get("conversational", 0) > 0
        if cached_templated != encoded.templated:
            facts.append("the chat-template rendering differs: the cache's rows are "
                         f"{', '.join(sorted(formats))} and these are {', '.join(sorted(encoded.formats))} "
                         "(conversational rows are rendered with the chat template, standard ones are not)")
            ways.append("use the data the cache was made from")
    if not facts:
        return error
    return type(error)(error.kind, error.message + "; " + "; ".join(facts), remedy="; ".join(ways),
                       expected=error.expected, found=error.found, shard=error.shard, row=error.row)


def _one_file(data) -> bool:
    return data is not None and Path(str(data)).is_file()


def _remedied(error: CacheError, cache: Cache, cache_arg, data, model, split: str, missing: list[str],
              encoded, resuming: str | None = None, cache_option: str = "--ref-cache",
              serves_training: bool = False) -> CacheError:
    """Rows missing or changed, answered in the one remedy vocabulary (runtime/remedies.py): rows an update of the
    cache removed name the version that removed them and the --cache-version that holds them; other rows the cache
    lacks, `precompute-ref --update`; rows edited under an id the cache holds, `--update --replace-changed`, unless
    an earlier version holds them as they are here (an update replaced them since: said in words, and that version's
    --cache-version; `resuming`: the checkpoint resumed, whose record names the version it trained on)."""
    if serves_training and error.kind in ("rows_missing", "mask_checksum"):  # never --update it to the eval rows
        return type(error)(error.kind, error.message, remedy=remedies.eval_cache(model, data, split, shared=True),
                           expected=error.expected, found=error.found, shard=error.shard, row=error.row,
                           sides=error.sides)
    if _one_file(data):  # the update names the split the cache records (a single file's is only a label)
        split = (cache.manifest.get("source") or {}).get("split") or split
    if error.kind == "rows_missing":
        removing, holding = history.removed_by(cache.root, cache.manifest, missing)
        if removing and cache_option != "--ref-cache":  # --cache-version is --ref-cache's: this cache is current
            message = (f"{error.message}; version{'s' * (len(removing) > 1)} {', '.join(map(str, removing))} of the "
                       "cache removed them (precompute-ref --update)")
            return type(error)(error.kind, message, remedy=remedies.rows_missing(cache_arg, data, model, split),
                               expected=error.expected, found=error.found, shard=error.shard, row=error.row)
        remedy = (remedies.rows_removed(removing, holding) if removing else
                  remedies.rows_missing(cache_arg, data, model, split))
    elif error.kind == "mask_checksum":
        holding = _holding_as_edited(cache, cache_arg, encoded)
        if holding:  # in words: which rows an update replaced, and the version that holds them as this data has them
            said = _replaced_in_words(*holding, resuming, cache_arg)
            return type(error)(error.kind, said, remedy=remedies.rows_replaced(*holding[:2]), shard=error.shard,
                               row=error.row)
        current = _current_holds_as_edited(cache, cache_arg, encoded)
        if current:  # --cache-version N over data an update brought the cache to since: not another update
            remedy = remedies.rows_in_current(cache.version.get("version"), current, resuming is not None)
        else:
            remedy = remedies.rows_changed(cache_arg, data, model, split)
    else:
        return error
    return type(error)(error.kind, error.message, remedy=remedy, expected=error.expected, found=error.found,
                       shard=error.shard, row=error.row, sides=error.sides)


def _replaced_in_words(replacing: list[int], holding: int, rows: list[str], resuming: str | None, cache_arg) -> str:
    """The refusal of rows an update replaced: "row 'x' was replaced in version 2 of the cache (...); this checkpoint
    (...) trained on version 1, which holds it as this data has it" (no checksums: they say nothing more)."""
    named = ", ".join(map(repr, rows[:5])) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
    one = len(rows) == 1
    versions = f"version{'s' if len(replacing) > 1 else ''} {', '.join(map(str, replacing))}"
    said = (f"row{'' if one else 's'} {named} {'was' if one else 'were'} replaced in {versions} of the cache "
            "(precompute-ref --update --replace-changed)")
    held = f"holds {'it' if one else 'them'} as this data has {'it' if one else 'them'}"
    if _trained_on(resuming, cache_arg) == holding:
        return f"{said}; this checkpoint ({resuming}) trained on version {holding}, which {held}"
    return f"{said}; version {holding} of the cache {held}"


def _trained_on(checkpoint: str | None, cache_arg) -> int | None:
    """The version of this cache a checkpoint's record says it trained on (None: not a resume, not recorded, or the
    checkpoint's --ref-cache is another cache: this may be the --eval-ref-cache)."""
    if not checkpoint:
        return None
    try:
        cache = rm.read_checkpoint_record(checkpoint).get("cache")
    except rm.RunManifestError:
        return None
    if not isinstance(cache, dict) or cache.get("path") != rm.absolute(cache_arg):
        return None
    return cache.get("version") if isinstance(cache.get("version"), int) else None


def _holding_as_edited(cache: Cache, cache_arg, encoded) -> tuple[list[int], int, list[str]] | None:
    """(the versions that replaced them, an earlier version, the rows) when the rows this data has otherwise than the
    cache were replaced by an update of the cache, and that earlier version holds every one of them as this data has
    them."""
    cached = _checksums(cache)
    mine = {i: p.mask_checksum for i, p in zip(encoded.ids, encoded.pairs)}
    changed = [i for i, check in mine.items() if cached.get(i) not in (None, check)]
    replacing, holding = history.replaced_by(cache.root, cache.manifest, changed)
    if not changed or holding is None:
        return None
    try:
        older = open_cache(cache_arg, verify_files=False, version=holding)
    except CacheError:
        return None
    held = _checksums(older)
    return (replacing, holding, changed) if all(held.get(i) == mine[i] for i in changed) else None


def _checksums(cache: Cache) -> dict[str, str]:
    """{row id: mask checksum} of a cache's (or one version's) rows."""
    return dict(zip(cache.index.column("id").to_pylist(), cache.index.column("mask_checksum").to_pylist()))


def _current_holds_as_edited(cache: Cache, cache_arg, encoded) -> int | None:
    """The cache's current version, where `cache` is an earlier one (--cache-version) and the current one holds
    every row of this data as it has it (an update replaced them since)."""
    version, current = cache.version.get("version"), cache.version.get("current")
    if not isinstance(version, int) or not isinstance(current, int) or version >= current:
        return None
    try:
        now = open_cache(cache_arg, verify_files=False)
    except CacheError:
        return None
    held = _checksums(now)
    return current if all(held.get(i) == p.mask_checksum for i, p in zip(encoded.ids, encoded.pairs)) else None


def _skipped_by_the_cache(error: DataError, cache: Cache, on_bad_row: str) -> DataError:
    """A bad row refused here that the cache's precompute-ref skipped (--on-bad-row skip): say so and what to pass."""
    skipped = (cache.manifest.get("source") or {}).get("skipped")
    if error.row is None or on_bad_row != "error" or not isinstance(skipped, int) or skipped < 1:
        return error
    return DataError(error.file, error.row, f"{error.reason}; the cache {cache.root} was made with --on-bad-row skip "
                     f"and left out {skipped} bad row(s) (listed in its skipped.jsonl): pass --on-bad-row skip to "
                     "train on the rows it holds")


def verify_and_join(*, cache_dir, data, split, model_dir, ref_model=None, **options) -> Verified:
    """_verify_and_join, whose refusals of a damaged cache (the rules' generic remedy) name the command that makes it
    again with this run's reference and data (runtime/remedies.py `damaged`), never "audit-ref it" alone."""
    try:
        return _verify_and_join(cache_dir=cache_dir, data=data, split=split, model_dir=model_dir, ref_model=ref_model,
                                **options)
    except CacheError as e:
        try:  # the cache's manifest where it still reads as JSON (the rebuild command's --top-k)
            manifest = history.current_manifest(cache_dir)
        except Exception:
            manifest = None
        raise remedies.damaged(e, cache_dir, manifest, model=ref_model or model_dir, data=data, split=split) from None


def _verify_and_join(*, tokenizer, model_dir, data, split, cache_dir, ref_model=None, ref_model_hash=None,
                     expected_model_hash=None, cache_version: int | None = None,
                     encoding_request=None, on_bad_row="error", verify_files=True, resuming: str | None = None,
                     cache_option: str = "--ref-cache", serves_training: bool = False, log=echo,
                     cache_named: str | None = None) -> Verified:
    """`cache_version`: a version of an updated cache (train-dpo --cache-version N), default its current one.
    `resuming`: the checkpoint a resume continues (a refusal names the version it trained on). `cache_option`: the
    option that gave the cache (--ref-cache, --eval-ref-cache), named in refusals and their remedies;
    `serves_training`: the eval rows are verified against the training rows' cache (an --update of it to the eval
    data would drop the training rows: the remedy is an eval cache of their own)."""
    t0 = time.perf_counter()
    cache = open_cache(cache_dir, verify_files=verify_files, keep=scanned_columns,  # one fetch per shard on a store
                       version=cache_version)
    t_files = time.perf_counter() - t0
    expected_model = expected_model_hash or reference_hash(model_dir, ref_model, ref_model_hash)
    found = {}

    def rows(encoding: EncodingConfig) -> dict[str, str]:
        found["source"] = source = load_rows(data, split, recorded_config(data, cache.manifest))
        try:
            found["encoded"] = encoded = usable_rows(source, tokenizer, encoding, on_bad_row, data)
        except DataError as e:
            raise _skipped_by_the_cache(e, cache, on_bad_row) from None
        return dict(zip(encoded.ids, (p.mask_checksum for p in encoded.pairs)))

    for finding in use_findings(cache, model_hash=expected_model, tokenizer_hash=tokenizer_hash(tokenizer),
                                tokenizer_parts=tokenizer_parts(tokenizer), encoding_request=encoding_request,
                                rows=rows, option=option_name, remedies=REMEDIES,
                                named="" if cache_option == "--ref-cache" else f" ({cache_named or cache_option})"):
        error = finding.error()
        if finding.rule == "rows":
            held = set(cache.index.column("id").to_pylist()) if finding.kind == "rows_missing" else set()
            missing = [i for i in found["encoded"].ids if i not in held] if finding.kind == "rows_missing" else []
            explained = _explained(error, cache, split, found["encoded"], data, cache_option, ref_model or model_dir)
            error = explained if explained is not error else _remedied(error, cache, cache_dir, data, ref_model or
                                                                       model_dir, split, missing, found["encoded"],
                                                                       resuming, cache_option, serves_training)
        raise error from None
    source, encoded = found["source"], found["encoded"]
    if cache.encoding.add_bos is True:
        log(f"note: {cache.root} was made with BOS always prepended (before refcache followed the tokenizer); "
            "training uses the same ids")
    table = encoded_table(encoded)
    cached = check_values(cache, encoded.ids)
    for name, column in zip(cached.column_names, cached.columns):
        table = table.append_column(name, column)
    report = {
        "cache": rm.absolute_if_local(str(cache.root)),  # as the run manifest names every other place
        "rows": len(encoded.ids),
        "skipped": encoded.skipped_by_reason,
        "file_hashes": "sha256 checked" if verify_files else "skipped (--fast-verify)",
        "files_s": round(t_files, 3),
        "total_s": round(time.perf_counter() - t0, 3),
        "stamps": cache.stamps,
        "version": cache.version,  # which version of the cache (schemas/history.py version_report)
        "dtype": (cache.manifest.get("computation") or {}).get("dtype"),  # the cached log-probs' precision
        "top_k": cache.top_k,  # the K of the reference's top-k distribution it holds (0: none)
    }
    reasons = ", ".join(f"{k}: {v}" for k, v in report["skipped"].items())
    skipped = f", {len(encoded.skipped)} bad rows skipped ({reasons})" if encoded.skipped else ""
    log(f"verified {shell_word(cache.root)}, {cache.version['line']}: {report['rows']} rows{skipped}, model/tokenizer/mask "
        "stamps match "
        f"({report['total_s']:.2f} s; file hashes {report['files_s']:.2f} s)")
    return Verified(table, source.fingerprint, report)


def encode_only(*, tokenizer, data, split, encoding: EncodingConfig, on_bad_row="error") -> EncodedOnly:
    """Rows for live-reference mode (no cache to verify against)."""
    source = load_rows(data, split)
    encoded = usable_rows(source, tokenizer, encoding, on_bad_row, data)
    return EncodedOnly(encoded_table(encoded), source.fingerprint, {"rows": len(encoded.ids), "mode": "live reference"})
