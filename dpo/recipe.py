"""train-dpo recipe: verify the cache, build the rows, train with the Trainer, write the checkpoint, metrics, plot and
run manifest. With a cache the reference model is never constructed in this process."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.checkpoint import check_checkpoint, load_tokenizer, software_versions
from runtime.errors import JobError
from schemas.encoding import EncodingConfig
from schemas.stamps import file_sha256, model_hash

from .losses import LossConfig
from .verify import encode_only, reference_hash, verify_and_join


@dataclass
class TrainConfig:
    model: str
    data: str
    output_dir: str
    ref_cache: str | None = None
    ref_model: str | None = None
    ref_model_hash: str | None = None
    split: str = "train"
    eval_data: str | None = None
    eval_split: str = "eval"
    eval_ref_cache: str | None = None
    # encoding: taken from the cache; a value given here must agree with it
    max_length: int | None = None
    truncation_mode: str | None = None
    chat_template: str | None = None
    on_bad_row: str = "error"
    fast_verify: bool = False
    # loss
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    ld_alpha: float = 1.0
    # transformers.TrainingArguments (same names)
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    num_train_epochs: float = 1.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    optim: str = "adamw_torch"
    seed: int = 42
    bf16: bool = False
    fp16: bool = False
    gradient_checkpointing: bool = False
    logging_steps: float = 10
    eval_strategy: str = "steps"
    eval_steps: float | None = None
    eval_on_start: bool = True
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    report_to: str = "none"
    resume_from_checkpoint: str | None = None
    dataloader_num_workers: int = 0
    use_cpu: bool = False
    fsdp: str = ""  # e.g. "full_shard auto_wrap"
    fsdp_config: str | None = None  # JSON file, as for transformers.TrainingArguments
    deepspeed: str | None = None  # DeepSpeed JSON config file
    # ours
    trust_remote_code: bool = False
    plot: bool = True
    batch_layout: str = "auto"  # auto | padded | prefix_shared (dpo/layout.py)

    def loss_config(self) -> LossConfig:
        return LossConfig(self.beta, self.loss_type, self.label_smoothing, self.rpo_alpha, self.ld_alpha)

    def encoding_request(self) -> dict:
        return {"max_length": self.max_length, "truncation_mode": self.truncation_mode,
                "chat_template": self.chat_template}

    def training_arguments(self):
        import transformers

        fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
        names = ["learning_rate", "lr_scheduler_type", "warmup_steps", "num_train_epochs", "max_steps",
                 "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "max_grad_norm", "weight_decay", "optim", "seed", "bf16", "fp16", "logging_steps", "save_strategy",
                 "save_steps", "save_total_limit", "dataloader_num_workers", "use_cpu", "output_dir", "fsdp",
                 "fsdp_config", "deepspeed"]
        kwargs = {n: getattr(self, n) for n in names}
        checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
        has_eval = self.eval_data is not None
        kwargs.update({
            checkpointing: self.gradient_checkpointing,
            "eval_strategy": self.eval_strategy if has_eval else "no",
            "eval_steps": self.eval_steps,
            "eval_on_start": self.eval_on_start and has_eval,
            "report_to": [r for r in self.report_to.split(",") if r] or "none",
            "remove_unused_columns": False,
            "logging_first_step": True,
            "data_seed": self.seed,
            "dataloader_pin_memory": not self.use_cpu and _has_accelerator(),
        })
        return transformers.TrainingArguments(**kwargs)


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()


def _rank() -> tuple[int, int]:
    import torch.distributed as td

    return (td.get_rank(), td.get_world_size()) if td.is_available() and td.is_initialized() else (0, 1)


def _on_every_rank(verify):
    """Under torchrun every rank verifies (it needs the joined rows anyway) and every rank refuses when any fails."""
    import torch.distributed as td

    rank, world = _rank()
    try:
        result, error = verify(), None
    except Exception as e:
        result, error = None, e
    if world > 1:
        errors = [None] * world
        td.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, m) for r, m in enumerate(errors) if m is not None]
        if failed and error is None:
            raise JobError(f"rank {failed[0][0]} refused the cache: {failed[0][1]}")
    if error is not None:
        raise error
    return result


def _rows(cfg: TrainConfig, tokenizer, data, split, cache, reference: str | None, log):
    if cache is not None:
        rank, _ = _rank()
        return _on_every_rank(lambda: verify_and_join(
            tokenizer=tokenizer, model_dir=cfg.model, data=data, split=split, cache_dir=cache,
            expected_model_hash=reference, encoding_request=cfg.encoding_request(),
            on_bad_row=cfg.on_bad_row, verify_files=not cfg.fast_verify and rank == 0,  # files hashed once
            log=log if rank == 0 else (lambda _m: None),
        ))
    request = {k: v for k, v in cfg.encoding_request().items() if v is not None}
    return encode_only(tokenizer=tokenizer, data=data, split=split, encoding=EncodingConfig(**request),
                       on_bad_row=cfg.on_bad_row)


def run_train(cfg: TrainConfig, log=print) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    from .layout import PrefixSharedCollator
    from .trainer import DPOTrainer, MetricsFile, PairCollator, disable_dropout, plot_metrics

    if cfg.ref_cache is None and cfg.ref_model is None:
        raise JobError("give --ref-cache DIR (cached reference) or --ref-model PATH (live reference)")
    if cfg.ref_model_hash and cfg.ref_cache is None:
        raise JobError("--ref-model-hash only declares which reference a --ref-cache must hold; add --ref-cache")
    check_checkpoint(cfg.model, cfg.trust_remote_code)
    loss_config = cfg.loss_config()
    if cfg.batch_layout not in ("auto", "padded", "prefix_shared"):
        raise JobError(f"--batch-layout must be auto, padded or prefix_shared, got {cfg.batch_layout!r}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(cfg, name) < 1:
            raise JobError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    try:
        args = cfg.training_arguments()
    except ValueError as e:  # transformers' own checks of the training options
        raise JobError(f"invalid training options: {' '.join(str(e).split())}") from None
    out = Path(cfg.output_dir)
    check_output_dir(out)
    check_resume(cfg.resume_from_checkpoint)
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    t0 = time.perf_counter()
    initial_hash = model_hash(cfg.model)
    reference = None  # the model hash the cache must carry (hashed once, for train and eval caches alike)
    if cfg.ref_cache is not None:
        reference = cfg.ref_model_hash or (reference_hash(cfg.model, cfg.ref_model, None) if cfg.ref_model
                                           else initial_hash)
    train = _rows(cfg, tokenizer, cfg.data, cfg.split, cfg.ref_cache, reference, log)
    evaluation = None
    if cfg.eval_data:
        evaluation = _rows(cfg, tokenizer, cfg.eval_data, cfg.eval_split, cfg.eval_ref_cache or cfg.ref_cache,
                           reference, log)
    verify_s = time.perf_counter() - t0

    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32 if cfg.fp16 else dtype,
                                                  use_safetensors=True, trust_remote_code=cfg.trust_remote_code)
    disable_dropout(policy)
    ref_model = None
    if cfg.ref_cache is None:
        check_checkpoint(cfg.ref_model, cfg.trust_remote_code)
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.ref_model, dtype=dtype, use_safetensors=True,
                                                         trust_remote_code=cfg.trust_remote_code)
        ref_model.eval().requires_grad_(False).to(args.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    layout = _choose_layout(cfg, args, policy, ref_model, train, pad_id, log)
    out.mkdir(parents=True, exist_ok=True)
    trainer = DPOTrainer(
        model=policy,
        args=args,
        data_collator=PrefixSharedCollator(pad_id) if layout == "prefix_shared" else PairCollator(pad_id),
        train_dataset=datasets.Dataset(train.table),
        eval_dataset=datasets.Dataset(evaluation.table) if evaluation else None,
        processing_class=tokenizer,
        callbacks=[MetricsFile(out / "metrics.jsonl")],
        loss_config=loss_config,
        ref_model=ref_model,
    )
    if trainer.is_world_process_zero() and not cfg.resume_from_checkpoint:
        (out / "metrics.jsonl").unlink(missing_ok=True)
    t_train = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    train_s = time.perf_counter() - t_train
    final_eval = {}
    if evaluation:  # reuse the eval of the last step when there was one
        last = [r for r in trainer.state.log_history if "eval_loss" in r]
        final_eval = last[-1] if last and last[-1].get("step") == result.global_step else trainer.evaluate()
    trainer.save_model(str(out))
    first = [r for r in trainer.state.log_history if "eval_loss" in r and r.get("step") == 0]
    summary = {"eval_start": first[0] if first else {}, "output_dir": str(out.resolve()), "steps": result.global_step,
               "batch_layout": layout,
               "train_loss": result.training_loss, "train_s": train_s, "verify_s": verify_s, "eval": final_eval}
    if trainer.is_world_process_zero():
        _finish(cfg, out, train, evaluation, initial_hash, summary)
    return summary


def _choose_layout(cfg: TrainConfig, args, policy, ref_model, train, pad_id: int, log) -> str:
    """The batch layout (dpo/layout.py), probed where training runs unless the model is sharded."""
    from .layout import choose_layout

    sharded = bool(cfg.fsdp or cfg.deepspeed)
    if not sharded and cfg.batch_layout != "padded":
        policy.to(args.device)
    rank, _ = _rank()
    return choose_layout(cfg.batch_layout, [m for m in (policy, ref_model) if m is not None], train.table,
                         cfg.per_device_train_batch_size, pad_id, log if rank == 0 else (lambda _m: None),
                         can_probe=not sharded)


def check_output_dir(out: Path) -> None:
    """Refuse an --output-dir that cannot be made, before any verification or training (nothing is created here)."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise JobError(f"--output-dir {out}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JobError(f"--output-dir {out}: {existing} is not writable")


