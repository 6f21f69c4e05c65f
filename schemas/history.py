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

from storage import places, reads

from .findings import VERSION_FILE  # the name of an earlier version's manifest (found here by its readers)
from .stamps import cache_id

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
    return {"version": version_of(manifest), "file": name, "sha256": reads.sha256(places.location(root) / name),
            "cache_id": cache_id(manifest), "rows": manifest.get("rows"), **_made(manifest)}


def _made(manifest: dict) -> dict:
    """When a version was made and, for an update, how many rows it added, removed and replaced (every report's
    history lists them for each version)."""
    u = update_record(manifest)
    counts = {k: len(u.get(k) or []) for k in ("added", "removed", "replaced")} if u else {}
    return {**({"created_at": manifest["created_at"]} if manifest.get("created_at") else {}), **counts}


def _json(path: Path) -> dict | None:
    try:
        manifest = json.loads(reads.record_bytes(path))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("shards"), list) else None


def version_files(root: Path) -> list[Path]:
    """The version files beside manifest.json, oldest first."""
    return sorted(p for p in places.location(root).iterdir() if VERSION_FILE.match(p.name) and p.is_file()
                  and not p.is_symlink())


def named_shards(root: Path) -> set[str]:
    """Every shard file a version of the cache in `root` names (manifest.json and each manifest-NNNNN.json): the
    files a cache keeps for its versions, none of them stray."""
    names = set()
    for path in [places.location(root) / CURRENT, *version_files(root)]:
        manifest = _json(path) if path.is_file() else None
        names |= {e.get("file") for e in (manifest or {}).get("shards", []) if isinstance(e, dict)}
    return {n for n in names if isinstance(n, str)}


def pending_shards(root: Path) -> set[str]:
    """The shards of an update to the version after manifest.json's, running or killed (shard-vNNNNN-MMMMM.parquet
    with NNNNN that next version): not stray while the current version stands (a reader of it does not read them),
    and judged by the update when it is run again."""
    manifest = _json(places.location(root) / CURRENT)
    if manifest is None:
        return set()
    prefix = f"shard-v{version_of(manifest) + 1:05d}-"
    return {p.name for p in places.location(root).glob(f"{prefix}*.parquet") if UPDATE_SHARD.match(p.name)}


def versions(root: Path, manifest: dict) -> list[tuple[int, str, dict]]:
    """(version, file, manifest) of every version the current manifest's `history` lists whose file is there with
    the recorded sha256, newest first, after the current one itself (its file: manifest.json)."""
    out = [(version_of(manifest), CURRENT, manifest)]
    for entry in reversed(manifest.get("history") or []):
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) \
                or not VERSION_FILE.match(entry["file"]):
            continue
        path = places.location(root) / entry["file"]
        if path.is_file() and not path.is_symlink() and reads.sha256(path) == entry.get("sha256"):
            old = _json(path)
            if old is not None:
                out.append((version_of(old), entry["file"], old))
    return out


def version_for(root: Path, manifest: dict, records: list[dict]) -> tuple[int, str, dict] | None:
    """The version a run's cache records (`records`: schemas.run_manifest.cache_record's) name, by cache_id (or,
    for a record made before cache_id, the manifest's sha256); None when none of the versions is theirs."""
    for version, name, m in versions(root, manifest):
        sha = reads.sha256(places.location(root) / name)
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


# ---------------------------------------------------------------------------------------------------------------
# a version by number (--cache-version N), and a version whose manifest is gone


def _listed(manifest: dict) -> list[dict]:
    """The earlier versions the manifest's history lists: {"version", "file", "sha256", "cache_id", "rows"}."""
    return [e for e in manifest.get("history") or [] if isinstance(e, dict) and isinstance(e.get("version"), int)
            and isinstance(e.get("file"), str) and VERSION_FILE.match(e["file"])]


def _why_gone(root: Path, entry: dict) -> str:
    path = places.location(root) / entry["file"]
    if not path.exists():
        return f"its manifest {entry['file']} is missing from the cache"
    return f"its manifest {entry['file']} is not the one the history records (sha256 {entry.get('sha256')})"


