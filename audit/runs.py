"""audit-ref --data (the data re-encoded and compared row by row) and --run (a train-dpo output names this cache and
holds the weights it recorded; the run manifest format is schemas/run_manifest.py)."""

from __future__ import annotations

from pathlib import Path

import click
import polars as pl

from runtime import remedies
from runtime.placement import describe
from schemas import history, run_manifest
from schemas.encoding import EncodingConfig
from schemas.rules import stamp_findings
from schemas.stamps import (WeightsError, adapter_config_fingerprint, adapter_fields, adapter_hash, merged_model_hash,
                            model_hash)

from .cache import CacheScan
from .checks import FAIL, PASS, SKIP, Check
from .checks import short as _short


def audit_data(manifest: dict, scan: CacheScan, data: str, tokenizer, root: Path | None = None) -> Check:
    """Re-encode the data with the recorded encoding and compare every row's mask checksum with the cached one. A
    cache made by precompute-ref --update also says which rows its version added and removed (the manifest's
    `update`); data that differs by exactly those rows is the previous version's data, and the check says so."""
    from runtime.data import encode_rows, load_rows, recorded_config

    source = load_rows(data, (manifest.get("source") or {}).get("split", "train"), recorded_config(data, manifest))
    encoded = encode_rows(source, tokenizer, EncodingConfig.from_dict(manifest["encoding"]), on_bad_row="skip")
    index = scan.index.select("id", "shard", "row", "mask_checksum")
    diff = history.row_changes(index["id"].to_list(), index["mask_checksum"].to_list(), encoded.ids,
                               [p.mask_checksum for p in encoded.pairs])
    skipped_now = {s["id"]: s["reason"] for s in encoded.skipped}
    update = history.update_record(manifest)
    info = {"rows_encoded": len(encoded.ids), "rows_skipped": len(encoded.skipped),
            "fingerprint_matches": source.fingerprint == (manifest.get("source") or {}).get("fingerprint"),
            **diff, "removed_now_skipped": {i: skipped_now[i] for i in diff["removed"] if i in skipped_now},
            "version": history.version_of(manifest)}
    since = ""
    if update is not None:
        info["update"] = {k: update.get(k) for k in ("from_version", "added", "removed", "replaced")}
        since = (f"; version {info['version']} of the cache: {len(update.get('added') or [])} rows added, "
                 f"{len(update.get('removed') or [])} removed and {len(update.get('replaced') or [])} replaced since "
                 f"version {update.get('from_version')}, as its manifest lists")
    if not (diff["added"] or diff["removed"] or diff["changed"]):
        return Check("data_rows", PASS, f"{len(encoded.ids):,} rows re-encoded with the cache's encoding: all match "
                     f"({len(encoded.skipped)} skipped as at precompute){since}", info=info)
    listing = "; ".join(f"{kind} {len(ids)}: {', '.join(map(repr, ids[:5]))}{' …' if len(ids) > 5 else ''}"
                        for kind, ids in (("changed", info["changed"]), ("removed", info["removed"]),
                                          ("added", info["added"])) if ids)
    if update is not None and _undoes(diff, update):
        listing += (f" (exactly what the update to version {info['version']} changed: this is the data of version "
                    f"{update.get('from_version')}, kept as {history.version_name(update.get('from_version') or 1)})")
    elif root is not None and (diff["changed"] or diff["added"]):  # the remedy that brings the cache to this data
        recorded = manifest.get("model") or {}  # the reference by a name the command can load: hub id, else path
        model = recorded.get("hub_id") or recorded.get("path") or recorded.get("name")
        split = (manifest.get("source") or {}).get("split")
        listing += "; " + (remedies.rows_changed(root, data, model, split) if diff["changed"]
                           else remedies.rows_missing(root, data, model, split))
    first = next(iter(diff["changed"] or diff["removed"]), None)
    where = index.filter(pl.col("id") == first).row(0, named=True) if first is not None else {}
    return Check("data_rows", FAIL, f"the data differs from the cached rows: {listing}", where.get("shard"),
                 where.get("row"), info)


def _undoes(diff: dict, update: dict) -> bool:
    """The data differs from the cache by the rows its update added, removed and replaced, the other way round."""
    return (set(diff["removed"]) == set(update.get("added") or [])
            and set(diff["added"]) == set(update.get("removed") or [])
            and set(diff["changed"]) == set(update.get("replaced") or []))


