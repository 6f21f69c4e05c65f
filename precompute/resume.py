"""What --out may hold at all (a cache's own files: own_files), what precompute-ref keeps of an earlier run there
(resume) and what --overwrite deletes.

Resume judges every shard it would keep by the rules of schemas/rules.py: the file against the previous manifest
(size and sha256) when one exists, the footer (schema, row count, stamps, the plan's mask and ids checksums) always,
and the computation that scored it against this run's. A damaged shard is scored again; a shard of another job
(other model, tokenizer, encoding, rows or ids) or made with other settings is refused, naming the difference.
"""

from __future__ import annotations

import json
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import JobError
from runtime.locks import is_lock_file
from runtime.remedies import OVERWRITE, UPDATE, rebuild  # UPDATE: the remedy when only the data differs
from schemas import format as fmt
from schemas import history, rules
from storage import places, writes
from schemas.card import read_card_metadata
from schemas.findings import DAMAGED
from schemas.encoding import EncodingConfig
from storage.files import TEMP
from storage.reads import record_bytes

from .config import check_recorded, computation_options, encoding_options, settings_refusal

SHARD = re.compile(r"^shard-(v\d{5}-)?\d{5}\.parquet$")  # plan_shards' names (and --update's: precompute/update.py)
# an interrupted first run (shards, no manifest yet) of other data: --update needs a finished cache
UNFINISHED = ("it is an interrupted first run (no manifest.json yet) of other data: finish it with the data it was "
              "started on, or " + OVERWRITE)
COMPUTATION = "run with the recorded settings to resume, or pass --overwrite to start over"  # the remedy of a resume


@dataclass
class Resume:
    done: set  # shard files kept as they are
    computation: dict | None  # what scored them (None: nothing kept)
    rescore: list  # (file, reason) of damaged shards that will be scored again
    reclaimed: list = field(default_factory=list)  # --update: shards of an interrupted update that no version names


def _previous_manifest(out: Path, stamps: dict, encoding: EncodingConfig) -> dict | None:
    if not (out / fmt.MANIFEST).exists():
        return None
    try:
        manifest = fmt.read_manifest(out)
    except fmt.CacheError as e:
        raise JobError(f"{out} holds an unreadable cache ({e.message}); "
                       + (e.remedy if e.remedy.startswith(DAMAGED) else OVERWRITE)) from None
    recorded = {**manifest["stamps"], "encoding": manifest["encoding"]}
    found = list(rules.stamp_findings(recorded, {**{k: stamps[k] for k in fmt.STAMPS}, "encoding": encoding.to_dict()}))
    for f in sorted(found, key=lambda f: f.kind != "encoding"):  # another encoding also changes the mask checksum
        differ = encoding_options(f.found or {}, f.expected or {}) if f.kind == "encoding" else []
        if differ:
            raise JobError(settings_refusal(differ, f"{out} already holds a different cache,", update=False))
        remedy = UPDATE if f.kind == "mask_checksum" else OVERWRITE
        raise JobError(f"{out} already holds a different cache; {remedy}\n  {f.kind}:\n{f.sides_text('    ')}")
    return manifest


def _manifest_agrees(out: Path, previous: dict | None, entry: dict | None, name: str, footer: dict | None) -> None:
    """A shard the manifest lists was scored as the manifest says: precompute-ref writes the two from the same run, so
    a manifest whose computation its own shards' footers contradict (an edited setting) is a damaged cache, refused
    with the rebuild command; never read as "the cache's setting" and offered to the user to pass."""
    if not previous or not entry or footer is None:
        return
    said = fmt.shard_computation(previous, entry)
    if not isinstance(said, dict):
        return  # no record, or not a mapping: the rules and check_recorded name it
    differ = rules.computation_findings(fmt.scored_computation(said), fmt.scored_computation(footer), where=name)
    if differ:
        settings = ", ".join(f"{k}={v!r}" for f in differ for k, v in f.expected.items())
        scored = ", ".join(f"{k}={v!r}" for f in differ for k, v in f.found.items())
        raise JobError(f"{out / fmt.MANIFEST} records {settings}, but {name}, a shard it lists, was scored with {scored} "
                       "(precompute-ref writes both from the same run, so the manifest was edited)\n  remedy:   "
                       + rebuild(out, previous))


