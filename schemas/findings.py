"""What a broken rule reports: a `Finding` (what, where, expected, found, remedy), and the `CacheError` a reader raises
from one. Every rule in `schemas/rules.py` returns findings; `open_cache` raises the first, audit-ref reports all of
them and precompute-ref's resume rescored or refuses on them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from storage.quoting import shell_word

RERUN = "re-run precompute-ref with the same --model, --data and encoding options into a fresh --out directory"
# what a remedy names where the damaged record no longer says it (a manifest that is not JSON)
MODEL_PLACEHOLDER, DATA_PLACEHOLDER = "<the reference model>", "<the data it was made from>"
DAMAGED = "the cache is damaged (precompute-ref never writes this)"  # how `rebuild` begins
VERSION_FILE = re.compile(r"^manifest-(\d{5})\.json$")  # an earlier version's manifest (schemas/history.py)
# kinds raised as StampMismatch (a stamp or the shard metadata that carries one differs)
STAMP_KINDS = frozenset({"model_hash", "tokenizer_hash", "mask_checksum", "encoding", "shard_metadata",
                         "ids_checksum", "computation"})


# The owners of a mismatch's two values as every message names them: the recorded value first (the cache's, a
# checkpoint's), then the caller's (train-dpo's run, precompute-ref's job). A finding without owners (a shard against
# its manifest entry) keeps "expected" / "found".
CACHE_SIDE, RUN_SIDE = "the cache", "this run"
RECORDED_SIDES = (CACHE_SIDE, "the checkpoint", "trained with")
UNOWNED = ("expected", "found")


def labelled(sides: tuple[str, str] | None, expected, found, indent: str = "  ") -> list[str]:
    """The two values of a mismatch, one line each, labelled by their owners (`sides`: the owners of `expected` and
    of `found`), the cache's side first where one is the cache, the values aligned. The one way every mismatch
    message labels its sides."""
    sides = tuple(sides or UNOWNED)
    pairs = list(zip(sides, (expected, found)))
    if sides[1].startswith(RECORDED_SIDES):
        pairs.reverse()
    width = max(len(name) for name, _ in pairs) + 1
    return [f"{indent}{(name + ':').ljust(width)} {'none' if value is None else value}" for name, value in pairs]


def _recorded(manifest) -> tuple:
    """(model, data, split, top_k) as a manifest that is still a JSON mapping records them (None where it does not)."""
    manifest = manifest if isinstance(manifest, dict) else {}
    part = lambda key: manifest.get(key) if isinstance(manifest.get(key), dict) else {}
    text = lambda v: v if isinstance(v, str) and v and "\n" not in v else None
    top_k = part("computation").get("top_k")
    return (text(part("model").get("path")), text(part("source").get("data")), text(part("source").get("split")),
            top_k if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0 else None)


def split_words(split: str | None) -> str:
    """A printed precompute-ref command's --split words (none for the default split)."""
    return f" --split {shell_word(split)}" if split and split != "train" else ""


def rebuild_command(root, manifest=None, *, model=None, data=None, split=None, out=None) -> str:
    """The precompute-ref command that makes a damaged cache at `root` again: the model, data, split and --top-k the
    caller knows, else those the manifest (if still readable) records, else placeholders to fill in; `out`: another
    folder to make it in (then without --overwrite)."""
    recorded = _recorded(manifest)
    model, data, split = model or recorded[0], data or recorded[1], split or recorded[2]
    return (f"precompute-ref --model {shell_word(model or MODEL_PLACEHOLDER)} --data "
            f"{shell_word(data or DATA_PLACEHOLDER)}{split_words(split)}"
            + (f" --top-k {recorded[3]}" if recorded[3] else "")
            + (f" --out {shell_word(out)}" if out else f" --out {shell_word(root)} --overwrite"))


def earlier_versions(root, manifest=None) -> list[int]:
    """The earlier versions an updated cache keeps in `root`: those its manifest's history lists, and those whose
    manifest file (manifest-NNNNN.json) is there, read or not (a damaged current manifest lists nothing)."""
    import os

    listed = {e["version"] for e in (manifest.get("history") or [] if isinstance(manifest, dict) else [])
              if isinstance(e, dict) and type(e.get("version")) is int}
    try:
        names = os.listdir(root)
    except (OSError, TypeError, ValueError):  # a store URL, a folder gone: what the manifest says
        names = []
    there = {int(m.group(1)) for n in names if (m := VERSION_FILE.match(n))}
    return sorted(listed | there)


