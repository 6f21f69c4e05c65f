"""What a broken rule reports: a `Finding` (what, where, expected, found, remedy), and the `CacheError` a reader raises
from one. Every rule in `schemas/rules.py` returns findings; `open_cache` raises the first, audit-ref reports all of
them and precompute-ref's resume rescored or refuses on them."""

from __future__ import annotations

from dataclasses import dataclass

RERUN = "re-run precompute-ref with the same --model, --data and encoding options into a fresh --out directory"
# kinds raised as StampMismatch (a stamp or the shard metadata that carries one differs)
STAMP_KINDS = frozenset({"model_hash", "tokenizer_hash", "mask_checksum", "encoding", "shard_metadata",
                         "ids_checksum", "computation"})


class CacheError(Exception):
    """A cache that must not be used. `kind` is a stable key (tests and audit-ref match on it)."""

    def __init__(self, kind, message, *, remedy, expected=None, found=None, shard=None, row=None):
        self.kind, self.message, self.remedy = kind, message, remedy
        self.expected, self.found, self.shard, self.row = expected, found, shard, row
        super().__init__(str(self))

    def __str__(self):
        lines = [self.message]
        if self.expected is not None or self.found is not None:
            lines += [f"  expected: {self.expected}", f"  found:    {self.found}"]
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

    def error(self) -> CacheError:
        cls = StampMismatch if self.kind in STAMP_KINDS else CacheError
        return cls(self.kind, self.message, remedy=self.remedy, expected=self.expected, found=self.found,
                   shard=self.shard, row=self.row)