def _refuse(findings, what: str, where: str | None = None):
    """`where`: the cache, when this run's options are what differs (named as the options to pass)."""
    f = findings[0]
    if f.kind == "computation":
        raise JobError((where and settings_refusal(computation_options(g for g in findings if g.kind == "computation"), where,
                                                   update=False))
                       or f"{what}: {f.message}\n{f.sides_text()}\n  remedy:   {f.remedy}")
    raise JobError(f"{what}; {OVERWRITE}\n  {f.message}\n{f.sides_text()}")


def finished_shards(out: Path, plan: list[dict], stamps: dict, encoding: EncodingConfig, claimed: dict, *,
                    keep: set | None = None) -> Resume:
    """Shards already written by an earlier run of this same job with these settings (`claimed`: the computation
    values known before the model is loaded). `keep` (precompute-ref --update, precompute/update.py): the shards of
    the cache's versions, which are not this run's to judge; the manifest is then the update's to judge. A shard an
    interrupted update left (history.pending_shards: named for the next version, named by no version) that this
    update does not plan, or plans for other rows, is reclaimed: removed, or scored again."""
    temporaries = [path for path in own_files(out) if TEMP.match(path.name)]  # removed once nothing is refused
    previous = _previous_manifest(out, stamps, encoding) if keep is None else None
    listed = {e["file"]: e for e in previous["shards"]} if previous else {}
    planned = {s["file"]: s for s in plan}
    pending = history.pending_shards(out) - set(keep) if keep is not None else set()
    done, computations, rescore, reclaimed = set(), {}, [], []
    for path in sorted(out.glob("*.parquet")):
        if keep is not None and path.name in keep:
            continue
        want = planned.get(path.name)
        if want is None and path.name in pending:  # no version owns it, and this update writes no shard of its name
            writes.remove(path)
            reclaimed.append(path.name)
            continue
        if want is None:
            raise _other_rows(out, path.name, previous is not None or keep is not None,
                              updated=history.UPDATE_SHARD.match(path.name) is not None)
        # the registry's shard rules (schemas/rules.py shard_findings): the file against the previous manifest's
        # listing (if any), the footer against the plan; damage is scored again, anything else refused
        shard = rules.shard_view(out, path.name, listed.get(path.name), rules.expected_footer(
            stamps, encoding, want, None, with_computation=False), want["stop"] - want["start"])
        rule, found = rules.shard_findings(shard)
        recorded = rules.footer_computation(shard.meta) or {}
        differs = rules.computation_findings(recorded, claimed, partial=True, where=path.name, remedy=COMPUTATION)
        if path.name not in pending:  # a readable footer of other settings or other rows: refused, never "damage"
            if shard.meta:  # a value precompute-ref never writes is damage, never a setting to name as the cache's
                check_recorded(out, f"{out / path.name}'s footer", recorded, _json_dict(shard.meta.get("encoding")))
                _manifest_agrees(out, previous, listed.get(path.name), path.name, recorded)
            if recorded and differs:
                _refuse(differs, f"{out} already holds a different cache", f"{out} already holds a different cache,")
            other = encoding_options(_json_dict(shard.meta.get("encoding")), encoding.to_dict()) if shard.meta else []
            if other:
                raise JobError(settings_refusal(other, f"{out} already holds a different cache,", update=False))
            other_rows = [k for k in ("ids_checksum", "mask_checksum")
                          if k in shard.meta and shard.meta.get(k) != shard.want.get(k)]
            if other_rows:
                raise _other_rows(out, path.name, previous is not None or keep is not None, other_rows)
        if rule is not None and rule.damage:
            rescore.append((path.name, found[0].message))
            continue
        if (differs or found) and path.name in pending:  # another update's rows: this one's to rewrite
            why = (differs or found)[0].message
            rescore.append((path.name, f"left by an interrupted update of other rows ({why}), which no "
                            "version names"))
            continue
        if differs or found:
            _refuse(differs or found, f"{out} already holds a different cache", f"{out} already holds a different cache,")
        computations[path.name] = recorded
        done.add(path.name)
    agreed = _agreed(previous, computations)
    for path in temporaries:
        writes.remove(path)
    return Resume(done, agreed, rescore, reclaimed)


