"""What a user meant by a local path that does not exist: what its folder holds and the closest name there, for
every refusal of a missing file or folder (runtime.hub for --model/--data, the location type for the options that
must exist, schemas.format for a cache folder that is not there)."""

from __future__ import annotations

from pathlib import Path


def nearby(name) -> str:
    """After "does not exist": "; did you mean d1/train.jsonl? (d1 holds: ...)" for a typo such as d1/trian.jsonl, or
    " (nor does d1; the nearest folder that does is .)" ; "" when nothing near can be listed."""
    path = Path(str(name))
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return ""
    if parent != path.parent:
        return f" (nor does {path.parent}; the nearest folder that does is {parent})"
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in parent.iterdir() if not p.name.startswith("."))
    except OSError:
        return ""
    # names of the same suffix, by their stems, in any case (a shared ".jsonl" alone makes no two names close);
    # failing that, whole names, closer still (a suffix mistyped: p40.jsnl for p40.jsonl)
    bare = [n.rstrip("/") for n in names]
    stems = {Path(n).stem.lower(): n for n in bare if Path(n).suffix.lower() == path.suffix.lower()}
    closest = [stems[s] for s in _closest(path.stem.lower(), stems, cutoff=0.6)]
    if not closest:
        whole = {n.lower(): n for n in bare}
        closest = [whole[s] for s in _closest(path.name.lower(), whole, cutoff=0.85)]
    where = "the current folder" if str(parent) in ("", ".") else str(parent)
    held = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "") if names else "nothing"
    meant = " or ".join(str(parent / c) for c in closest)
    return (f"; did you mean {meant}?" if closest else "") + f" ({where} holds: {held})"


def _closest(typed: str, candidates, cutoff: float) -> list[str]:
    """The candidates closest to `typed` (difflib's ratio, at least `cutoff`): every one that ties for closest
    (p4O.jsonl is as near p40.jsonl as p48.jsonl: both are named, not one picked by their order), in name order, at
    most three (the folder's listing names the rest)."""
    import difflib

    scores = {c: difflib.SequenceMatcher(None, c, typed).ratio() for c in candidates}  # as get_close_matches
    best = max(scores.values(), default=0.0)
    return sorted(c for c, score in scores.items() if score >= cutoff and score == best)[:3]


def not_here(name) -> str:
    """Why a local path that does not exist is not there, for its refusal: "does not exist" and what is near it."""
    return "does not exist" + nearby(name)


def closest(word: str, names, n: int = 3, cutoff: float = 0.6) -> list[str]:
    """The names closest to a mistyped `word` (difflib's ratio, at least `cutoff`), closest first: the matcher of
    a "did you mean" for names that are not files (audit-ref --show's row ids)."""
    import difflib

    matcher = difflib.SequenceMatcher(b=word)
    scored = []
    for name in names:
        matcher.set_seq1(name)
        if matcher.real_quick_ratio() >= cutoff and matcher.quick_ratio() >= cutoff and matcher.ratio() >= cutoff:
            scored.append((-matcher.ratio(), name))
    return [name for _, name in sorted(scored)[:n]]  # equally close: in order (train-00005 before train-00015)
