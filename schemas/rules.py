"""The rule book: every rule that says whether a cache is sound, one entry each in one ordered registry (`REGISTRY`),
and the one walk of a cache over it (`walk`) with its three drivers:

- `cache_findings`, lazily in the registry's order, so a reader stops at the first finding (`open_cache` in
  schemas/cache.py, precompute-ref `--update`);
- `collect`, every finding of every rule with what it judged (audit-ref's scan, audit/cache.py);
- `shard_findings`, one shard file's rules (precompute-ref's resume, precompute/resume.py: it scores again a shard
  whose finding is `damage`, and refuses any other).

A rule is judged per unit: the manifest, each listed shard's file and footer (no column read), each shard's rows (the
columns the walk read), or the cache as a whole. The walk follows the registry: a run of consecutive shard and row
rules is judged shard by shard, in manifest order, then the next rule. A rule runs where what it `needs` passed (on
the same shard, or on every shard for a rule of the whole cache). A new rule is one entry here, its row in
schemas/FORMAT.md (`rule_table`) and its fault case (tests/schemas/test_rules.py).

The rules themselves, each returning findings (schemas/findings.py), live by theme: the cache's files
(schemas/rule_files.py), its rows and values (schemas/rule_rows.py), its top-k columns (schemas/rule_top_k.py), and
the comparisons of a cache with its caller (schemas/rule_caller.py: train-dpo's `use_findings`, the stamps, the
computation), which are not a cache's own soundness and so not registered. They are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl
import pyarrow as pa

from . import format as fmt
from .encoding import EncodingConfig
from .findings import CacheError, Finding
from .format import TOP_K_COLUMNS
from .rule_caller import (computation_findings, footer_computation, option_findings, row_findings, stamp_findings,
                          use_findings)
from .rule_files import (CARD_REMEDY, card_findings, expected_footer, manifest_findings, shard_file_findings,
                         shard_footer_findings, skipped_findings, unlisted_findings)
from .rule_rows import (SUM_TOLERANCE, VALUE_RULES, VALUE_WHAT, cache_checksum_findings, row_checksum_findings,
                        shard_checksum_findings, unique_id_findings, value_findings)
from .rule_top_k import TOP_K_RULES, TOP_K_TOLERANCE, top_k_allowance, top_k_findings

__all__ = ["CARD_REMEDY", "SUM_TOLERANCE", "TOP_K_COLUMNS", "TOP_K_RULES", "TOP_K_TOLERANCE", "VALUE_RULES",
           "VALUE_WHAT", "Finding", "cache_checksum_findings", "card_findings", "computation_findings",
           "expected_footer", "footer_computation", "manifest_findings", "option_findings", "row_checksum_findings",
           "row_findings", "shard_checksum_findings", "shard_file_findings", "shard_footer_findings",
           "skipped_findings", "stamp_findings", "top_k_allowance", "top_k_findings", "unique_id_findings",
           "unlisted_findings", "use_findings", "value_findings"]

MANIFEST, SHARD, ROWS, CACHE = "manifest", "shard", "rows", "cache"  # what one judgement of a rule covers
INDEX = ("id", "mask_checksum")  # the columns the first-finding walk reads (the checksum rules need them)
TOP_K = "top_k"  # a rule `only` for the shards of a --top-k cache
ONLY = {TOP_K: "no top-k columns (a cache made without precompute-ref --top-k)"}  # audit-ref's line where none is


@dataclass(frozen=True)
class Rule:
    name: str  # the rule its findings carry (Finding.rule): audit-ref's check
    unit: str  # MANIFEST, SHARD, ROWS or CACHE
    what: str  # what it checks (audit-ref's line when it passes)
    check: Callable  # (ShardView) -> findings for SHARD and ROWS rules; (CacheView) for MANIFEST and CACHE
    needs: tuple[str, ...] = ()  # rules that must have passed: on the same shard, or on every shard (CACHE)
    within: object = None  # how far a compared value may be from its expectation (None: exactly equal)
    per: str = "shard"  # what audit-ref counts when it reports the rule: "shard" or "row"; "" for one judgement
    opened: bool = True  # applied by open_cache and --update (False: audit-ref's, or train-dpo's on its rows)
    damage: bool = False  # its finding is damage of a shard file (resume scores it again); else another job's
    only: str | None = None  # TOP_K: judged on the shards whose footer records a K
    current: bool = False  # judges a file of the cache's current version only (skipped.jsonl, the card)
    count: Callable | None = None  # (view, findings) -> units judged, where not one shard or its rows
    reports: str = ""  # the check its findings are reported under, where that is another rule's (default: name)

    @property
    def check_name(self) -> str:
        return self.reports or self.name


@dataclass
class CacheView:
    """A cache as the walk judges it: what each rule reads, read once."""

    root: Path  # or a storage.places.StorePath
    manifest: dict
    hash_files: bool = True  # False: the shards' sha256 is not compared (--fast-verify)
    columns: tuple | None = INDEX  # the columns read from each shard that passes its file rules (None: every one)
    keep: tuple = ()  # more columns read where a shard's hashed bytes are held (an object on a store)
    current: bool = True  # the manifest is the cache's current version (not an earlier one: schemas/history.py)
    shards: list = field(default_factory=list)  # a ShardView per listed shard, in manifest order
    info: dict = field(default_factory=dict)  # what a rule says beyond its findings (audit-ref's lines)

    def __post_init__(self):
        if not self.shards and self.manifest:
            self.shards = [ShardView(self, e["file"], e, expected_footer(self.manifest["stamps"], self.encoding, e,
                                                                         self.manifest.get("computation")), e["rows"])
                           for e in self.manifest["shards"]]

    @property
    def encoding(self) -> EncodingConfig:
        return EncodingConfig.from_dict(self.manifest["encoding"])

    @property
    def vocabulary(self) -> int | None:
        """The bound of a top-k id: the tokenizer's size as the manifest records it (None when it records none)."""
        tok = self.manifest.get("tokenizer")
        size = tok.get("size") if isinstance(tok, dict) else None
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None

    def passed(self, rule: str) -> list:
        return [s for s in self.shards if rule in s.passed]