def _other_rows(out: Path, name: str, finished: bool, kinds=(), *, updated: bool = False) -> JobError:
    """A shard of other rows (other data, or other --rows-per-shard) than this job plans under its name (`kinds`:
    the footer's checksums that differ); `updated`: a shard an --update wrote, which only --update plans."""
    which = f"its {' and '.join(kinds)} differ{'s' if len(kinds) == 1 else ''}: " if kinds else ""
    why = (f"{name} is a shard an update wrote: an updated cache is brought to data by --update (nothing is scored "
           "when the data is what it holds)" if updated else
           f"{name} holds other rows than this job's shard of that name ({which}other data or --rows-per-shard?)")
    return JobError(f"{out} already holds a different cache; {UPDATE if finished else UNFINISHED}\n  {why}")


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


def own_files(out: Path) -> list[Path]:
    """The files of --out that are a cache's own, which precompute-ref may replace or delete; the lock file is not
    listed. Anything else there (another program's files, a folder, a link, a skipped.jsonl that is not a list of
    this cache's skipped rows, a README.md that is not its dataset card) is refused, naming it, before anything is written or deleted: precompute-ref writes
    only into an empty folder or one holding its own cache. The one rule for a resume and for --overwrite.

    A cache is there when manifest.json is a refcache manifest or a shard carries a refcache footer; then its
    manifest.json, its earlier versions (manifest-NNNNN.json holding a refcache manifest: --update, schemas/history.py),
    its shard-NNNNN.parquet and shard-vNNNNN-MMMMM.parquet files (a damaged one is scored again), its skipped.jsonl (JSON Lines of
    skipped rows, agreeing with the manifest's counts when there is one) and its README.md (a dataset card with
    refcache metadata, of the manifest's stamps when there is one) are its own (a shard-named file no version of the
    cache names, a local one, where it begins as Parquet does); other .parquet files only with a refcache footer; a temporary file of an atomic write is its
    own where a cache is there, its name is one of these files' and it begins as the cache's writer begins that file
    (removed only once the resume refuses nothing); any other file is another program's."""
    entries = {}
    for p in sorted(out.iterdir()):
        try:
            entries[p] = places.lstat(p)  # an object on a store: a plain file (a prefix below: a folder)
        except FileNotFoundError:  # a temporary file another writer has just renamed (it holds the lock)
            continue
    plain = {p for p, st in entries.items() if stat.S_ISREG(st.st_mode)}
    manifest = _manifest_json(out / fmt.MANIFEST) if out / fmt.MANIFEST in plain else None
    footers = {p for p in plain if p.suffix == ".parquet" and
               (not SHARD.match(p.name) or manifest is None) and _has_refcache_footer(p)}
    cache = manifest is not None or bool(footers)
    listed = history.named_shards(out) if manifest is not None else set()  # shards a version of the cache names
    own, foreign = [], []
    for p, st in entries.items():
        if is_lock_file(p):
            continue
        why = _not_own(p, st, plain, footers, cache, manifest, listed)
        if why is None:
            own.append(p)
        else:
            foreign.append(f"{p.name} ({why})" if why else p.name)
    if foreign:
        raise JobError(f"--out {out} holds files that are not this cache's own: "
                       + ", ".join(foreign[:8]) + (" …" if len(foreign) > 8 else "")
                       + "; nothing was written or deleted. precompute-ref writes only into an empty folder or one "
                       "holding its own cache: move them elsewhere, or choose another --out")
    return own


