"""What a train-dpo run was trained against, recorded in every checkpoint and in the run manifest (format:
schemas/run_manifest.py); a resume against another reference or other data is refused."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from runtime.terminal import echo
from runtime.checkpoint import software_versions
from runtime.errors import JobError
from runtime import remedies
from runtime.hub import origin
from schemas import run_manifest as rm
from schemas.findings import labelled

from .resume import same_cache_elsewhere

LOSS = "loss"  # a checkpoint's record: the loss and the options it read (loss_config.trained_with)


def checkpoint_record(record: dict, loss) -> dict:
    """What each checkpoint records (and a resume is compared by): the reference record, and the loss with the
    options it reads."""
    from .loss_config import trained_with

    return {**record, LOSS: trained_with(loss)}


def reference_record(cfg, train, evaluation, live_hash: str | None = None) -> dict:
    """This run's record, from the verification reports (cache stamps) and the data fingerprints; `live_hash`: the
    model hash of the live --ref-model folder (no cache: `train` and `evaluation` are EncodedOnly, with no stamps)."""
    eval_cache = cfg.eval_ref_cache or cfg.ref_cache
    live = {"path": str(cfg.ref_model), "model_hash": live_hash} if not cfg.ref_cache else None
    def cache(path, report: dict) -> dict:  # the version of the cache verified (train-dpo --cache-version N)
        return rm.cache_record(path, report["stamps"], (report.get("version") or {}).get("file", rm.CACHE_MANIFEST))

    return rm.reference_record(
        train_cache=cache(cfg.ref_cache, train.report) if cfg.ref_cache else None,
        eval_cache=cache(eval_cache, evaluation.report) if evaluation and eval_cache else None,
        live_model=live, data_fingerprint=train.fingerprint,
        eval_data_fingerprint=evaluation.fingerprint if evaluation else None)


def check_resume_reference(checkpoint: str, record: dict, train=None, evaluation=None, log=echo) -> None:
    """This run's record against the checkpoint's. A cache updated since the checkpoint (another version of it,
    precompute-ref --update) is no difference when no update between the two versions added, removed or replaced a
    row of this run (`train`, `evaluation`: the verified rows): every value it trains on is the one it trained on.
    Otherwise refused naming the two versions and --cache-version."""
    try:
        recorded = rm.read_checkpoint_record(checkpoint)
    except rm.RunManifestError as e:
        raise JobError(f"--resume-from-checkpoint {checkpoint}: {e}") from None
    for role, rows in (("cache", train), ("eval_cache", evaluation)):
        if rm.same_cache(recorded.get(role), record.get(role)):
            elsewhere = same_cache_elsewhere(role, recorded.get(role), record.get(role))
            if elsewhere:  # a copy (or a move) of the cache it trained with: the same by content, said in one line
                log(elsewhere)
            continue
        moved = _moved_on(recorded.get(role), record.get(role), rows)
        if moved is None:
            continue
        old, new, changed = moved
        fingerprint = "data_fingerprint" if role == "cache" else "eval_data_fingerprint"
        other = recorded.get(fingerprint) is not None and recorded.get(fingerprint) != record.get(fingerprint)
        where = (f"the cache {record[role]['path']} was updated from version {old} to {new} since this checkpoint"
                 if new > old else f"this run uses version {new} of the cache {record[role]['path']}, the checkpoint "
                 f"was trained on version {old}")
        if changed:
            raise JobError(f"--resume-from-checkpoint {checkpoint}: {where}, and the update"
                           f"{'s' if abs(new - old) > 1 else ''} between them added, removed or replaced "
                           f"{len(changed)} of this run's rows ({', '.join(map(repr, changed[:5]))}"
                           f"{' …' if len(changed) > 5 else ''})\n  remedy: {remedies.resume_moved(old, new, other)}")
        log(f"{where}; none of this run's {rows.table.num_rows} rows changed: resuming on version {new}")
        recorded = {**recorded, role: record[role]}
    found = rm.reference_findings(recorded, record)
    theirs, ours = recorded.get(LOSS), record.get(LOSS)
    if isinstance(theirs, dict) and isinstance(ours, dict) and theirs != ours:  # (older checkpoints record none)
        differ = sorted((k for k in {**theirs, **ours} if theirs.get(k) != ours.get(k)), key=lambda k: k != "--loss-type")
        sides = "\n".join(labelled(("the checkpoint", "this run"), *(
            " ".join(f"{k} {d[k]}" if k in d else f"({k} not read by this loss)" for k in differ) for d in (theirs, ours))))
        raise JobError(f"--resume-from-checkpoint {checkpoint}: the checkpoint was trained with other loss options "
                       f"({', '.join(differ)}); one run is one objective, which its card and run-manifest.json "
                       f"record\n{sides}\n  remedy: resume with {' '.join(f'{k} {theirs[k]}' for k in differ if k in theirs)} "
                       "(the checkpoint's), or train with these options as a new run into a fresh --output-dir")
    if found:
        f = found[0]
        raise JobError(f"--resume-from-checkpoint {checkpoint}: {f.message}\n{f.sides_text()}\n"
                       f"  remedy:       {f.remedy}")


def _moved_on(recorded, now, rows) -> tuple[int, int, list[str]] | None:
    """(the checkpoint's version, this run's, this run's rows an update between them added, removed or replaced)
    when the two cache records name two versions of one cache (schemas/history.py); None when they do not."""
    if not isinstance(recorded, dict) or not isinstance(now, dict) or rows is None:
        return None
    from schemas import history
    from storage.places import location

    root = location(now.get("path"))
    try:
        current = history.current_manifest(root)
    except OSError:
        return None
    if current is None:
        return None
    old = history.version_number(root, current, recorded)
    new = history.version_number(root, current, now)
    if old is None or new is None or old == new:
        return None
    touched = history.changed_between(root, current, old, new)
    ids = rows.table.column("id").to_pylist()
    changed = ids if touched is None else [i for i in ids if i in touched]
    return old, new, changed


def record_in(folder: Path, record: dict) -> None:
    """Write the reference record into a folder the weights were saved to (each checkpoint-N)."""
    rm.write_json(Path(folder) / rm.CHECKPOINT_RECORD, record)


def write_run_manifest(cfg, out: Path, record: dict, train, initial_hash: str, summary: dict, *,
                       final_model_hash: str | None, live_layout: dict | None = None, **sections) -> dict:
    """`final_model_hash`: of the saved model (None: a LoRA run that wrote no merged model); `live_layout`: where a
    live reference split by --ref-device-map went (runtime.placement.layout); `sections`: further sections (e.g.
    `peft`). A model or data set given as a hub id is recorded as its snapshot's path with `hub_id` and `revision`
    beside it (cfg.origins; the data's resolved here)."""
    reference = record | {"verification": train.report}
    if record["live_model"]:  # hub fields and layout: not in the checkpoints' record, which a resume compares
        reference["live_model"] = (record["live_model"] | _hub(cfg.origins.get("ref_model", {}))
                                   | ({"layout": live_layout} if live_layout else {}))
    manifest = rm.build_run_manifest(
        reference=reference,
        initial_model={"path": rm.absolute(cfg.model), "model_hash": initial_hash} | _hub(cfg.origins.get("model", {})),
        data=origin(cfg.data, "dataset") | {"split": cfg.split, "fingerprint": train.fingerprint,
                                            "rows": train.table.num_rows},
        eval_data=origin(cfg.eval_data, "dataset") | {"split": cfg.eval_split,
                                                      "fingerprint": record["eval_data_fingerprint"]}
        if cfg.eval_data else None,
        config=recorded_config(cfg),
        software=software_versions(),
        result={k: summary[k] for k in ("steps", "world_size", "train_loss", "train_s", "verify_s", "batch_layout",
                                        "phases") if k in summary} | {"eval": summary["eval"]},
        final_model_hash=final_model_hash,
        finished_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **sections,
    )
    rm.write_json(out / rm.RUN_MANIFEST, manifest)
    return manifest


def recorded_config(cfg) -> dict:
    """The run's options as the manifest records them: a loss option the run's loss does not read
    (dpo/loss_config.py's registry) is null, never a value that looks used."""
    from .loss_config import unread_options

    config = dataclasses.asdict(cfg)
    # the places as meaningful once the manifest is shared: absolute, where they are local paths that exist (a hub
    # id, a URL or a word such as resume_from_checkpoint's `true` stays as given)
    places = {f.name: rm.absolute_if_local(config[f.name]) for f in dataclasses.fields(cfg) if "location" in f.metadata}
    return config | places | {name: None for name in unread_options(cfg.loss_type, config)}


def _hub(given: dict) -> dict:
    """The hub fields of a runtime.hub.origin (none for a local path)."""
    return {k: v for k, v in given.items() if k != "path"}
