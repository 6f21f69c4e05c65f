"""What an audit check is: a named result (PASS, FAIL or SKIP), the sections of the report (the cache's checks are
the rule registry's, schemas/rules.py `checks`), and how a rule's findings become one check."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from runtime.terminal import counted

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# what marks audit-ref's own output files, so that a later run may replace them and nothing else (runtime/paths.py)
REPORT_KIND = "refcache-audit-ref-report"  # the JSON report's `kind`
PAGE_GENERATOR = '<meta name="generator" content="refcache audit-ref">'  # in the --html page's head


class _Sections(Mapping):
    """The report's sections and their checks, in order; the cache's are the rule registry's, read when asked for
    (a rule registered after audit is imported is reported too; --help and a refused command line import no
    schemas.rules, which needs polars)."""

    FIXED = {"model": ("model_hash", "tokenizer_hash", "replay", "replay_top_k"), "data": ("data_rows",),
             "run": ("run_cache", "run_final_hash", "run_kl_control")}

    def __getitem__(self, section: str) -> tuple:
        if section == "cache":
            from schemas.rules import checks

            return tuple(checks())
        return self.FIXED[section]

    def __iter__(self):
        return iter(("cache", *self.FIXED))

    def __len__(self) -> int:
        return 1 + len(self.FIXED)


SECTIONS = _Sections()


@dataclass
class Check:
    name: str
    status: str
    detail: str
    shard: str | None = None
    row: int | None = None  # row index inside `shard`
    info: dict = field(default_factory=dict)


def short(h) -> str:
    return f"{h[:12]}…" if isinstance(h, str) and len(h) > 12 else repr(h)


def from_findings(name: str, findings: list, checked: int, unit: str, what: str, unchecked_shards: int = 0) -> Check:
    """One check from the findings of its rule over `checked` shards or rows: FAIL naming the first, PASS, or SKIP
    when nothing could be checked."""
    units = lambda n: counted(n, unit)
    if findings:
        first = findings[0]
        failed = sum(f.count for f in findings)
        detail = first.message
        if first.expected is not None or first.found is not None:
            detail += f" (expected {short(first.expected)}, found {short(first.found)})"
        return Check(name, FAIL, f"{failed:,} of {units(max(checked, failed))}: {detail}", first.shard, first.row)
    if not checked:
        return Check(name, SKIP, "nothing to check: no shard passed shard_files")
    note = f"; {unchecked_shards} shard(s) not checked (failed shard_files)" if unchecked_shards else ""
    return Check(name, PASS, f"{units(checked)}: {what}{note}")