def available(root: Path, manifest: dict) -> str:
    """The versions kept in the cache, as a refusal names them: "3 (manifest.json), 1 (manifest-00001.json)"."""
    return ", ".join(f"{v} ({name})" for v, name, _ in versions(root, manifest))


def by_number(root: Path, manifest: dict, number: int) -> tuple[int, str, dict]:
    """(version, file, manifest) of version `number` of the cache whose current manifest is `manifest`; raises
    CacheError naming the versions kept there when it is not one of them (its manifest missing or altered)."""
    from .findings import CacheError

    for found in versions(root, manifest):
        if found[0] == number:
            return found
    gone = [e for e in _listed(manifest) if e["version"] == number]
    why = (f"version {number} of the cache {root} cannot be read: {_why_gone(root, gone[0])}" if gone else
           f"the cache {root} has no version {number}")
    raise CacheError("version", f"{why}; the versions kept there: {available(root, manifest)}",
                     remedy=f"pass one of those to {VERSION_OPTION}, or leave it out for the current version")


def gone(root: Path) -> str | None:
    """The earlier versions the current manifest's history lists whose manifest cannot be read, and why (None:
    none): the shards only they named read as stray."""
    manifest = current_manifest(root)
    if manifest is None:
        return None
    readable = {name for _, name, _ in versions(root, manifest)}
    lost = [f"version {e['version']}: {_why_gone(root, e)}" for e in _listed(manifest) if e["file"] not in readable]
    return "; ".join(lost) or None


def lost_version(root: Path, manifest: dict, records: list[dict]) -> str | None:
    """Why a run's cache records (schemas.run_manifest.cache_record's) name a version of this cache that cannot be
    read: its history lists a version with their cache_id whose manifest file is missing or altered. None when no
    listed version is theirs."""
    ids = {r.get("cache_id") for r in records if isinstance(r, dict) and r.get("cache_id")}
    for entry in _listed(manifest):
        if entry.get("cache_id") in ids:
            return (f"the run was trained on version {entry['version']} of this cache, and {_why_gone(root, entry)} "
                    f"(the versions kept: {available(root, manifest)}); put {entry['file']} back from a copy of the "
                    "cache to audit the run against it")
    return None


VERSION_OPTION = "--cache-version"  # train-dpo's and audit-ref's option naming a version (dpo/config.py, audit/cli.py)


# ---------------------------------------------------------------------------------------------------------------
# what happened between two versions, for a resume and for rows a version removed


def _updates(root: Path, manifest: dict) -> dict[int, dict | None]:
    """version -> the `update` record of that version (None: a first version, or a version whose file is gone)."""
    out = {v: update_record(m) for v, _, m in versions(root, manifest)}
    for entry in _listed(manifest):
        out.setdefault(entry["version"], None)
    return out


def changed_between(root: Path, manifest: dict, a: int, b: int) -> set[str] | None:
    """Every row id an update between versions a and b (either order) added, removed or replaced; None when the
    record of one of those updates cannot be read (its version's manifest gone)."""
    updates, ids = _updates(root, manifest), set()
    for v in range(min(a, b) + 1, max(a, b) + 1):
        u = updates.get(v)
        if u is None:
            return None
        ids |= {i for k in ("added", "removed", "replaced") for i in u.get(k) or []}
    return ids


def removed_by(root: Path, manifest: dict, ids) -> tuple[list[int], int | None]:
    """For rows the version `manifest` lacks: the versions whose updates removed them, and the newest earlier
    version kept in the cache that holds them all (by the update records; None if there is none)."""
    return _undone_by(root, manifest, ids, "removed")


def replaced_by(root: Path, manifest: dict, ids) -> tuple[list[int], int | None]:
    """For rows the version `manifest` holds with other content than a data set's: the versions whose updates
    replaced them (precompute-ref --update --replace-changed), and the newest earlier version kept in the cache from
    before those updates that holds them all (None if there is none). Whether it holds them as the data has them is
    the caller's to check (its rows' mask checksums)."""
    return _undone_by(root, manifest, ids, "replaced")


