"""The train-dpo run manifest (`run-manifest.json` in --output-dir) and the reference record every checkpoint carries
(`refcache-reference.json` in each checkpoint-N), defined once: train-dpo writes them, resume and audit-ref --run read
them. See FORMAT.md, "Run manifest"."""

from __future__ import annotations

import json
import os
from pathlib import Path

from storage.files import atomic_write
from storage.reads import record_bytes

from .findings import Finding
from .stamps import cache_id, canonical_json  # noqa: F401  (cache_id: re-exported)

RUN_MANIFEST = "run-manifest.json"
RUN_KIND = "refcache-train-dpo-run"
CHECKPOINT_RECORD = "refcache-reference.json"
RUN_RECORD = "refcache-run.json"  # in --output-dir from a run's start: which run the folder's checkpoints belong to
RUN_RECORD_KIND = "refcache-train-dpo-run-record"
CACHE_MANIFEST = "manifest.json"  # the cache's own manifest (format.MANIFEST; not imported, to keep this module light)


class RunManifestError(ValueError):
    """A run manifest or checkpoint record that is missing or malformed."""


def absolute(where) -> str:
    """A path as recorded in manifests and cards, meaningful once shared: a local path made absolute, a URL
    (s3://, gs://, ...) as it is."""
    text = str(where)
    if "://" in text and not text.startswith("file://"):
        return text
    return os.path.abspath(text.removeprefix("file://"))  # ".." taken away by the text, no symlink followed


def absolute_if_local(value):
    """A place as a shared record names it: absolute where it is a local path that exists; a hub id, a URL, a word
    (resume_from_checkpoint's `true`) or nothing as given."""
    if value is not None and isinstance(value, (str, os.PathLike)) and os.path.lexists(value):
        return absolute(value)
    return value


def cache_record(cache_dir, stamps: dict, manifest_file: str = CACHE_MANIFEST) -> dict:
    """How a run names a cache: its path, its `cache_id` and stamps (what is compared), the sha256 of its
    manifest.json as it was (recorded only; the identity of runs recorded before cache_id) and the reference model
    the manifest names (recorded only: the model card's provenance, wherever the cache lives). `manifest_file`: an
    earlier version's manifest (manifest-NNNNN.json, schemas/history.py) to name that version instead."""
    from storage.places import location
    from storage.reads import sha256

    path = location(cache_dir) / manifest_file
    try:
        manifest = json.loads(record_bytes(path))
    except (OSError, ValueError):
        manifest = None
    from .history import version_of  # (polars: only where a run names a cache)

    model = manifest.get("model") if isinstance(manifest, dict) else None  # the reference, as the cache names it
    return {"path": absolute(cache_dir), "cache_id": cache_id(manifest) if isinstance(manifest, dict) else None,
            "manifest_sha256": sha256(path), "stamps": dict(stamps), "model": model if isinstance(model, dict) else None,
            "version": version_of(manifest) if isinstance(manifest, dict) else None}


def reference_record(*, train_cache: dict | None, eval_cache: dict | None, live_model: str | None,
                     data_fingerprint: str, eval_data_fingerprint: str | None) -> dict:
    """What a run was trained against: the reference (cache records, or a live model) and the data. A resumed run
    must have the same record as its checkpoint."""
    return {"cache": train_cache, "eval_cache": eval_cache, "live_model": live_model,
            "data_fingerprint": data_fingerprint, "eval_data_fingerprint": eval_data_fingerprint}


def build_run_manifest(*, reference: dict, initial_model: dict, data: dict, eval_data: dict | None, config: dict,
                       software: dict, result: dict, final_model_hash: str, finished_at: str, **sections) -> dict:
    """The run manifest. `sections` are further top-level sections (e.g. a later `peft`); readers ignore unknown
    ones."""
    return {"kind": RUN_KIND, "reference": reference, "initial_model": initial_model, "data": data,
            "eval_data": eval_data, "config": config, "seed": config.get("seed"), "software": software,
            "result": result, "final_model_hash": final_model_hash, "finished_at": finished_at, **sections}


def run_record(run_id: str, started_at: str) -> dict:
    """The output dir's run record: a new run (fresh or --overwrite-output-dir) gets a new `run_id`, a resume keeps
    it; every checkpoint's record and the run manifest carry the same `run_id`."""
    return {"kind": RUN_RECORD_KIND, "run_id": run_id, "started_at": started_at}


def read_run_record(run_dir) -> dict:
    path = Path(run_dir) / RUN_RECORD
    try:
        if path.is_symlink():
            raise OSError("a symbolic link")
        record = json.loads(record_bytes(path))
    except (OSError, ValueError) as e:
        raise RunManifestError(f"{path} is missing or not a train-dpo run record ({e})") from None
    if not isinstance(record, dict) or record.get("kind") != RUN_RECORD_KIND or not isinstance(record.get("run_id"),
                                                                                              str):
        raise RunManifestError(f"{path} is not a train-dpo run record (kind {RUN_RECORD_KIND!r} with a run_id)")
    return record