def rebuild(root, manifest=None, **known) -> str:
    """The one remedy of a damaged cache (a record precompute-ref never writes, a file that is not what it recorded):
    nothing in it can be trusted to say more, so the remedy is the command that makes it again (`known`: the model,
    data and split the caller has). Never --overwrite over a cache that keeps earlier versions: that would delete
    them, and runs that trained on them read them (--cache-version N) while they verify: into another folder."""
    kept = earlier_versions(root, manifest)
    if kept:
        return (f"{DAMAGED}: make it again into a fresh folder with `{rebuild_command(root, manifest, out='NEW_CACHE', **known)}`"
                f"; {shell_word(root)} also keeps the cache's earlier version{'s' if len(kept) > 1 else ''} "
                f"{', '.join(map(str, kept))}, which `train-dpo --cache-version N` and `audit-ref --cache-version N` "
                "still read where they verify, and which --overwrite there would delete")
    return (f"{DAMAGED}: make it again with `{rebuild_command(root, manifest, **known)}` (or with another --out, to "
            "keep this one)")


def damaged(error: "CacheError", root, manifest=None, **known) -> "CacheError":
    """`error` with the rebuild command (`rebuild`, naming what the caller knows) as its remedy where it carries the
    generic RERUN one or a rebuild command; any other remedy (rows to bring in, an option to pass, a newer refcache)
    is the caller's to keep."""
    if error.remedy != RERUN and not error.remedy.startswith(DAMAGED):
        return error
    return type(error)(error.kind, error.message, remedy=rebuild(root, manifest, **known), expected=error.expected,
                       found=error.found, shard=error.shard, row=error.row, sides=error.sides)


class CacheError(Exception):
    """A cache that must not be used. `kind` is a stable key (tests and audit-ref match on it). `sides`: the owners of
    `expected` and `found` (labelled)."""

    def __init__(self, kind, message, *, remedy, expected=None, found=None, shard=None, row=None, sides=None):
        self.kind, self.message, self.remedy = kind, message, remedy
        self.expected, self.found, self.shard, self.row, self.sides = expected, found, shard, row, sides
        super().__init__(str(self))

    def __str__(self):
        lines = [self.message]
        if self.expected is not None or self.found is not None:
            lines += labelled(self.sides, self.expected, self.found)
        if self.shard is not None:
            lines.append(f"  where:    shard {self.shard}" + (f", row {self.row}" if self.row is not None else ""))
        lines.append(f"  remedy:   {self.remedy}")
        return "\n".join(lines)


class StampMismatch(CacheError):
    """One of the stamps differs; `kind` names it (model_hash, tokenizer_hash, mask_checksum, encoding, ...)."""


@dataclass
class Finding:
    rule: str  # the rule (audit-ref's check name) that found it
    kind: str  # the CacheError kind
    message: str
    expected: object = None
    found: object = None
    shard: str | None = None
    row: int | None = None  # row index inside `shard`
    count: int = 1  # rows or shards failing this rule in the same place (the first is described)
    remedy: str = RERUN
    sides: tuple[str, str] | None = None  # the owners of expected and found (labelled); None: "expected", "found"

    def error(self) -> CacheError:
        cls = StampMismatch if self.kind in STAMP_KINDS else CacheError
        return cls(self.kind, self.message, remedy=self.remedy, expected=self.expected, found=self.found,
                   shard=self.shard, row=self.row, sides=self.sides)

    def sides_text(self, indent: str = "  ") -> str:
        """expected and found, one line each, labelled by owner (labelled)."""
        return "\n".join(labelled(self.sides, self.expected, self.found, indent))


def other_format(root, path, manifest: dict, version: int, reads: int) -> CacheError:
    """A manifest of another format version than `reads` (the one this refcache reads): one a newer refcache wrote
    (upgrade), or a damaged one: a version no refcache writes (below 1), or a newer one in a manifest that names this
    refcache, or an older one, as its writer (that release writes this version)."""
    software = manifest.get("software") if isinstance(manifest.get("software"), dict) else {}
    writer = software.get("refcache") if isinstance(software.get("refcache"), str) else None
    said = f"{path} has format version {version}; this refcache reads version {reads}"
    if version > reads and not _not_newer(writer):
        return CacheError("format_version", said + (f" (written by refcache {writer})" if writer else ""),
                          remedy="upgrade refcache (pip install -U refcache) to read it", expected=reads,
                          found=version)
    if 1 <= version < reads:  # an older refcache's cache: this one does not read it
        return CacheError("format_version", f"{said} (an older refcache wrote it)", remedy=rebuild(root, manifest)
                          .replace(DAMAGED, "this refcache cannot read it"), expected=reads, found=version)
    why = ("no refcache writes a format version below 1" if version < 1 else
           f"yet it names refcache {writer} as its writer, which writes version {reads}")
    return CacheError("format_version", f"{said}: {why}, so the manifest is damaged (edited), not from another "
                      "refcache", remedy=rebuild(root, manifest), expected=reads, found=version)


def _not_newer(writer: str | None) -> bool:
    """Whether refcache release `writer` is this one or older (it writes this format version, or an older one)."""
    if writer is None:
        return False
    from importlib.metadata import PackageNotFoundError, version

    try:
        from packaging.version import InvalidVersion, Version

        return Version(writer) <= Version(version("refcache"))
    except (PackageNotFoundError, InvalidVersion, ImportError):
        return False