def _undone_by(root: Path, manifest: dict, ids, kind: str) -> tuple[list[int], int | None]:
    """The versions whose updates `kind` (removed, replaced) any of `ids`, and the newest earlier kept version from
    before every update after it that touched them, holding them all (not added after it)."""
    updates, rows = _updates(root, manifest), set(ids)
    undoing = sorted({v for v, u in updates.items() if u and rows & set(u.get(kind) or [])})
    if not undoing:
        return [], None
    kept = {v for v, _, _ in versions(root, manifest)}
    for h in sorted(kept, reverse=True):
        if h >= version_of(manifest):
            continue
        # in h: undone by an update after h, and not added after h before that (changed_between's records)
        after = [updates.get(v) for v in range(h + 1, version_of(manifest) + 1)]
        if None in after:
            break
        undone = {i for u in after for i in u.get(kind) or []}
        added_later = {i for u in after for i in u.get("added") or []}
        if rows <= undone and not (rows & added_later):
            return undoing, h
    return undoing, None


# ---------------------------------------------------------------------------------------------------------------
# the one version line of every report


def version_report(manifest: dict, file: str = CURRENT, current: dict | None = None) -> dict:
    """A version of a cache as every report records it: {"version", "file", "current" (the cache's current version),
    "line" (version_line), "history": [{"version", "rows", "created_at"?, "added"?, "removed"?, "replaced"?}...]}
    from the current manifest (`current`, default `manifest`) alone: each earlier version as its history entry
    records it (an update writes when it was made and its counts; one before refcache recorded them, rows only)."""
    current = manifest if current is None else current
    said = ("created_at", "added", "removed", "replaced")  # an update since this recorded them; an older one did not
    steps = [{"version": e["version"], "rows": e.get("rows"), **{k: e[k] for k in said if k in e}}
             for e in _listed(current)]
    steps.append({"version": version_of(current), "rows": current.get("rows"), **_made(current)})
    return {"version": version_of(manifest), "file": file, "current": version_of(current),
            "line": version_line(manifest, file, current), "history": steps}


def version_line(manifest: dict, file: str = CURRENT, current: dict | None = None) -> str:
    """"cache version N ..." for every report (train-dpo's verified line, its model card and run manifest, audit-ref,
    the dataset card): which version, and how the cache came to it (when, rows added/removed/replaced)."""
    current = manifest if current is None else current
    v, now = version_of(manifest), version_of(current)
    where = f"version {v} of {now}, kept as {file}" if file != CURRENT else f"version {v}"
    u = update_record(manifest)
    if u is None:
        made = "the cache as first made" + (f" {manifest['created_at']}" if manifest.get("created_at") else "")
        made += "; never updated" if now == 1 else ""
    else:
        made = (f"made by precompute-ref --update {manifest.get('created_at') or ''} from version "
                f"{u.get('from_version')}: {len(u.get('added') or [])} rows added, {len(u.get('removed') or [])} "
                f"removed, {len(u.get('replaced') or [])} replaced").replace("  ", " ")
    kept = [f"{e['version']} as {e['file']} ({e.get('rows')} rows)" for e in _listed(current)]
    later = f"; earlier versions kept: {', '.join(kept)}" if kept and file == CURRENT else ""
    return f"cache {where} ({made}; {manifest.get('rows')} rows{later})"


def current_manifest(root) -> dict | None:
    """manifest.json of the cache in `root` as JSON (None: none there, or not a manifest)."""
    path = places.location(root) / CURRENT
    return _json(path) if path.is_file() else None


def version_number(root: Path, manifest: dict, record: dict) -> int | None:
    """The version of the cache (current manifest `manifest`) a run's cache record names by its cache_id, whether
    its manifest is kept or not (the history lists the cache_id of each earlier version); None: none of them."""
    wanted = record.get("cache_id") if isinstance(record, dict) else None
    if not wanted:
        return None
    if cache_id(manifest) == wanted:
        return version_of(manifest)
    return next((e["version"] for e in _listed(manifest) if e.get("cache_id") == wanted), None)