@dataclass
class ShardView:
    """One shard file as the walk judges it: its listing (`entry`, None: no listing to check its file against), the
    footer metadata it must carry (`want`) and its row count (`rows`); its path, footer and columns once read."""

    cache: CacheView
    name: str
    entry: dict | None
    want: dict
    rows: int
    path: Path | None = None
    meta: dict = field(default_factory=dict)
    footer: list = field(default_factory=list)  # the footer's findings (rules shard_files and shard_stamps)
    table: pa.Table | None = None
    passed: set = field(default_factory=set)
    memo: dict = field(default_factory=dict)

    @property
    def frame(self) -> pl.DataFrame:
        """The columns read, with each row's index in the shard (`row`) and the shard's name (`shard`)."""
        return self.once("frame", lambda: pl.from_arrow(self.table).with_row_index("row")
                         .with_columns(pl.lit(self.name).alias("shard")))

    @property
    def top_k(self) -> int:
        return fmt.top_k_of(footer_computation(self.meta))

    def once(self, key: str, compute: Callable):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


# ---------------------------------------------------------------------------------------------------------------
# each rule's check over the walk's views


def _shard_files(s: ShardView) -> list[Finding]:
    """The file against its listing, its footer readable with the shard schema and row count, and the columns the
    walk reads readable."""
    if s.entry is not None:
        s.path, found = shard_file_findings(s.cache.root, s.entry, hash_files=s.cache.hash_files)
        if found:
            return found
    else:
        s.path = s.cache.root / s.name
    s.meta, s.footer = shard_footer_findings(s.path, s.want, s.rows)
    found = [f for f in s.footer if f.rule == "shard_files"]
    if not found and s.cache.columns != ():
        try:
            s.table = fmt.read_columns(s.path, _columns(s)).replace_schema_metadata(None)
        except CacheError as e:
            found = [Finding("shard_files", e.kind, e.message, shard=s.name, remedy=e.remedy)]
    return found


def _columns(s: ShardView) -> list | None:
    """The walk's columns, and the `keep` ones where the bytes that were hashed are held (read from them now)."""
    if s.cache.columns is None:
        return None
    names = fmt.shard_schema(fmt.top_k_of(s.cache.manifest.get("computation"))).names
    held = s.cache.keep if getattr(s.path, "content", None) is not None else ()
    return [*s.cache.columns, *[c for c in held if c in names and c not in s.cache.columns]]


def _shard_stamps(s: ShardView) -> list[Finding]:
    return [f for f in s.footer if f.rule == "shard_stamps"][:1]  # one per shard: the first key that differs


def _shard_checksums(s: ShardView) -> list[Finding]:
    return shard_checksum_findings(s.name, s.entry, s.table.column("mask_checksum").to_pylist(),
                                   s.table.column("id").to_pylist(), s.cache.encoding.to_json())[:1]