def _not_own(p: Path, st, plain: set, footers: set, cache: bool, manifest: dict | None,
             listed: frozenset | set = frozenset()) -> str | None:
    """Why `p` is not the cache's own ("" when no reason can be named), or None when it is."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if p not in plain:
        return "not a regular file"
    if TEMP.match(p.name):  # atomic_write's `.{name}.tmp-{pid}`: ours only where `name` is one this cache writes,
        # in a folder that holds a cache (a folder holding only a temporary file has no finished work to keep)
        target = p.name[1:p.name.rindex(".tmp-")]
        ours = SHARD.match(target) or history.VERSION_FILE.match(target) or target in (fmt.MANIFEST, fmt.SKIPPED,
                                                                                       fmt.CARD)
        return None if cache and ours and _begins_as_ours(p, target) else "not a temporary file of this cache"
    if p.name == fmt.MANIFEST:
        return None if cache else "not a refcache manifest"
    if history.VERSION_FILE.match(p.name):  # an earlier version of the manifest (precompute-ref --update)
        return None if cache and _manifest_json(p) is not None else "not a refcache manifest version"
    if p.suffix == ".parquet":  # a shard a version of the cache names (a damaged one is scored again), or another of
        # a shard's name where a cache is there beginning as Parquet does: a user's text under such a name is not (h44)
        named = cache and SHARD.match(p.name) and (p.name in listed or isinstance(p, places.StorePath)
                                                   or _begins_as_ours(p, p.name))
        return None if p in footers or named else "no refcache footer"
    if p.name == fmt.SKIPPED:
        return None if cache and _own_skipped(p.parent, manifest) else "not the list of rows this cache skipped"
    if p.name == fmt.CARD:
        if cache and _own_card(p, manifest):
            return None
        return ("a refcache dataset card whose stamps are not manifest.json's: the card or the manifest was edited, "
                "so it is not provably this cache's; audit-ref names what else fails" if cache and _own_card(p, None)
                else "not this cache's dataset card")
    return ""


# how the cache's writers begin each file (a manifest: format.write_manifest's sorted, indented JSON; skipped.jsonl:
# a skipped row's record; the card: its YAML header, which names refcache within its first lines)
BEGINS = {"shard": b"PAR1", "manifest": b'{\n  "computation"', "skipped": b'{"file": '}


def _begins_as_ours(p: Path, target: str) -> bool:
    """A temporary file of a killed writer begins as that writer began it (or holds nothing yet); a name alone
    proves nothing: a user's notes, even a YAML- or JSON-headed one, under that name are kept."""
    try:
        with open(p, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    if not head:
        return True
    if target == fmt.CARD:
        return head.startswith(b"---\n") and b"refcache" in head
    kind = "shard" if SHARD.match(target) else "skipped" if target == fmt.SKIPPED else "manifest"
    return head.startswith(BEGINS[kind][:len(head)])


def _json_dict(text) -> dict:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _manifest_json(path: Path) -> dict | None:
    try:
        manifest = json.loads(record_bytes(path))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "format_version" in manifest else None


def _own_skipped(out: Path, manifest: dict | None) -> bool:
    """skipped.jsonl as precompute-ref writes it (a row per line, with its reason), and the one the manifest counts."""
    try:
        lines = [json.loads(line) for line in (out / fmt.SKIPPED).read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    except (OSError, ValueError):
        return False
    if not lines or not all(isinstance(r, dict) and "row" in r and isinstance(r.get("reason"), str) for r in lines):
        return False
    return manifest is None or not rules.skipped_findings(out, manifest)[1]


def _own_card(path: Path, manifest: dict | None) -> bool:
    """README.md as precompute-ref writes it (a dataset card with refcache metadata, schemas/card.py), of a cache with
    the manifest's stamps, or those of an earlier version the cache keeps (verified by its history's sha256: an
    --update killed between its manifest and its card leaves the card of the version before, h44). Only the stamps:
    the rest of it is rewritten from the manifest at the end of the run."""
    meta = read_card_metadata(path) or {}
    stamps = (meta.get("refcache") or {}).get("stamps") if isinstance(meta.get("refcache"), dict) else None
    if not isinstance(stamps, dict):
        return False
    if manifest is None:
        return True
    wanted = {k: stamps.get(k) for k in fmt.STAMPS}
    return any(not rules.stamp_findings(m.get("stamps"), wanted) for _, _, m in history.versions(path.parent, manifest))


def clear_cache_dir(out: Path) -> None:
    """--overwrite: delete the cache's own files (own_files; the manifest first), refusing a folder that holds
    anything else before deleting anything; the lock stays (this run holds it)."""
    own = own_files(out)
    own.sort(key=lambda p: p.name != fmt.MANIFEST)  # the manifest first: from then on the directory reads incomplete
    for p in own:
        writes.remove(p)


def _has_refcache_footer(path: Path) -> bool:
    try:
        return "format_version" in fmt.read_shard_metadata(path)
    except Exception:  # not Parquet at all: not ours
        return False
