"""What train-dpo's closing summary (dpo/cli.summary_text) and run manifest state beyond the Trainer's own result:
the whole run's train loss across resumes, the checkpoint --load-best-model-at-end kept, the merged model's folder,
and a note where the cache's precision differs from the policy's."""

from __future__ import annotations

from pathlib import Path

from schemas.rules import stamp_findings

from .losses import LossConfig, pair_loss
from .metrics import metrics_records


def whole_run_train_loss(records: list[dict], resumed_from: int, session_loss: float, global_step: int) -> float:
    """The mean train loss per step over the whole run, when this process resumed it at step `resumed_from`: the
    Trainer's `session_loss` is the mean over steps resumed_from+1..global_step only. The steps before come from
    metrics.jsonl: each train record's loss is the mean over the steps since the previous one (the Trainer's
    logging), so it counts for that many steps; steps after the last record up to the checkpoint were never logged
    and are left out (none when the checkpoint step is a logging step)."""
    logged = sorted((r["step"], r["loss"]) for r in records if "loss" in r and 0 < r["step"] <= resumed_from)
    steps = [0] + [s for s, _ in logged]
    earlier = sum(loss * (s - before) for (s, loss), before in zip(logged, steps))
    resumed_steps = global_step - resumed_from
    counted = steps[-1] + resumed_steps
    return (earlier + session_loss * resumed_steps) / counted if counted else session_loss


def best_checkpoint(trainer) -> dict | None:
    """With --load-best-model-at-end: the checkpoint whose weights the Trainer loaded at the end (path None when no
    evaluation chose one), and by which eval metric."""
    args, state = trainer.args, trainer.state
    if not args.load_best_model_at_end:
        return None
    metric = args.metric_for_best_model or "loss"
    return {"path": state.best_model_checkpoint, "metric": metric if metric.startswith("eval_") else f"eval_{metric}",
            "value": state.best_metric}


def loss_at_reference(loss: LossConfig) -> float | None:
    """The loss of a pair where the policy equals the reference (every log-ratio and KL 0): ln 2 for sigmoid DPO.
    None with an RPO term, whose NLL depends on the data."""
    if loss.rpo_alpha:
        return None
    import torch

    zero, one = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    return float(pair_loss(zero, zero, one, one, loss, zero, zero))


def precision_note(cache_dtype: str | None, policy_dtype: str, records: list[dict], starts_at_reference: bool,
                   expected: float | None) -> dict | None:
    """Where the cache's log-probs were computed in another dtype than the policy computes in: the two, and, when
    the policy starts at the reference, step 1's logged loss beside the loss at the reference (they differ by the
    rounding alone)."""
    if cache_dtype is None or cache_dtype == policy_dtype:
        return None
    note = {"cache_dtype": cache_dtype, "policy_dtype": policy_dtype}
    first = next((r for r in records if r.get("step") == 1 and "loss" in r), None)
    if starts_at_reference and first is not None:
        note |= {"step_1_loss": first["loss"], "loss_at_reference": expected,
                 "step_1_logratio": first.get("logratio/chosen")}
    return note


def policy_dtype(cfg) -> str:
    """The dtype the policy's log-probs are computed in: --bf16/--fp16's autocast, else --model-dtype."""
    return "bfloat16" if cfg.bf16 else "float16" if cfg.fp16 else cfg.model_dtype


def closing_facts(cfg, trainer, run, result, metrics_path: Path, merged_dir: Path | None) -> dict:
    """The summary's keys beyond the Trainer's result (rank 0, which writes metrics.jsonl)."""
    from .outdir import resumed_step

    records = metrics_records(metrics_path) if metrics_path.is_file() else []
    facts = {"best_checkpoint": best_checkpoint(trainer), "merged_dir": str(merged_dir) if merged_dir else None}
    if cfg.resume_from_checkpoint:
        facts["resumed_from"] = step = resumed_step(cfg.resume_from_checkpoint)
        facts["train_loss"] = whole_run_train_loss(records, step, result.training_loss, result.global_step)
    if cfg.ref_cache is not None:
        # standard DPO: the cache's model is the policy's starting point (the stamp rule compares the hashes)
        starts_at_reference = not stamp_findings({"model_hash": run.reference}, {"model_hash": run.policy.model_hash})
        facts["precision"] = precision_note(
            run.train.report.get("dtype"), policy_dtype(cfg), records,
            starts_at_reference=starts_at_reference, expected=loss_at_reference(cfg.loss_config()))
    return facts
