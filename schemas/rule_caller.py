"""The rules that compare a cache with its caller (train-dpo's run, precompute-ref's resume and --update, audit-ref's
model and a run's record): the computation, the stamps, the encoding options and the caller's rows, each returning
findings (schemas/findings.py). Each caller supplies only its own remedy text (`remedies`, by finding kind) and,
where its words differ, how it names an option; what is compared, and the message's first line, are the rule's.
"""

from __future__ import annotations

import json

from . import format as fmt
from .encoding import EncodingConfig
from .findings import CACHE_SIDE, RERUN, RUN_SIDE, Finding
from storage.quoting import shell_word


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
            made = getattr(recorded, key)
            out.append(Finding("stamps", "encoding", f"{option(key)} {value} conflicts with {where}, made with "
                               + (f"{option(key)} {made}" if made is not None else f"no {option(key)}"),
                               expected=value, found=made,
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
                 rows=None, option=str, remedies: dict | None = None, named: str = ""):
    """An open cache (schemas/cache.py) against what its user will train on, lazily in order (so the user stops
    at the first, before it encodes a row): the encoding options it asks for, its model and tokenizer hashes, then
    its rows, `rows(encoding)` -> id -> mask checksum, encoded with the cache's encoding. A hash or request given as
None is not compared. `named`: the option that gave the cache (" (--eval-ref-cache)"), said after its path."""
    where, remedies = f"the cache {shell_word(cache.root)}{named}", remedies or {}
    yield from option_findings(cache.encoding, encoding_request or {}, where=where, option=option,
                               remedy=remedies.get("encoding", RERUN))
    known = {k: v for k, v in (("model_hash", model_hash), ("tokenizer_hash", tokenizer_hash)) if v is not None}
    yield from stamp_findings({**cache.stamps, "tokenizer": cache.manifest.get("tokenizer")}, known, where=where,
                              remedies=remedies, tokenizer_parts=tokenizer_parts)
    if rows is not None:
        yield from row_findings(cache.index, rows(cache.encoding), where=where, remedies=remedies)
