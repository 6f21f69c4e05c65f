"""What a broken rule reports: a `Finding` (what, where, expected, found, remedy), and the `CacheError` a reader raises
from one. Every rule in `schemas/rules.py` returns findings; `open_cache` raises the first, audit-ref reports all of
them and precompute-ref's resume rescored or refuses on them."""

from __future__ import annotations

from dataclasses import dataclass

RERUN = "re-run precompute-ref with the same --model, --data and encoding options into a fresh --out directory"
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