def _part(key: str, judge: Callable, rule: str) -> Callable:
    """The findings of one rule among those a shard's `judge` finds together (judged once per shard)."""
    return lambda s: [f for f in s.once(key, lambda: judge(s)) if f.rule == rule]


def _values(s: ShardView) -> list[Finding]:
    return value_findings(s.frame, s.name)


def _top_k(s: ShardView) -> list[Finding]:
    return top_k_findings(s.frame, s.top_k, s.cache.vocabulary, s.name)


def _cache_checksum(c: CacheView) -> list[Finding]:
    return cache_checksum_findings([x for s in c.shards for x in s.table.column("mask_checksum").to_pylist()],
                                   c.manifest)


def _unique_ids(c: CacheView) -> list[Finding]:
    return unique_id_findings([(s.name, s.table.column("id").to_pylist()) for s in c.passed("shard_files")])


def _skipped(c: CacheView) -> list[Finding]:
    c.info["skipped_listed"], found = skipped_findings(c.root, c.manifest)
    return found


def _card(c: CacheView) -> list[Finding]:
    c.info["card_present"], found = card_findings(c.root, c.manifest)
    return found


def _rows_rule(name: str, what: str, check: Callable, **kw) -> Rule:
    return Rule(name, ROWS, what, check, needs=("shard_files",), per="row", opened=False, **kw)


# ---------------------------------------------------------------------------------------------------------------
# the registry: its order is the walk's, the order audit-ref reports the checks in and schemas/FORMAT.md's table's

# A rule registered later (REGISTRY[name] = Rule(...), before audit-ref is imported for its report's table) is walked
# by every driver from then on.
REGISTRY: dict[str, Rule] = {rule.name: rule for rule in (
    Rule("manifest", MANIFEST, "no shard listed twice, rows adding up, one computation for every shard (the "
         "batching mode aside)", lambda c: manifest_findings(c.manifest), per=""),
    Rule("shard_files", SHARD, "sizes, sha256, schema and row counts match the manifest", _shard_files,
         damage=True),
    Rule("shard_stamps", SHARD, "metadata stamps, encoding, computation and file format match the manifest",
         _shard_stamps, needs=("shard_files",)),
    Rule("shard_unlisted", CACHE, "no shard file that no version of the cache names",
         lambda c: unlisted_findings(c.root, [e["file"] for e in c.manifest["shards"]]),
         count=lambda c, found: sum(f.count for f in found), reports="shard_files"),
    _rows_rule("row_checksums", "mask checksums recomputed from the stored ids match",
               lambda s: row_checksum_findings(s.frame, s.name)),
    Rule("shard_checksums", ROWS, "the rows' mask checksums and ids add up to each shard's", _shard_checksums,
         needs=("shard_files",)),
    Rule("cache_checksum", CACHE, "the shards' rows add up to the manifest's mask_checksum stamp", _cache_checksum,
         needs=("shard_files", "shard_checksums"), per=""),
    Rule("unique_ids", CACHE, "ids unique across shards", _unique_ids, per="row",
         count=lambda c, found: sum(s.table.num_rows for s in c.passed("shard_files"))),
    *(_rows_rule(name, what, _part("values", _values, name), within=SUM_TOLERANCE if name == "sums" else None)
      for name, what in VALUE_WHAT.items()),
    *(_rows_rule(name, what, _part("top_k", _top_k, name), only=TOP_K,
                 within={"top_k_mass": "logp_codes.mass_allowance", "top_k_dataset": TOP_K_TOLERANCE}.get(name))
      for name, what in TOP_K_RULES.items()),
    Rule("skipped_counts", CACHE, "skipped.jsonl agrees with the manifest's counts", _skipped, per="",
         opened=False, current=True),
    Rule("card", CACHE, "the dataset card's refcache metadata agrees with the manifest", _card, per="",
         opened=False, current=True),
)}


def checks() -> tuple[str, ...]:
    """audit-ref's cache checks, in the registry's order (a rule reported under another's check adds none)."""
    return tuple(dict.fromkeys(rule.check_name for rule in REGISTRY.values()))


# ---------------------------------------------------------------------------------------------------------------
# the walk and its drivers


def _applies(rule: Rule, view) -> bool:
    if isinstance(view, CacheView):
        return (view.current or not rule.current) and all(all(n in s.passed for s in view.shards)
                                                            for n in rule.needs)
    if rule.unit == ROWS and view.table is None:
        return False
    return all(n in view.passed for n in rule.needs) and (rule.only != TOP_K or view.top_k > 0)


