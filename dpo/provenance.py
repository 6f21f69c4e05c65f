"""What a train-dpo run was trained against, recorded in every checkpoint and in the run manifest (format:
schemas/run_manifest.py); a resume against another reference or other data is refused."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from runtime.checkpoint import software_versions
from runtime.errors import JobError
from runtime.hub import origin
from schemas import run_manifest as rm


def reference_record(cfg, train, evaluation, live_hash: str | None = None) -> dict:
    """This run's record, from the verification reports (cache stamps) and the data fingerprints; `live_hash`: the
    model hash of the live --ref-model folder (no cache: `train` and `evaluation` are EncodedOnly, with no stamps)."""
    eval_cache = cfg.eval_ref_cache or cfg.ref_cache
    live = {"path": str(cfg.ref_model), "model_hash": live_hash} if not cfg.ref_cache else None
    return rm.reference_record(
        train_cache=rm.cache_record(cfg.ref_cache, train.report["stamps"]) if cfg.ref_cache else None,
        eval_cache=rm.cache_record(eval_cache, evaluation.report["stamps"]) if evaluation and eval_cache else None,
        live_model=live, data_fingerprint=train.fingerprint,
        eval_data_fingerprint=evaluation.fingerprint if evaluation else None)


def check_resume_reference(checkpoint: str, record: dict) -> None:
    try:
        recorded = rm.read_checkpoint_record(checkpoint)
    except rm.RunManifestError as e:
        raise JobError(f"--resume-from-checkpoint {checkpoint}: {e}") from None
    found = rm.reference_findings(recorded, record)
    if found:
        f = found[0]
        raise JobError(f"--resume-from-checkpoint {checkpoint}: {f.message}\n{f.sides_text()}\n"
                       f"  remedy:       {f.remedy}")


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
        config=dataclasses.asdict(cfg),
        software=software_versions(),
        result={k: summary[k] for k in ("steps", "world_size", "train_loss", "train_s", "verify_s", "batch_layout",
                                        "phases") if k in summary} | {"eval": summary["eval"]},
        final_model_hash=final_model_hash,
        finished_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **sections,
    )
    rm.write_json(out / rm.RUN_MANIFEST, manifest)
    return manifest


def _hub(given: dict) -> dict:
    """The hub fields of a runtime.hub.origin (none for a local path)."""
    return {k: v for k, v in given.items() if k != "path"}
