"""What a user meant by a local path that does not exist: what its folder holds and the closest name there, for
every refusal of a missing file or folder (runtime.hub for --model/--data, the location type for the options that
must exist, schemas.format for a cache folder that is not there)."""

from __future__ import annotations

from pathlib import Path

from .quoting import shell_word


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
        meant = " or ".join(map(shell_word, _below(path, parent)))
        return ((f"; did you mean {meant}?" if meant else "")
                + f" (nor does {shell_word(path.parent)}; the nearest folder that does is {shell_word(parent)})")
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in parent.iterdir() if not p.name.startswith("."))
    except OSError:
        return ""
    # a name holding a control character (a newline that would start a forged "remedy:" line, an escape sequence)
    # is neither listed nor suggested: counted only
    hidden = sum(not n.isprintable() for n in names)
    names = [n for n in names if n.isprintable()]
    # names of the same suffix, by their stems, in any case (a shared ".jsonl" alone makes no two names close);
    # failing that, whole names, closer still (a suffix mistyped: p40.jsnl for p40.jsonl)
    bare = [n.rstrip("/") for n in names]
    stems = {Path(n).stem.lower(): n for n in bare if Path(n).suffix.lower() == path.suffix.lower()}
    near = [stems[s] for s in closest(path.stem.lower(), stems, ties=True)]
    if not near:
        whole = {n.lower(): n for n in bare}
        near = [whole[s] for s in closest(path.name.lower(), whole, cutoff=0.85, ties=True)]
    where = "the current folder" if str(parent) in ("", ".") else shell_word(parent)
    held = ", ".join(map(shell_word, names[:12])) + (f", ... ({len(names)} in all)" if len(names) > 12 else "") if names else "nothing"
    held += f"; and {hidden} name{'s' if hidden > 1 else ''} with control characters, not shown" if hidden else ""
    meant = " or ".join(shell_word(parent / c) for c in near)
    return (f"; did you mean {meant}?" if near else "") + f" ({where} holds: {held})"


def _below(path: Path, parent: Path, most: int = 500) -> list[Path]:
    """Paths that exist which a typo in a folder's name may have meant (d1/train.jsonl for dl/train.jsonl, the
    folder d1 beside the missing dl): each folder of `parent` (the nearest that exists) with the rest of `path` below
    it, the closest to `path` by their whole text, where they exist. A folder's name alone is too short to judge
    (d1 and dl share half their letters); with the file below it the two read alike."""
    rest = path.parts[len(parent.parts):]
    try:
        folders = [p for _, p in zip(range(most), parent.iterdir()) if p.name.isprintable() and p.is_dir()]
    except OSError:
        return []
    there = {str(Path(f.name, *rest[1:])): f.joinpath(*rest[1:]) for f in folders}
    there = {k: v for k, v in there.items() if v.exists()}
    return [there[k] for k in closest(str(Path(*rest)), there, cutoff=0.85, ties=True)]


def missing(name) -> str:
    """A local path that does not exist, as every refusal names it: the path as a shell takes it back, then why."""
    return f"{shell_word(name)}: {not_here(name)}"


def not_here(name) -> str:
    """Why a local path that does not exist is not there, for its refusal: "does not exist" and what is near it."""
    return "does not exist" + nearby(name)


def closest(word: str, names, n: int = 3, cutoff: float = 0.6, *, ties: bool = False) -> list[str]:
    """The names closest to a mistyped `word` (difflib's ratio, at least `cutoff`), closest first and equally close
    in name order, at most `n`: the one matcher of every "did you mean" (paths here, audit-ref --show's row ids).
    `ties`: only those that tie for closest (p4O.jsonl is as near p40.jsonl as p48.jsonl: both, never one picked by
    the names' order)."""
    import difflib

    matcher = difflib.SequenceMatcher(b=word)
    scored = []
    for name in names:
        matcher.set_seq1(name)
        if matcher.real_quick_ratio() >= cutoff and matcher.quick_ratio() >= cutoff and matcher.ratio() >= cutoff:
            scored.append((-matcher.ratio(), name))
    scored.sort()
    if ties:
        scored = [(score, name) for score, name in scored if score == scored[0][0]]
    return [name for _, name in scored[:n]]
