"""A cache's manifest history (precompute-ref --update): which versions of a cache exist, which rows a version added
and removed, and which version a run's record names. See FORMAT.md, "Versions (manifest history)".

manifest.json is the current version; each earlier one is kept, byte for byte, as `manifest-NNNNN.json` beside it
(NNNNN: its version number, 1 for a cache's first manifest, which records no `version`). An update never edits or
deletes a shard: every file a version names stays, so each version reads as it did.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl

from . import store
from .stamps import cache_id

VERSION_FILE = re.compile(r"^manifest-(\d{5})\.json$")
UPDATE_SHARD = re.compile(r"^shard-v\d{5}-\d{5}\.parquet$")  # a shard an update wrote (precompute/update.py)
CURRENT = "manifest.json"  # format.MANIFEST (not imported: format imports the rules that import this)


def version_name(version: int) -> str:
    return f"manifest-{version:05d}.json"


def version_of(manifest: dict) -> int:
    """A manifest's version: its `version`, 1 for a manifest without one (every cache made before --update)."""
    v = manifest.get("version", 1) if isinstance(manifest, dict) else 1
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1


def history_entry(root: Path, manifest: dict) -> dict:
    """The line an update records for the version it replaces (kept as version_name(version))."""
    name = version_name(version_of(manifest))
    return {"version": version_of(manifest), "file": name, "sha256": store.sha256(store.location(root) / name),
            "cache_id": cache_id(manifest), "rows": manifest.get("rows")}


def _json(path: Path) -> dict | None:
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("shards"), list) else None


def version_files(root: Path) -> list[Path]:
    """The version files beside manifest.json, oldest first."""
    return sorted(p for p in store.location(root).iterdir() if VERSION_FILE.match(p.name) and p.is_file()
                  and not p.is_symlink())


def named_shards(root: Path) -> set[str]:
    """Every shard file a version of the cache in `root` names (manifest.json and each manifest-NNNNN.json): the
    files a cache keeps for its versions, none of them stray."""
    names = set()
    for path in [store.location(root) / CURRENT, *version_files(root)]:
        manifest = _json(path) if path.is_file() else None
        names |= {e.get("file") for e in (manifest or {}).get("shards", []) if isinstance(e, dict)}
    return {n for n in names if isinstance(n, str)}


def pending_shards(root: Path) -> set[str]:
    """The shards of an update to the version after manifest.json's, running or killed (shard-vNNNNN-MMMMM.parquet
    with NNNNN that next version): not stray while the current version stands (a reader of it does not read them),
    and judged by the update when it is run again."""
    manifest = _json(store.location(root) / CURRENT)
    if manifest is None:
        return set()
    prefix = f"shard-v{version_of(manifest) + 1:05d}-"
    return {p.name for p in store.location(root).glob(f"{prefix}*.parquet") if UPDATE_SHARD.match(p.name)}


def versions(root: Path, manifest: dict) -> list[tuple[int, str, dict]]:
    """(version, file, manifest) of every version the current manifest's `history` lists whose file is there with
    the recorded sha256, newest first, after the current one itself (its file: manifest.json)."""
    out = [(version_of(manifest), CURRENT, manifest)]
    for entry in reversed(manifest.get("history") or []):
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) \
                or not VERSION_FILE.match(entry["file"]):
            continue
        path = store.location(root) / entry["file"]
        if path.is_file() and not path.is_symlink() and store.sha256(path) == entry.get("sha256"):
            old = _json(path)
            if old is not None:
                out.append((version_of(old), entry["file"], old))
    return out


def version_for(root: Path, manifest: dict, records: list[dict]) -> tuple[int, str, dict] | None:
    """The version a run's cache records (`records`: schemas.run_manifest.cache_record's) name, by cache_id (or,
    for a record made before cache_id, the manifest's sha256); None when none of the versions is theirs."""
    for version, name, m in versions(root, manifest):
        sha = store.sha256(store.location(root) / name)
        for record in records:
            if record.get("cache_id") == cache_id(m) or (not record.get("cache_id")
                                                         and record.get("manifest_sha256") == sha):
                return version, name, m
    return None


def row_changes(cached_ids, cached_checks, ids, checks) -> dict[str, list[str]]:
    """The one comparison of a cache's rows with a data set's (id -> mask checksum on both sides): `added` (in the
    data only), `removed` (in the cache only) and `changed` (same id, other token ids), each in the order of its
    side (the data's for added and changed, the cache's for removed)."""
    cache = pl.DataFrame({"id": list(cached_ids), "cached": list(cached_checks), "at": range(len(cached_ids))},
                         schema={"id": pl.String, "cached": pl.String, "at": pl.Int64})
    now = pl.DataFrame({"id": list(ids), "now": list(checks), "order": range(len(ids))},
                       schema={"id": pl.String, "now": pl.String, "order": pl.Int64})
    joined = cache.join(now, on="id", how="full", coalesce=True)
    added = joined.filter(pl.col("cached").is_null()).sort("order")
    removed = joined.filter(pl.col("now").is_null()).sort("at")
    changed = joined.filter(pl.col("cached").is_not_null() & pl.col("now").is_not_null()
                            & (pl.col("cached") != pl.col("now"))).sort("order")
    return {"added": added["id"].to_list(), "removed": removed["id"].to_list(), "changed": changed["id"].to_list()}


def update_record(manifest: dict) -> dict | None:
    """What the update that made this version did (`update`: from_version, added, removed, replaced), or None for a
    first version."""
    u = manifest.get("update")
    return u if isinstance(u, dict) else None