def walk(cache: CacheView, select: Callable = lambda rule: True, shards=None):
    """Every selected rule in the registry's order over `cache`, lazily: (rule, shard view or None, findings) for
    each judgement made. A run of consecutive shard and row rules is judged shard by shard (`shards`: those views,
    default every listed one); a rule runs where what it needs passed."""
    rules = [r for r in REGISTRY.values() if select(r)]
    i = 0
    while i < len(rules):
        if rules[i].unit in (SHARD, ROWS):
            stage = []
            while i < len(rules) and rules[i].unit in (SHARD, ROWS):
                stage.append(rules[i])
                i += 1
            for shard in cache.shards if shards is None else shards:
                for rule in stage:
                    if _applies(rule, shard):
                        found = rule.check(shard)
                        shard.passed |= set() if found else {rule.name}
                        yield rule, shard, found
        else:
            rule = rules[i]
            i += 1
            if _applies(rule, cache):
                yield rule, None, rule.check(cache)


def cache_findings(root: Path, manifest: dict, *, hash_files: bool = True, read: dict | None = None, keep=()):
    """The first-finding driver: every rule open_cache applies (`opened`), lazily in the registry's order, so a
    reader can stop at the first. Values are checked by the reader on the rows it uses (VALUE_RULES). `read` (shard
    name -> table) receives the id and mask_checksum columns read here, so the reader does not read them again; and,
    for a shard on an object store whose bytes were hashed, the `keep` columns read from those bytes too."""
    cache = CacheView(root, manifest, hash_files=hash_files, keep=tuple(keep))
    for _, _, found in walk(cache, lambda rule: rule.opened):
        yield from found
    if read is not None:
        read.update({s.name: s.table for s in cache.shards})


@dataclass
class Tally:
    """What one check found over the walk: its findings, the units it judged, and whether it ran at all."""

    findings: list = field(default_factory=list)
    checked: int = 0
    ran: bool = False


def collect(cache: CacheView) -> dict[str, Tally]:
    """The collect-all driver: every rule over the whole cache, the findings and counts of each check (`checks`)."""
    tallies = {name: Tally() for name in checks()}
    for rule, shard, found in walk(cache):
        tally = tallies[rule.check_name]
        tally.findings += found
        tally.ran = True
        view = shard or cache
        tally.checked += (rule.count(view, found) if rule.count else 0 if not rule.per else
                          shard.table.num_rows if rule.per == "row" else 1)
    return tallies


def shard_view(root: Path, name: str, entry: dict | None, want: dict, rows: int) -> ShardView:
    """A shard file judged alone (precompute-ref's resume): against `entry` (its listing in the previous manifest, or
    None), the footer metadata `want` and the row count `rows`; no column is read."""
    return ShardView(CacheView(root, {}, columns=()), name, entry, want, rows)


def shard_findings(shard: ShardView) -> tuple[Rule | None, list[Finding]]:
    """The per-shard driver: one shard file's rules (unit SHARD: its file and footer) in the registry's order; the
    first rule that finds something ends it, returned with its findings. A finding of a `damage` rule is the file's
    own damage (the caller may score it again); any other says the file is not this cache's shard."""
    for rule, _, found in walk(shard.cache, lambda rule: rule.unit == SHARD, shards=[shard]):
        if found:
            return rule, found
    return None, []


def rule_table() -> str:
    """schemas/FORMAT.md's table of the rules (tests/schemas/test_rule_registry.py checks FORMAT.md holds exactly
    this)."""
    yes = lambda b, text="yes": text if b else ""
    rows = ["| rule (audit check) | unit | what it checks | needs | within | open_cache | resume |",
            "|---|---|---|---|---|---|---|"]
    for r in REGISTRY.values():
        name = f"`{r.name}`" + (f" (`{r.reports}`)" if r.reports else "")
        within = "" if r.within is None else f"`{r.within}`"
        resume = yes(r.unit == SHARD, "scored again" if r.damage else "refused")
        only = " (top-k caches)" if r.only == TOP_K else " (current version)" if r.current else ""
        rows.append(f"| {name} | {r.unit}{only} | {r.what} | {', '.join(f'`{n}`' for n in r.needs)} | {within} | "
                    f"{yes(r.opened)} | {resume} |")
    return "\n".join(rows)