def run_version(root: Path, manifest: dict, run_dir: str) -> tuple[dict, dict | None]:
    """The version of the cache a run was trained on (schemas/history.py): its manifest and {"version", "file",
    "current"}; the current manifest and None when the run names none of them (audit_run says why)."""
    try:
        run = run_manifest.read_run_manifest(run_dir)
    except run_manifest.RunManifestError:
        return manifest, None  # audit_run refuses it
    ref = run.get("reference") or {}
    found = history.version_for(root, manifest, [r for r in (ref.get("cache"), ref.get("eval_cache"))
                                                 if isinstance(r, dict)])
    if found is None:
        return manifest, None
    version, name, used = found
    return used, {"version": version, "file": name, "current": history.version_of(manifest)}


def audit_run(root: Path, manifest: dict, run_dir: str, version: dict | None = None) -> list[Check]:
    """`version`: the version of the cache audited (schemas/history.py version_report; None: the current one). A
    run trained on a version whose manifest is gone is named as such, with the file."""
    try:
        run = run_manifest.read_run_manifest(run_dir)
    except run_manifest.RunManifestError as e:
        raise click.BadParameter(str(e), param_hint="--run")
    name = version["file"] if version else run_manifest.CACHE_MANIFEST
    role, problems = run_manifest.run_cache_findings(run, root, manifest["stamps"], name)
    if problems:
        ref = run.get("reference") or {}
        lost = history.lost_version(root, history.current_manifest(root) or manifest,
                                    [ref.get("cache"), ref.get("eval_cache")])
        checks = [Check("run_cache", FAIL, f"{run_dir}: {lost or problems[0].message}{_live_split(run)}")]
    else:
        which = ""
        if version and version["file"] != run_manifest.CACHE_MANIFEST:
            which = (f"; version {version['version']} of the cache ({version['file']}), the cache now being at "
                     f"version {version['current']}: audited against that version")
        elif version and version["current"] > 1:
            which = f"; version {version['version']} of the cache, its current one"
        checks = [Check("run_cache", PASS, f"{run_dir}: trained on this cache as its "
                        f"{'train' if role == 'cache' else 'eval'} cache (its content, cache_id, and stamps "
                        f"match){which}", info={"version": version} if version else {})]
    checks += audit_kl_control(run_dir, run)
    return checks + [final_hash_check(run_dir, run, manifest)]


def final_hash_check(run_dir: str, run: dict, manifest: dict) -> Check:
    """run_final_hash: the weights in `run_dir` are the ones the run recorded as its final model (a LoRA run: its
    adapter, _audit_peft). The audit's check, and what a view with --run must pass before it shows the policy's
    numbers as the run's."""
    if run.get("peft"):  # the checkpoint is an adapter (train-dpo --use-peft)
        return _audit_peft(run_dir, run["peft"], manifest)
    recorded = run.get("final_model_hash")
    try:
        final = model_hash(run_dir)
    except (WeightsError, OSError, ValueError) as e:
        return Check("run_final_hash", FAIL, f"the checkpoint in {run_dir} cannot be hashed: {e}")
    if final == recorded:
        return Check("run_final_hash", PASS, f"the checkpoint in {run_dir} matches final_model_hash {_short(final)}")
    return Check("run_final_hash", FAIL, f"the checkpoint in {run_dir} hashes to {_short(final)}, the run recorded "
                 f"{_short(recorded)}")


def _live_split(run: dict) -> str:
    """How a live reference was split (train-dpo --ref-device-map), as the run manifest recorded it, or ""."""
    live = (run.get("reference") or {}).get("live_model")
    layout = live.get("layout") if isinstance(live, dict) else None
    return f" ({live.get('path')}, split by {describe(layout)})" if isinstance(layout, dict) else ""


