"""train-dpo recipe: verify the cache, build the rows, train with the Trainer, write the checkpoint, metrics, plot and
run manifest. With a cache the reference model is never constructed in this process."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.checkpoint import check_checkpoint, load_tokenizer
from runtime.errors import JobError
from schemas.encoding import EncodingConfig
from schemas.stamps import model_hash

from . import lora
from .losses import LossConfig
from .outdir import check_output_dir, prepare_metrics
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
    overwrite_output_dir: bool = False
    lora: lora.LoraOptions = field(default_factory=lora.LoraOptions)  # --use-peft and the LoRA options (dpo/lora.py)

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

    from .provenance import check_resume_reference, record_in, reference_record
    from .trainer import DPOTrainer, MetricsFile, PairCollator, disable_dropout

    if cfg.ref_cache is None and cfg.ref_model is None:
        raise JobError("give --ref-cache DIR (cached reference) or --ref-model PATH (live reference)")
    if cfg.ref_model_hash and cfg.ref_cache is None:
        raise JobError("--ref-model-hash only declares which reference a --ref-cache must hold; add --ref-cache")
    check_checkpoint(cfg.model, cfg.trust_remote_code)
    lora.check_options(cfg.lora)
    for note in lora.notes(cfg.lora, cached=cfg.ref_cache is not None):
        log(note)
    loss_config = cfg.loss_config()
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(cfg, name) < 1:
            raise JobError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    try:
        args = cfg.training_arguments()
    except ValueError as e:  # transformers' own checks of the training options
        raise JobError(f"invalid training options: {' '.join(str(e).split())}") from None
    out = Path(cfg.output_dir)
    check_output_dir(cfg)
    check_resume(cfg.resume_from_checkpoint)
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    t0 = time.perf_counter()
    initial_hash = model_hash(cfg.model)
    reference = None  # the model hash the cache must carry (hashed once, for train and eval caches alike)
    if cfg.ref_cache is not None:
        reference = cfg.ref_model_hash or (reference_hash(cfg.model, cfg.ref_model, None) if cfg.ref_model
                                           else lora.reference_hash(cfg.lora, initial_hash))
    elif cfg.lora.use_peft:
        lora.check_live_reference(cfg.model, cfg.ref_model, initial_hash)
    with lora.explained_reference(cfg.lora, cfg.model, initial_hash):
        train = _rows(cfg, tokenizer, cfg.data, cfg.split, cfg.ref_cache, reference, log)
        evaluation = None
        if cfg.eval_data:
            evaluation = _rows(cfg, tokenizer, cfg.eval_data, cfg.eval_split, cfg.eval_ref_cache or cfg.ref_cache,
                               reference, log)
    record = reference_record(cfg, train, evaluation)
    if cfg.resume_from_checkpoint:
        check_resume_reference(cfg.resume_from_checkpoint, record)  # before any model is loaded
    verify_s = time.perf_counter() - t0

    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32 if cfg.fp16 else dtype,
                                                  use_safetensors=True, trust_remote_code=cfg.trust_remote_code,
                                                  **lora.load_kwargs(cfg.lora, dtype))
    disable_dropout(policy)
    ref_model = None
    if cfg.lora.use_peft:
        policy = lora.wrap_policy(policy, cfg.lora, cfg.gradient_checkpointing, cfg.seed)
        ref_model = lora.AdapterDisabled(policy) if cfg.ref_cache is None else None
    elif cfg.ref_cache is None:
        check_checkpoint(cfg.ref_model, cfg.trust_remote_code)
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.ref_model, dtype=dtype, use_safetensors=True,
                                                         trust_remote_code=cfg.trust_remote_code)
        ref_model.eval().requires_grad_(False).to(args.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    seen = prepare_metrics(out / "metrics.jsonl", cfg.resume_from_checkpoint) if _rank()[0] == 0 else set()
    trainer = DPOTrainer(
        model=policy,
        args=args,
        data_collator=PairCollator(pad_id),
        train_dataset=datasets.Dataset(train.table),
        eval_dataset=datasets.Dataset(evaluation.table) if evaluation else None,
        processing_class=tokenizer,
        callbacks=[MetricsFile(out / "metrics.jsonl", seen)],
        loss_config=loss_config,
        ref_model=ref_model,
        save_with=lambda folder: record_in(folder, record),
    )
    t_train = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    train_s = time.perf_counter() - t_train
    final_eval = {}
    if evaluation:  # reuse the eval of the last step when there was one
        last = [r for r in trainer.state.log_history if "eval_loss" in r]
        final_eval = last[-1] if last and last[-1].get("step") == result.global_step else trainer.evaluate()
    trainer.save_model(str(out))
    if cfg.lora.use_peft and trainer.is_world_process_zero():
        lora.save_outputs(trainer.model, out, cfg.lora, tokenizer)
    first = [r for r in trainer.state.log_history if "eval_loss" in r and r.get("step") == 0]
    summary = {"eval_start": first[0] if first else {}, "output_dir": str(out.resolve()), "steps": result.global_step,
               "train_loss": result.training_loss, "train_s": train_s, "verify_s": verify_s, "eval": final_eval}
    if trainer.is_world_process_zero():
        _finish(cfg, out, train, record, initial_hash, summary, reference)
    return summary


def check_resume(checkpoint: str | None) -> None:
    """A checkpoint to resume from must be complete: the Trainer writes trainer_state.json last, and a folder without
    it (a save that was interrupted) fails deep inside the Trainer, after verification (some transformers versions
    instead restart at step 0 from the half-saved weights)."""
    if checkpoint and not (Path(checkpoint) / "trainer_state.json").is_file():
        reason = ("no such directory" if not Path(checkpoint).is_dir() else
                  "no trainer_state.json in it (not a Trainer checkpoint, or one interrupted while being saved)")
        raise JobError(f"--resume-from-checkpoint {checkpoint}: {reason}; resume from a complete checkpoint-N folder")


def _finish(cfg, out: Path, train, record: dict, initial_hash: str, summary: dict, reference: str | None) -> None:
    from .provenance import write_run_manifest
    from .trainer import plot_metrics

    if cfg.plot and (out / "metrics.jsonl").exists():
        plot_metrics(out / "metrics.jsonl", out / "metrics.png")
    if cfg.lora.use_peft:  # the checkpoint is an adapter: its own hash, and the merged model's if written
        peft = lora.manifest_section(cfg.lora, out, initial_hash, reference or lora.reference_hash(cfg.lora, initial_hash))
        sections = {"final_model_hash": peft["merged_model_hash"], "peft": peft}
    else:
        sections = {"final_model_hash": model_hash(out)}
    manifest = write_run_manifest(cfg, out, record, train, initial_hash, summary, **sections)
    summary["final_model_hash"] = manifest["final_model_hash"]
