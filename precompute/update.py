"""precompute-ref --update: bring a finished cache to a data set that has grown, shrunk or changed, scoring only the
rows it does not hold.

A row is the same when its id and mask checksum (its token ids) are. The update keeps every shard whose rows are all
still in the data, copies the remaining rows of a shard that lost some into a new shard (the stored values, no
forward: shards are never edited), scores the new rows (and, with --replace-changed, the rows whose content changed
under the same id) into new shards, and writes a new manifest version that lists the rows added, removed and
replaced; the manifest it replaces is kept as manifest-NNNNN.json (schemas/history.py). No file a version names is
edited or deleted. Model, tokenizer, encoding and computation must be the cache's (the rules of schemas/rules.py).

The plan depends only on the cache and the data, so an update killed at any point and run again ends in the same
files: copied shards are written again byte for byte, scored shards are judged and kept by precompute/resume.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from runtime.data import Encoded
from runtime.errors import JobError
from runtime.locations import named
from schemas import format as fmt
from schemas import history, rules
from storage import reads, writes
from storage.nearby import missing
from schemas.stamps import combined_mask_checksum, tokenizer_parts

from runtime.remedies import NEW_CACHE, rebuild
from storage.quoting import shell_word
from runtime.terminal import counted

from .config import computation_options, encoding_options, settings_refusal
from .plan import plan_shards
from .resume import Resume, finished_shards

SHOWN = 5  # ids named in a refusal


@dataclass
class Change:
    """What an update does, decided under the lock before any model is loaded (the same on every rank)."""

    version: int  # the version it writes
    base_sha256: str  # manifest.json as the update found it (kept as version_name(version - 1))
    layout: list[dict]  # the new version's shards in order: {"file", "kind": kept|copied|scored, "entry"?, "checks"?}
    score: list[int]  # rows of the data (indices of the job's Encoded) to score
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    mode: str | None = None  # the batching mode that scored the cache
    plan: list[dict] = field(default_factory=list)  # the rows to score cut into the new shards (_plan)

    @property
    def nothing(self) -> bool:
        return not (self.added or self.removed or self.replaced)


def check_finished(out, given: str = "--out ") -> None:
    """--update needs a finished cache in --out (checked before anything is made there, and again under the lock);
    `given`: how --out was given (runtime.locations.named: a config file's key)."""
    if isinstance(out, Path) and not out.exists():  # a typo: what is near, not "holds no finished cache"
        new = "; --update adds to a cache that exists: to make a new cache there, leave out --update"
        raise JobError((f"--update {given}{missing(out)}" if given.startswith("--") else
                        f"--update: {given}{missing(out)}") + new)
    if not (out / fmt.MANIFEST).is_file():
        raise JobError(f"--update: {out} holds no finished cache (no {fmt.MANIFEST}); run precompute-ref without "
                       "--update to make it (or to finish an interrupted first run)")


def prepare(out: Path, job, cfg, claimed: dict, log) -> tuple[Resume, Change]:
    """Judge the cache against this job (refusing another model, tokenizer, encoding or computation, and changed rows
    unless --replace-changed), copy the kept rows of shards that lost some, and plan the rows to score."""
    check_finished(out, named(cfg, "out"))
    try:
        base = fmt.read_manifest(out)
    except fmt.CacheError as e:
        raise JobError(f"--update: {out} holds an unreadable cache ({e.message}); {e.remedy}") from None
    _same_identity(out, base, job, cfg, claimed)
    read = {}
    for f in rules.cache_findings(out, base, read=read):  # (this update's shards, written before a kill: below)
        raise JobError(f"--update: the cache in {out} does not verify: {f.message}; audit-ref {shell_word(out)} lists "
                       f"every check it fails; {rebuild(out, base, model=cfg.model, data=cfg.data)}")
    cached = pa.concat_tables([read[e["file"]] for e in base["shards"]]) if base["shards"] else None
    encoded = job.encoded
    changes = history.row_changes(cached.column("id").to_pylist() if cached else [],
                                  cached.column("mask_checksum").to_pylist() if cached else [], encoded.ids,
                                  [p.mask_checksum for p in encoded.pairs])
    if changes["changed"] and not cfg.replace_changed:
        ids = changes["changed"]
        raise JobError(f"--update: {len(ids)} row(s) of --data changed content under an id the cache holds (their "
                       f"token ids differ from the cached ones): {', '.join(map(repr, ids[:SHOWN]))}"
                       f"{' …' if len(ids) > SHOWN else ''}; pass --replace-changed to score them again and replace "
                       "them, or give the new rows new ids")
    version = history.version_of(base) + 1
    drop = pa.array(changes["removed"] + changes["changed"], pa.string())
    layout, copied = [], 0
    for entry in base["shards"]:
        table = read[entry["file"]]
        rows = pc.indices_nonzero(pc.invert(pc.is_in(table.column("id"), value_set=drop))).to_pylist()
        # (a typed index: an empty list is an array of nulls, which take() refuses when a shard loses every row)
        checks = table.column("mask_checksum").take(pa.array(rows, pa.int64())).to_pylist()
        if len(rows) == entry["rows"]:
            layout.append({"file": entry["file"], "kind": "kept", "entry": entry, "checks": checks})
        elif rows:
            name = _name(version, copied)
            copied += 1
            layout.append({"file": name, "kind": "copied", "entry": _copy(out / entry["file"], out / name, rows, base,
                                                                          entry, cfg), "checks": checks})
    new = set(changes["added"]) | set(changes["changed"])
    score = [n for n, rid in enumerate(encoded.ids) if rid in new]
    change = Change(version, reads.sha256(out / fmt.MANIFEST), layout, score, changes["added"], changes["removed"],
                    changes["changed"], (base.get("computation") or {}).get("mode"))
    change.plan = plan = _plan(job, change, cfg, first=copied)
    layout += [{"file": s["file"], "kind": "scored"} for s in plan]
    resume = finished_shards(out, plan, job.stamps, cfg.encoding, claimed,
                             keep=history.named_shards(out) | {s["file"] for s in layout if s["kind"] == "copied"})
    resume.computation = base.get("computation") if isinstance(base.get("computation"), dict) else resume.computation
    if resume.reclaimed:
        log(f"removed {', '.join(resume.reclaimed)}: left by an interrupted update, named by no version of the cache")
    if change.nothing:  # no version is written: the cache stays at the one it is
        log(f"update: nothing to change (no row added, removed or replaced); the cache stays at version {version - 1}")
    else:
        log(f"update to version {version}: {counted(len(change.added), 'row')} added, {len(change.removed)} removed, "
            f"{len(change.replaced)} replaced; {counted(sum(s['kind'] == 'kept' for s in layout), 'shard')} kept, "
            f"{copied} copied without their removed rows, {counted(len(score), 'row')} to score")
    return resume, change


def _same_identity(out: Path, base: dict, job, cfg, claimed: dict) -> None:
    """Model, tokenizer and encoding (the stamps' rule) and the computation known before loading (the computation
    rule) must be the cache's."""
    stamps = {k: job.stamps[k] for k in ("model_hash", "tokenizer_hash")}
    recorded = {**base["stamps"], "encoding": base["encoding"], "tokenizer": base.get("tokenizer")}
    where = f"the cache {out}"
    for f in rules.stamp_findings(recorded, {**stamps, "encoding": cfg.encoding.to_dict()}, where=where,
                                  tokenizer_parts=tokenizer_parts(job.checkpoint.tokenizer)):
        if f.kind == "encoding":  # an option given that the cache was made without: name it and its value
            differ = encoding_options(f.found or {}, f.expected or {})
            if differ:
                raise JobError("--update: " + settings_refusal(differ, f"{where} was", update=True))
        raise JobError(f"--update: {f.message}\n{f.sides_text()}\n  remedy:    {NEW_CACHE}")
    computation = base.get("computation") if isinstance(base.get("computation"), dict) else {}
    differ = rules.computation_findings(computation, claimed, partial=True, where=where, remedy=NEW_CACHE)
    if differ:
        raise JobError("--update: " + (settings_refusal(computation_options(differ), f"{where} was", update=True)
                                       or f"{differ[0].message}; {differ[0].remedy}"))


def beyond_batching(differs: list, recorded: dict, now: dict, log) -> list:
    """The computation findings of an update's loaded model against the cache's that matter: a batching mode the
    new rows cannot use (one a probe of them rejected, e.g. kv_cache for rows longer than a sliding window) fell back
    to an exact one, which scores them as the model's own forward does; its shards record it (fmt.MODE_KEYS)."""
    mode = [f for f in differs if set(f.expected) <= set(fmt.MODE_KEYS)]
    if mode and recorded.get("mode") != now.get("mode"):
        log(f"the cache's rows were scored with batching {recorded.get('mode')}, which the new rows cannot use: they "
            f"are scored with {now.get('mode')} (proven on them like every mode), recorded with their shards")
    return [f for f in differs if f not in mode]


def _name(version: int, n: int) -> str:
    return f"shard-v{version:05d}-{n:05d}.parquet"


def _copy(source: Path, dest: Path, rows: list[int], base: dict, entry: dict, cfg) -> dict:
    """The kept rows of a shard that lost some, into a new shard: the stored values as they are, with the
    computation that scored them (the shard's own, if it has one: fmt.MODE_KEYS)."""
    table = fmt.stored_rows(source, rows)
    own = entry.get("computation") if isinstance(entry.get("computation"), dict) else None
    written = fmt.write_shard(dest, table, model_hash=base["stamps"]["model_hash"],
                              tokenizer_hash=base["stamps"]["tokenizer_hash"], encoding=cfg.encoding,
                              computation=own or base.get("computation") or {})
    return written | ({"computation": own} if own else {})


def _plan(job, change: Change, cfg, first: int) -> list[dict]:
    """The rows to score cut into new shards (precompute-ref's plan over them alone), named after the version."""
    plan = plan_shards(_rows(job.encoded, change.score), cfg.rows_per_shard, cfg.encoding)
    return [{**s, "file": _name(change.version, first + n)} for n, s in enumerate(plan)]


def _rows(encoded: Encoded, picked: list[int]) -> Encoded:
    """The picked rows of `encoded`; what was skipped, identical and the formats stay the whole data's."""
    return replace(encoded, ids=[encoded.ids[i] for i in picked], pairs=[encoded.pairs[i] for i in picked])


def applied(job, change: Change):
    """The job as the update runs it: only the rows to score, cut into the new shards, scored by the cache's mode."""
    return replace(job, encoded=_rows(job.encoded, change.score), plan=change.plan, change=change, batching=change.mode)


def versioned(out: Path, manifest: dict, entries: list[dict], job, cfg) -> tuple[dict, list[dict]]:
    """The new version's manifest from the one precompute-ref would write for the scored rows alone (`manifest`,
    `entries`): every shard of the layout in order, the stamps' mask checksum over their rows, the rows added,
    removed and replaced, and the history. The manifest it replaces is kept first as manifest-NNNNN.json. An update
    that changes nothing keeps the cache's manifest as it is."""
    change: Change = job.change
    base = fmt.read_manifest(out)
    if change.nothing:
        return base, base["shards"]
    if reads.sha256(out / fmt.MANIFEST) != change.base_sha256:
        raise JobError(f"--update: {out / fmt.MANIFEST} changed while the update ran; run the update again")
    made = fmt.scored_computation(manifest.get("computation") or {})
    own = {"computation": made} if made != fmt.scored_computation(base.get("computation") or {}) else {}
    scored = {e["file"]: e | own for e in entries}  # scored in another mode than the cache's: said per shard
    checks = {s["file"]: [p.mask_checksum for p in job.encoded.pairs[s["start"]:s["stop"]]] for s in job.plan}
    shards = [s["entry"] if s["kind"] != "scored" else scored[s["file"]] for s in change.layout]
    every = [c for s in change.layout for c in (s["checks"] if s["kind"] != "scored" else checks[s["file"]])]
    _keep_version(out, base)
    return {**manifest, "computation": base.get("computation"),  # the cache's; a shard scored otherwise says so
            "stamps": {**manifest["stamps"], "mask_checksum": combined_mask_checksum(every, cfg.encoding.to_json())},
            "rows": sum(e["rows"] for e in shards), "shards": shards, "version": change.version,
            "history": [*(base.get("history") or []), history.history_entry(out, base)],
            "update": {"from_version": change.version - 1, "added": change.added, "removed": change.removed,
                       "replaced": change.replaced}}, shards


def _keep_version(out: Path, base: dict) -> None:
    """manifest.json as it is, as manifest-NNNNN.json: written once; one already there must be the same bytes (an
    update killed after writing it), anything else is refused."""
    data = (out / fmt.MANIFEST).read_bytes()
    path = out / history.version_name(history.version_of(base))
    if path.exists():
        if path.is_symlink() or not path.is_file() or path.read_bytes() != data:
            raise JobError(f"--update: {path} is already there and is not the manifest it would keep (version "
                           f"{history.version_of(base)}); move it away and run the update again")
        return
    writes.write_whole(path, lambda f: f.write(data))


def summary(change: Change) -> dict:
    return {"version": change.version, "added": len(change.added), "removed": len(change.removed),
            "replaced": len(change.replaced), "kept_shards": sum(s["kind"] == "kept" for s in change.layout),
            "copied_shards": sum(s["kind"] == "copied" for s in change.layout)}