def _audit_peft(run_dir: str, peft: dict, manifest: dict) -> Check:
    """run_final_hash of a LoRA run: its reference is the base (or base + init adapter) the cache was made from, and
    the adapter (and merged model, if written) in run_dir are the ones it recorded."""
    problems = []
    init = peft.get("init_adapter") or {}
    base, reference = peft.get("base_model_hash"), peft.get("reference_model_hash")
    expected = merged_model_hash(base, init.get("adapter_hash")) if init else base
    if reference != expected:
        problems.append(f"its reference hash {_short(reference)} is not "
                        f"{'base + init adapter' if init else 'the base'} ({_short(expected)})")
    if stamp_findings(manifest["stamps"], {"model_hash": reference}):
        problems.append(f"its reference {_short(reference)} is not the cache's model "
                        f"{_short(manifest['stamps']['model_hash'])}")
    try:
        final = adapter_hash(run_dir)
        if final != peft.get("final_adapter_hash"):
            problems.append(f"the adapter in {run_dir} hashes to {_short(final)}, the run recorded "
                            f"{_short(peft.get('final_adapter_hash'))}")
        if adapter_config_fingerprint(run_dir) != adapter_fields(peft.get("adapter_config") or {}):
            problems.append(f"{run_dir}/adapter_config.json differs from the recorded adapter_config")
        merged = peft.get("merged_model_hash")
        if merged and model_hash(Path(run_dir) / "merged") != merged:
            problems.append(f"{run_dir}/merged does not hash to the recorded merged_model_hash {_short(merged)}")
    except (WeightsError, OSError, ValueError) as e:
        problems.append(f"cannot be hashed: {e}")
    detail = "; ".join(problems) or (
        f"LoRA run: the adapter in {run_dir} matches final_adapter_hash {_short(peft.get('final_adapter_hash'))}"
        + (" and merged/ its merged_model_hash" if peft.get("merged_model_hash") else "")
        + f"; reference = {'base + init adapter' if init else 'base'} = the cache's model {_short(expected)}")
    return Check("run_final_hash", FAIL if problems else PASS, detail)


def audit_kl_control(run_dir: str, run: dict) -> list[Check]:
    """run_kl_control, for a run whose β was governed (train-dpo --beta-schedule, --kl-target, --kl-alarm; its
    manifest's `kl_control`): the β trajectory recomputed from the KLs logged in its metrics.jsonl and the recorded
    settings (runtime.kl_control.replay) must be the logged one exactly; the alarms and rollbacks are reported."""
    import json

    from runtime.kl_control import Settings, replay

    if run.get("kl_control") is None:
        return [Check("run_kl_control", SKIP, "β was fixed for the run (no --beta-schedule, --kl-target or "
                      "--kl-alarm): no trajectory to recompute")]
    section, manifest = run["kl_control"], Path(run_dir) / "run-manifest.json"
    path = Path(run_dir) / "metrics.jsonl"
    try:
        if not isinstance(section, dict):
            raise ValueError(f"not an object ({type(section).__name__})")
        settings = Settings.from_json(section.get("settings"))
    except ValueError as e:
        return [Check("run_kl_control", FAIL, f"{manifest}: the recorded kl_control settings are damaged ({e}), so "
                      "the governed β cannot be recomputed")]
    records = []
    try:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not a JSON object")
                records.append(record)
    except OSError as e:
        return [Check("run_kl_control", FAIL, f"{path}: unreadable ({e}), so the governed β cannot be recomputed")]
    except ValueError as e:
        return [Check("run_kl_control", FAIL, f"{path} line {number}: not a metrics record ({e}), so the governed "
                      "β cannot be recomputed")]
    try:
        problems = replay(settings, records)
        alarms = [r for r in records if r.get("event") == "kl_alarm"]
        rollbacks = [r for r in records if r.get("event") == "kl_rollback"]
        said = ", ".join(f"step {a['step']}: {a['action']}" for a in alarms)
    except Exception as e:  # any record the rule cannot read: a damaged run, reported, not a crash
        return [Check("run_kl_control", FAIL, f"{path}: a record lacks or garbles what the rule reads "
                      f"({type(e).__name__}: {e}), so the governed β cannot be recomputed")]
    told = (f"; {len(alarms)} KL alarm(s) ({said}), {len(rollbacks)} rollback(s)" if alarms or rollbacks
            else "; no KL alarm")
    rule = (f"{settings.controller} controller" if settings.controller else f"{settings.schedule} schedule")
    info = {"alarms": alarms, "rollbacks": rollbacks, "final": section.get("final")}
    if problems:
        return [Check("run_kl_control", FAIL, f"{path}: the logged {settings.controlled} does not follow its rule "
                      f"({rule}): {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                      + told, info=info)]
    return [Check("run_kl_control", PASS, f"{path}: {settings.controlled} follows its rule ({rule}) at every logged "
                  f"step, final {section.get('final')!r}{told}", info=info)]
