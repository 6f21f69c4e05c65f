"""What precompute-ref keeps of an earlier run in --out (resume) and what --overwrite may delete.

Resume judges every shard it would keep by the rules of schemas/rules.py: the file against the previous manifest
(size and sha256) when one exists, the footer (schema, row count, stamps, the plan's mask and ids checksums) always,
and the computation that scored it against this run's. A damaged shard is scored again; a shard of another job
(other model, tokenizer, encoding, rows or ids) or made with other settings is refused, naming the difference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import JobError
from schemas import format as fmt
from schemas import rules
from schemas.encoding import EncodingConfig

TEMP = re.compile(r"^\..+\.tmp-\d+$")  # format.atomic_write's temporary names
SHARD = re.compile(r"^shard-\d{5}\.parquet$")  # plan_shards' names
OVERWRITE = "use --overwrite to replace it, or choose another --out"
COMPUTATION = "run with the recorded settings to resume, or pass --overwrite to start over"  # the remedy of a resume


@dataclass
class Resume:
    done: set  # shard files kept as they are
    computation: dict | None  # what scored them (None: nothing kept)
    rescore: list  # (file, reason) of damaged shards that will be scored again


def _previous_manifest(out: Path, stamps: dict, encoding: EncodingConfig) -> dict | None:
    if not (out / fmt.MANIFEST).exists():
        return None
    try:
        manifest = fmt.read_manifest(out)
    except fmt.CacheError as e:
        raise JobError(f"{out} holds an unreadable cache ({e.message}); {OVERWRITE}") from None
    recorded = {**manifest["stamps"], "encoding": manifest["encoding"]}
    for f in rules.stamp_findings(recorded, {**{k: stamps[k] for k in fmt.STAMPS}, "encoding": encoding.to_dict()}):
        raise JobError(f"{out} already holds a different cache; {OVERWRITE}\n  {f.kind}: existing {f.found}, "
                       f"this job {f.expected}")
    return manifest


def _refuse(findings, what: str):
    f = findings[0]
    if f.kind == "computation":
        raise JobError(f"{what}: {f.message}\n  recorded: {f.expected}\n  this run: {f.found}\n  remedy:   {f.remedy}")
    raise JobError(f"{what}; {OVERWRITE}\n  {f.message}\n  this job: {f.expected}\n  found:    {f.found}")


def finished_shards(out: Path, plan: list[dict], stamps: dict, encoding: EncodingConfig, claimed: dict) -> Resume:
    """Shards already written by an earlier run of this same job with these settings (`claimed`: the computation
    values known before the model is loaded)."""
    for tmp in out.iterdir():
        if TEMP.match(tmp.name):
            tmp.unlink()
    previous = _previous_manifest(out, stamps, encoding)
    listed = {e["file"]: e for e in previous["shards"]} if previous else {}
    planned = {s["file"]: s for s in plan}
    done, computations, rescore = set(), {}, []
    for path in sorted(out.glob("*.parquet")):
        want = planned.get(path.name)
        if want is None:
            raise JobError(f"{out} already holds a different cache; {OVERWRITE}\n  {path.name} is not a shard of this "
                           "job (other data or --rows-per-shard?)")
        entry = listed.get(path.name)
        damage = rules.shard_file_findings(out, entry)[1] if entry else []
        if not damage:
            meta, found = rules.shard_footer_findings(path, rules.expected_footer(stamps, encoding, want, None,
                                                                            with_computation=False),
                                                      want["stop"] - want["start"])
            damage = [f for f in found if f.rule == "shard_files"]
            if not damage:
                recorded = rules.footer_computation(meta) or {}
                differs = rules.computation_findings(recorded, claimed, partial=True, where=path.name,
                                                       remedy=COMPUTATION)
                if differs or found:
                    _refuse(differs or found, f"{out} already holds a different cache")
                computations[path.name] = recorded
        if damage:
            rescore.append((path.name, damage[0].message))
        else:
            done.add(path.name)
    return Resume(done, _agreed(previous, computations), rescore)


def _agreed(previous: dict | None, computations: dict[str, dict]) -> dict | None:
    """The one computation every kept shard (and the previous manifest) records; refuse a mix."""
    recorded = previous.get("computation") if previous else None
    recorded = recorded if isinstance(recorded, dict) else None  # a manifest without one: judged by the shards
    for name, comp in computations.items():
        if recorded is None:
            recorded = comp
        found = rules.computation_findings(recorded, comp, where="an earlier shard", remedy=COMPUTATION)
        if found:
            _refuse(found, f"{name} was scored with other settings than the rest of the cache")
    return recorded if computations else None


def clear_cache_dir(out: Path) -> None:
    """--overwrite: delete the cache's own files (the manifest first, then the shards it lists or that carry a
    refcache footer under the planned names, skipped.jsonl, temporary files), after making sure the folder holds
    nothing else; the lock stays (this run holds it)."""
    listed = set()
    if (out / fmt.MANIFEST).exists():
        try:
            listed = {e["file"] for e in fmt.read_manifest(out)["shards"] if isinstance(e["file"], str)}
        except fmt.CacheError:
            listed = set()
    own, foreign = [], []
    for p in sorted(out.iterdir()):
        if p.name == fmt.LOCK:
            continue
        mine = p.is_file() and not p.is_symlink() and (
            p.name in (fmt.MANIFEST, fmt.SKIPPED) or TEMP.match(p.name) or p.name in listed
            or (SHARD.match(p.name) and _has_refcache_footer(p)))
        (own if mine else foreign).append(p)
    if foreign:
        raise JobError(f"--overwrite: {out} holds files that are not this cache's own ("
                       + ", ".join(p.name for p in foreign[:5]) + (" …" if len(foreign) > 5 else "")
                       + "); nothing was deleted. Move them elsewhere, or choose another --out")
    own.sort(key=lambda p: p.name != fmt.MANIFEST)  # the manifest first: from then on the directory reads incomplete
    for p in own:
        p.unlink(missing_ok=True)


def _has_refcache_footer(path: Path) -> bool:
    try:
        return "format_version" in fmt.read_shard_metadata(path)
    except Exception:  # not Parquet at all: not ours
        return False