def check_resume(checkpoint: str | None) -> None:
    """A checkpoint to resume from must be complete: the Trainer writes trainer_state.json last, and a folder without
    it (a save that was interrupted) fails deep inside the Trainer, after verification (some transformers versions
    instead restart at step 0 from the half-saved weights)."""
    if checkpoint and not (Path(checkpoint) / "trainer_state.json").is_file():
        reason = ("no such directory" if not Path(checkpoint).is_dir() else
                  "no trainer_state.json in it (not a Trainer checkpoint, or one interrupted while being saved)")
        raise JobError(f"--resume-from-checkpoint {checkpoint}: {reason}; resume from a complete checkpoint-N folder")


def _finish(cfg, out: Path, train, evaluation, initial_hash: str, summary: dict) -> None:
    from .trainer import plot_metrics

    if cfg.plot and (out / "metrics.jsonl").exists():
        plot_metrics(out / "metrics.jsonl", out / "metrics.png")
    cache = None
    if cfg.ref_cache:
        cache = {"path": str(cfg.ref_cache), "manifest_sha256": file_sha256(Path(cfg.ref_cache) / "manifest.json"),
                 "stamps": train.report["stamps"], "verification": train.report}
    manifest = {
        "kind": "refcache-train-dpo-run",
        "initial_model": {"path": cfg.model, "model_hash": initial_hash},
        "reference": {"cache": cache, "live_model": cfg.ref_model if not cfg.ref_cache else None},
        "data": {"path": cfg.data, "split": cfg.split, "fingerprint": train.fingerprint, "rows": train.table.num_rows},
        "eval_data": {"path": cfg.eval_data, "fingerprint": evaluation.fingerprint} if evaluation else None,
        "config": dataclasses.asdict(cfg),
        "seed": cfg.seed,
        "software": software_versions(),
        "result": {k: summary[k] for k in ("steps", "train_loss", "train_s", "verify_s", "batch_layout")}
                  | {"eval": summary["eval"]},
        "final_model_hash": model_hash(out),
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (out / "run-manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    summary["final_model_hash"] = manifest["final_model_hash"]
