"""The rules over a cache's files (schemas/rules.py registers them): the manifest against itself, each listed shard's
file (name, size, sha256) and Parquet footer (schema, row count, stamps), shard files nobody lists, skipped.jsonl
against the manifest's counts, and the dataset card against the manifest.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pyarrow as pa

from storage import places, reads

from . import format as fmt
from . import history
from .card import DEFINED, card_metadata, read_card_metadata
from .encoding import EncodingConfig
from .findings import RERUN, CacheError, Finding
from .rule_caller import computation_findings, footer_computation
from .stamps import canonical_json


def manifest_findings(manifest: dict) -> list[Finding]:
    """The manifest against itself (its structure is read_manifest's): no shard listed twice, rows adding up."""
    names = [e["file"] if isinstance(e["file"], str) else repr(e["file"]) for e in manifest["shards"]]
    out = []
    if len(set(names)) != len(names):
        twice = next(n for n, c in Counter(names).items() if c > 1)
        out.append(Finding("manifest", "manifest", f"the manifest lists shard {twice} twice", shard=twice))
    computation = manifest.get("computation") if isinstance(manifest.get("computation"), dict) else {}
    batching_aside = lambda c: {k: v for k, v in fmt.scored_computation(c).items() if k not in fmt.MODE_KEYS}
    for e in manifest["shards"]:  # a shard's own computation (an --update's mode) differs in the mode keys only
        own = e.get("computation", computation)
        if not isinstance(own, dict) or batching_aside(own) != batching_aside(computation):
            out.append(Finding("manifest", "manifest", f"the manifest's entry of shard {e['file']} records a "
                               "computation that differs from the cache's in more than the batching mode",
                               expected=computation, found=own, shard=e["file"]))
            break
    listed = sum(e["rows"] for e in manifest["shards"])
    if "rows" in manifest and manifest["rows"] != listed:
        out.append(Finding("manifest", "manifest", "the manifest's rows differ from the sum of its shards' rows",
                           expected=listed, found=manifest["rows"]))
    return out + _history_findings(manifest)


def _history_findings(manifest: dict) -> list[Finding]:
    """The earlier versions the manifest's history lists, as precompute-ref --update writes them: each its version
    number (below the current one, once), the file of that number, whole rows. An entry of another shape is never
    read (no path leaves the cache), and is said, not passed over."""
    entries = manifest.get("history") or []
    current = manifest.get("version") if type(manifest.get("version")) is int else 1
    bad = [e for e in (entries if isinstance(entries, list) else [entries]) if not (
        isinstance(e, dict) and type(e.get("version")) is int and 1 <= e["version"] < current
        and e.get("file") == history.version_name(e["version"]) and type(e.get("rows")) is int and e["rows"] >= 0)]
    versions = [e.get("version") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    if bad or len(set(map(repr, versions))) != len(versions):
        shown = repr(bad[0] if bad else entries)
        return [Finding("manifest", "manifest", "the manifest's history lists an earlier version precompute-ref "
                        f"--update does not write ({shown[:200]}): the history was edited")]
    return []


def shard_file_findings(root: Path, entry: dict, *, hash_files: bool = True) -> tuple[Path | None, list[Finding]]:
    """A listed shard's file: a plain name inside the cache, present, its size and (unless hash_files=False) its
    sha256 equal to the entry's. Returns the path when the name is acceptable (an object on a store: holding the
    bytes that were hashed, so the footer and columns are read from them: storage/reads.py)."""
    name = entry["file"]
    try:
        path = fmt.shard_path(root, name)
    except CacheError as e:
        return None, [Finding("shard_files", e.kind, e.message, shard=e.shard or str(name), remedy=e.remedy)]
    if not path.is_file():
        return path, [Finding("shard_files", "shard_missing", f"shard {name} listed in the manifest is missing",
                              shard=name)]
    size = path.stat().st_size
    if size != entry["bytes"]:
        return path, [Finding("shard_files", "shard_size", f"shard {name} has the wrong size", expected=entry["bytes"],
                              found=size, shard=name)]
    if hash_files:
        digest, path = reads.hashed(path)
        if digest != entry["sha256"]:
            return path, [Finding("shard_files", "shard_hash", f"shard {name} content differs from the manifest "
                                  "(file sha256)", expected=entry["sha256"], found=digest, shard=name)]
    return path, []


def expected_footer(stamps: dict, encoding: EncodingConfig, entry: dict, computation, *,
                    with_computation: bool = True) -> dict:
    """The footer metadata a shard must carry: the cache's stamps, its own checksums, the encoding and the
    computation that scored it (the manifest's; a manifest without one matches no shard). Resume compares the
    computation key by key instead (with_computation=False)."""
    if isinstance(entry.get("computation"), dict):  # a shard an --update scored in another mode (fmt.MODE_KEYS)
        computation = entry["computation"]
    want = {"format_version": str(fmt.FORMAT_VERSION), "model_hash": stamps["model_hash"],
            "tokenizer_hash": stamps["tokenizer_hash"], "mask_checksum": entry["mask_checksum"],
            "ids_checksum": entry["ids_checksum"], "encoding": encoding.to_json()}
    if with_computation:
        want["computation"] = canonical_json(fmt.scored_computation(computation))
    return want


def shard_footer_findings(path: Path, want: dict, rows: int) -> tuple[dict, list[Finding]]:
    """A shard's Parquet footer: readable, the shard schema, the row count (rule shard_files), and every metadata
    key of `want` (rule shard_stamps). Returns the footer metadata it read."""
    name = path.name
    try:
        footer = fmt.read_footer(path)
        meta, count, schema = footer.meta, footer.rows, footer.schema
    except (pa.ArrowException, OSError, ValueError) as e:
        return {}, [Finding("shard_files", "shard_unreadable", f"shard {name} is not a readable Parquet file ({e})",
                            shard=name)]
    # the columns of the K its own footer records (a footer that disagrees with the manifest is a finding below)
    if not schema.equals(fmt.shard_schema(fmt.top_k_of(footer_computation(meta))), check_metadata=False):
        return meta, [Finding("shard_files", "shard_unreadable", f"shard {name} does not have the columns of a format "
                              f"version {fmt.FORMAT_VERSION} shard (found "
                              + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")", shard=name)]
    out = []
    for key, value in want.items():
        if not _same_metadata(key, meta.get(key), value):
            kind = key if key in fmt.STAMPS or key in ("ids_checksum", "computation") else "shard_metadata"
            expected, got = value, meta.get(key)
            if key == "computation":  # name the settings that differ, not two JSON blobs
                recorded = json.loads(value)
                diff = computation_findings(recorded if isinstance(recorded, dict) else {"computation": recorded},
                                            footer_computation(meta) or {})
                expected = {k: v for f in diff for k, v in f.expected.items()}
                got = {k: v for f in diff for k, v in f.found.items()}
            out.append(Finding("shard_stamps", kind, f"shard {name}: metadata '{fmt.META_PREFIX}{key}' differs from "
                               "the manifest", expected=expected, found=got, shard=name))
    if count != rows:
        out.append(Finding("shard_files", "shard_rows", f"shard {name} row count differs", expected=rows, found=count,
                           shard=name))
    return meta, out


def _same_metadata(key: str, found, want: str) -> bool:
    """A footer value against the one wanted, as logical values: the JSON ones (encoding, computation) parsed, so a
    footer written with other spacing or key order reads as what it holds, the same for audit-ref and a resume."""
    if key not in ("encoding", "computation") or found == want:
        return found == want
    try:
        return json.loads(found) == json.loads(want)
    except (TypeError, ValueError):
        return False


def unlisted_findings(root: Path, listed) -> list[Finding]:
    """Shard files in `root` that neither this manifest (`listed`) nor any version of the cache (manifest.json and
    its manifest-NNNNN.json history, schemas/history.py) names: an update keeps every file an earlier version names,
    and the shards of an update to the next version (running, or killed before its manifest) are not stray either."""
    listed = set(listed) | history.named_shards(root) | history.pending_shards(root)
    unlisted = sorted(p.name for p in root.glob("*.parquet") if p.name not in listed)
    if not unlisted:
        return []
    lost = history.gone(root)  # the shards of a version whose manifest is gone are its, not strays
    return [Finding("shard_files", "shard_unlisted", f"{root} holds shard files the manifest does not list: "
                    + ", ".join(unlisted[:5]) + (f" (the history lists a version it cannot read: {lost})"
                                                 if lost else ""), shard=unlisted[0], count=len(unlisted),
                    remedy="put the version's manifest back from a copy of the cache" if lost else
                    "remove the stray files, or " + RERUN)]


def skipped_findings(root: Path, manifest: dict) -> tuple[int, list[Finding]]:
    """skipped.jsonl against the manifest's counts: (rows listed, findings)."""
    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    counts = [source.get("skipped", 0), source.get("rows_in"), manifest.get("rows", 0)]
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        return 0, [Finding("skipped_counts", "manifest", f"manifest counts are not integers: source.skipped="
                           f"{counts[0]!r}, source.rows_in={counts[1]!r}, rows={counts[2]!r}")]
    path = root / fmt.SKIPPED
    try:
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] \
            if path.exists() else []
    except ValueError as e:
        return 0, [Finding("skipped_counts", "manifest", f"{fmt.SKIPPED} is not JSON Lines ({e})")]
    problems = []
    if source.get("skipped") != len(lines):
        problems.append(f"manifest source.skipped is {source.get('skipped')}, {fmt.SKIPPED} lists {len(lines)}")
    reasons = dict(Counter(s.get("reason") for s in lines if isinstance(s, dict)))
    if (source.get("skipped_by_reason") or {}) != reasons:
        problems.append(f"skipped_by_reason {source.get('skipped_by_reason')} vs {fmt.SKIPPED} {reasons}")
    if source.get("rows_in") != manifest.get("rows", 0) + (source.get("skipped") or 0):
        problems.append(f"rows_in {source.get('rows_in')} != rows {manifest.get('rows')} + skipped "
                        f"{source.get('skipped')}")
    return len(lines), [Finding("skipped_counts", "manifest", "; ".join(problems))] if problems else []


LATER = ("version",)  # fields of the card's refcache metadata added after cards were first written
CARD_REMEDY = ("re-run the same precompute-ref command: it writes the card from the manifest (a README.md that is "
               "not this cache's card is refused: move it away first)")


def card_findings(root: Path, manifest: dict) -> tuple[bool, list[Finding]]:
    """The dataset card (README.md, schemas/card.py) against the manifest: (whether there is one, findings). The
    metadata refcache defines (`configs`: the shards, `refcache`: the identity) must be what the manifest gives; the
    rest of the metadata and the text are not compared. No card is no finding (caches made before cards)."""
    path = root / fmt.CARD
    if not (path.exists() if places.is_remote(path) else os.path.lexists(path)):
        return False, []
    meta = read_card_metadata(path) if path.is_file() and not path.is_symlink() else None
    if meta is None:
        return True, [Finding("card", "card", f"{fmt.CARD} is not a dataset card huggingface_hub can read (or not a "
                              "plain file)", remedy=CARD_REMEDY)]
    want = card_metadata(manifest)
    if isinstance(meta.get("refcache"), dict):  # a card written before a field was added is as good (cards of old)
        want["refcache"] = {k: v for k, v in want["refcache"].items() if k not in LATER or k in meta["refcache"]}
    differ = [k for k in DEFINED if meta.get(k) != want[k]]
    if not differ:
        return True, []
    k = differ[0]
    found, expected = meta.get(k), want[k]
    if k == "refcache" and isinstance(found, dict):  # name the fields that differ, not two blocks
        keys = [f for f in expected if found.get(f) != expected[f]] + [f for f in found if f not in expected]
        found, expected = {f: found.get(f) for f in keys}, {f: expected.get(f) for f in keys}
    return True, [Finding("card", "card", f"{fmt.CARD}'s metadata '{k}' differs from the manifest", expected=expected,
                          found=found, remedy=CARD_REMEDY)]

