"""Why an object-store prefix without a manifest holds no cache, when it is not an interrupted writer's: the bucket
is missing, or the prefix is empty (mistyped: its neighbours named) or holds no cache's files. A folder's case is
schemas.format.no_manifest."""

from __future__ import annotations

import difflib

from storage.faults import StoreUnavailable, missing_bucket
from storage.places import StorePath

from .findings import CacheError


def absent_cache(root: StorePath) -> Exception | None:
    """Why a store prefix has no manifest, when it is not an interrupted writer's: the bucket does not exist, or the
    prefix holds nothing at all (mistyped, or never written: its neighbours are named) or holds no cache's files.
    None where it holds a cache's shards or lease (precompute-ref running or interrupted)."""
    fault = missing_bucket(root)
    if fault is not None:
        return fault
    try:
        names = sorted(p.name for p in root.iterdir())
    except FileNotFoundError:
        names = []
    if any(n.endswith(".parquet") or n.startswith(".refcache") for n in names):
        return None
    remedy = (f"check the URL (a cache's prefix holds manifest.json), or make the cache there with precompute-ref "
              f"--out {root.url}")
    if names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return CacheError("no_cache", f"{root.url} holds no cache: no manifest.json and no shard, only other "
                          f"objects ({shown})", remedy=remedy)
    near = _neighbours(root)
    return CacheError("no_cache", f"{root.url} holds no cache: nothing is stored under this prefix (mistyped, or "
                      "never written)" + (f"; next to it: {', '.join(near)}" if near else ""), remedy=remedy)


def _neighbours(root: StorePath) -> list[str]:
    """The prefixes beside `root` whose names are closest to its own (a typo's likely target)."""
    if "/" not in root.key:
        return []
    try:
        siblings = {p.name: p.url for p in root.parent.iterdir()}
    except (FileNotFoundError, StoreUnavailable):
        return []
    return [siblings[n] for n in difflib.get_close_matches(root.name, list(siblings), n=3, cutoff=0.75)]
