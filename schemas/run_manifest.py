"""The train-dpo run manifest (`run-manifest.json` in --output-dir) and the reference record every checkpoint carries
(`refcache-reference.json` in each checkpoint-N), defined once: train-dpo writes them, resume and audit-ref --run read
them. See FORMAT.md, "Run manifest"."""

from __future__ import annotations

import json
from pathlib import Path

from .files import atomic_write
from .findings import Finding
from .stamps import file_sha256

RUN_MANIFEST = "run-manifest.json"
RUN_KIND = "refcache-train-dpo-run"
CHECKPOINT_RECORD = "refcache-reference.json"
CACHE_MANIFEST = "manifest.json"  # the cache's own manifest (format.MANIFEST; not imported, to keep this module light)


class RunManifestError(ValueError):
    """A run manifest or checkpoint record that is missing or malformed."""


def cache_record(cache_dir, stamps: dict) -> dict:
    """How a run names a cache: its path, the sha256 of its manifest.json and its stamps."""
    return {"path": str(cache_dir), "manifest_sha256": file_sha256(Path(cache_dir) / CACHE_MANIFEST),
            "stamps": dict(stamps)}


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


def write_json(path: Path, obj: dict) -> None:
    data = (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def read_run_manifest(run_dir) -> dict:
    path = Path(run_dir) / RUN_MANIFEST
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RunManifestError(f"{path} is missing or not a train-dpo run manifest ({e})") from None
    if not isinstance(run, dict) or run.get("kind") != RUN_KIND or not isinstance(run.get("reference"), dict):
        raise RunManifestError(f"{path} is not a train-dpo run manifest (kind {RUN_KIND!r} with a reference)")
    return run


def read_checkpoint_record(checkpoint) -> dict:
    path = Path(checkpoint) / CHECKPOINT_RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RunManifestError(f"{path} is missing or not JSON ({e}): the checkpoint does not say which reference "
                               "and data it was trained on") from None
    if not isinstance(record, dict):
        raise RunManifestError(f"{path} is not a reference record")
    return record


def _cache_key(record) -> tuple | None:
    if not isinstance(record, dict):
        return None
    return record.get("manifest_sha256"), json.dumps(record.get("stamps"), sort_keys=True)


def reference_findings(recorded: dict, now: dict) -> list[Finding]:
    """A resumed run against its checkpoint's record: the same caches (manifest sha256 and stamps), the same live
    reference and the same data fingerprints, or a finding naming what differs."""
    out = []
    for key in ("cache", "eval_cache", "live_model", "data_fingerprint", "eval_data_fingerprint"):
        a, b = recorded.get(key), now.get(key)
        same = _cache_key(a) == _cache_key(b) if key in ("cache", "eval_cache") else a == b
        if not same:
            out.append(Finding("resume", "reference", f"the checkpoint was trained with another {key}", expected=a,
                               found=b, remedy="resume with the --ref-cache/--ref-model, --data and --eval-data the "
                               "checkpoint was trained on, or start a new run into a fresh --output-dir"))
    return out


def run_cache_findings(run: dict, cache_root, stamps: dict) -> tuple[str | None, list[Finding]]:
    """audit-ref --run: the run names this cache (as its train or its eval cache) by manifest sha256 and stamps.
    Returns (which role it had, findings)."""
    ref = run.get("reference") or {}
    roles = {k: ref.get(k) for k in ("cache", "eval_cache") if isinstance(ref.get(k), dict)}
    if not roles:
        return None, [Finding("run_cache", "run", "the run was trained against a live reference, not a cache")]
    sha = file_sha256(Path(cache_root) / CACHE_MANIFEST)
    for role, record in roles.items():
        if record.get("manifest_sha256") == sha and record.get("stamps") == stamps:
            return role, []
    record = next(iter(roles.values()))
    problems = []
    if record.get("manifest_sha256") != sha:
        problems.append(f"it names a cache manifest with sha256 {record.get('manifest_sha256')}, this cache's is {sha}")
    if record.get("stamps") != stamps:
        wrong = [k for k in stamps if (record.get("stamps") or {}).get(k) != stamps[k]]
        problems.append(f"its stamps {', '.join(wrong) or '(all)'} differ from this cache's")
    return None, [Finding("run_cache", "run", "; ".join(problems))]