def write_json(path: Path, obj: dict) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def read_run_manifest(run_dir) -> dict:
    path = Path(run_dir) / RUN_MANIFEST
    try:
        run = json.loads(record_bytes(path))
    except (OSError, ValueError) as e:
        raise RunManifestError(f"{path} is missing or not a train-dpo run manifest ({e})") from None
    if not isinstance(run, dict) or run.get("kind") != RUN_KIND or not isinstance(run.get("reference"), dict):
        raise RunManifestError(f"{path} is not a train-dpo run manifest (kind {RUN_KIND!r} with a reference)")
    return run


def read_checkpoint_record(checkpoint) -> dict:
    path = Path(checkpoint) / CHECKPOINT_RECORD
    try:
        record = json.loads(record_bytes(path))
    except (OSError, ValueError) as e:
        raise RunManifestError(f"{path} is missing or not JSON ({e}): the checkpoint does not say which reference "
                               "and data it was trained on") from None
    if not isinstance(record, dict):
        raise RunManifestError(f"{path} is not a reference record")
    return record


def same_cache(recorded, now) -> bool:
    """Two cache records name the same cache: the same stamps and cache_id (a record written before cache_id: the
    same manifest sha256). The one rule for a resume (reference_findings) and audit-ref --run (run_cache_findings)."""
    if not isinstance(recorded, dict) or not isinstance(now, dict):
        return recorded == now
    key = "cache_id" if recorded.get("cache_id") and now.get("cache_id") else "manifest_sha256"
    return recorded.get(key) == now.get(key) and not _stamps_differ(recorded.get("stamps"), now.get("stamps") or {})


def _stamps_differ(recorded, now: dict) -> list[str]:
    """The stamps of `now` that `recorded` does not carry (the rule book's one stamp comparison)."""
    from .rules import stamp_findings  # (polars and pyarrow: only where a run is compared with a cache)

    return [f.kind for f in stamp_findings(recorded, now)]


# a run's record of what it trained against, in a user's words (the option that gives each)
REFERENCE_PARTS = {"cache": "reference cache (--ref-cache)", "eval_cache": "eval reference cache (--eval-ref-cache)",
                   "live_model": "live reference (--ref-model)", "data_fingerprint": "training data (--data)",
                   "eval_data_fingerprint": "eval data (--eval-data)"}


def reference_findings(recorded: dict, now: dict) -> list[Finding]:
    """A resumed run against its checkpoint's record: the same caches (same_cache), the same live reference and the
    same data fingerprints, or a finding naming what differs."""
    out = []
    for key, what in REFERENCE_PARTS.items():
        a, b = recorded.get(key), now.get(key)
        same = same_cache(a, b) if key in ("cache", "eval_cache") else a == b
        if not same:
            out.append(Finding("resume", "reference", f"the checkpoint was trained with another {what}",
                               expected=_named(a), found=_named(b), sides=("trained with", "you gave"),
                               remedy="resume with the --ref-cache/--ref-model, --data and --eval-data the "
                               "checkpoint was trained on, or start a new run into a fresh --output-dir"))
    return out


def _named(value) -> str:
    """A recorded reference in one line: a cache by its cache_id and path, anything else as it is (none: 'none')."""
    if isinstance(value, dict):
        name = value.get("cache_id") or (f"model hash {value['model_hash']}" if value.get("model_hash") else
                                         f"manifest sha256 {value.get('manifest_sha256')}")
        return f"{name} ({value.get('path')})"
    return "none" if value is None else f"data fingerprint {value}" if isinstance(value, str) else str(value)


def run_cache_findings(run: dict, cache_root, stamps: dict,
                       manifest_file: str = CACHE_MANIFEST) -> tuple[str | None, list[Finding]]:
    """audit-ref --run: the run names this cache (as its train or its eval cache): same_cache. `manifest_file`: the
    version of the cache to compare (cache_record). Returns (which role it had, findings)."""
    ref = run.get("reference") or {}
    roles = {k: ref.get(k) for k in ("cache", "eval_cache") if isinstance(ref.get(k), dict)}
    if not roles:
        return None, [Finding("run_cache", "run", "the run was trained against a live reference, not a cache")]
    this = cache_record(cache_root, stamps, manifest_file)
    for role, record in roles.items():
        if same_cache(record, this):
            return role, []
    role, record = next(iter(roles.items()))
    problems = []
    if record.get("cache_id") and record.get("cache_id") != this["cache_id"]:
        problems.append(f"it names a cache with cache_id {record['cache_id']} (its content: stamps, encoding and "
                        f"shard files), this cache's is {this['cache_id']}")
    elif not record.get("cache_id") and record.get("manifest_sha256") != this["manifest_sha256"]:
        problems.append(f"it names a cache manifest with sha256 {record.get('manifest_sha256')}, this cache's is "
                        f"{this['manifest_sha256']}")
    differ = _stamps_differ(record.get("stamps"), stamps)
    if differ:
        problems.append(f"its stamps {', '.join(differ)} differ from this cache's")
    return None, [Finding("run_cache", "run", "; ".join(problems))]
