"""train-dpo recipe: verify the cache, build the rows, train with the Trainer, write the checkpoint, metrics, plot and
run manifest. With a cache the reference model is never constructed in this process."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.checkpoint import check_checkpoint, load_tokenizer, pad_id
from runtime.cli import field_help
from runtime.errors import JobError
from runtime.hub import resolve_model
from schemas.encoding import CHAT_TEMPLATE_MODES, TRUNCATION_MODES, EncodingConfig
from schemas.stamps import model_hash

from . import lora
from .losses import LOSS_TYPES, LossConfig
from .outdir import check_output_dir, prepare_metrics
from .phases import PhaseTimer
from .verify import encode_only, reference_hash, verify_and_join


def _f(default, help, group, **extra):
    return field(default=default, metadata=field_help(help, group, **extra))


@dataclass
class TrainConfig:
    """Every field is a train-dpo option (dpo/cli.py generates them, help from the metadata) and a --config key.
    Fields named as transformers.TrainingArguments fields are passed to it (refcache's defaults, TRL's where they
    differ from the Trainer's); any other TrainingArguments option lands in `training_args`."""

    model: str = field(metadata=field_help(
        "Policy checkpoint to start from (in standard DPO also the reference the cache was computed with): a folder "
        "or a hub id in the local Hugging Face cache.", "Model", required=True))
    data: str = field(metadata=field_help(
        "Training preference data (file, folder, save_to_disk folder or hub data set id), encoded exactly as the "
        "cache was.", "Data", required=True))
    output_dir: str = field(metadata=field_help(
        "Where checkpoints, metrics.jsonl, metrics.png and run-manifest.json go.", "Output", required=True))
    ref_cache: str | None = _f(None, "Cache written by precompute-ref for --data; verified before use.",
                               "Reference cache")
    ref_model: str | None = _f(None, "Reference checkpoint: with --ref-cache it is only hashed (never loaded); "
                                     "without, live-reference mode.", "Reference cache")
    ref_model_hash: str | None = _f(None, "Model hash the cache must carry, when the reference differs from --model "
                                          "and is not at hand.", "Reference cache")
    split: str = _f("train", "Split of --data to train on (datasets' split names: train, test/eval, validation).",
                    "Data")
    eval_data: str | None = _f(None, "Evaluation preference data (needs its own cache: --eval-ref-cache).", "Data")
    eval_split: str = _f("test", "Split of --eval-data (eval.jsonl and test.jsonl are split test, as in datasets).",
                         "Data")
    eval_ref_cache: str | None = _f(None, "Cache of the eval rows: precompute-ref --data EVAL_DATA --split "
                                          "EVAL_SPLIT --out DIR.", "Reference cache")
    # encoding: taken from the cache; a value given here must agree with it
    max_length: int | None = _f(None, "Must agree with the cache's value.", "Data", show_default="the cache's")
    truncation_mode: str | None = _f(None, "Must agree with the cache's value.", "Data", choices=TRUNCATION_MODES,
                                     show_default="the cache's")
    chat_template: str | None = _f(None, "Must agree with the cache's value.", "Data", choices=CHAT_TEMPLATE_MODES,
                                   show_default="the cache's")
    on_bad_row: str = _f("error", "error, or skip rows the encoder rejects.", "Data", choices=("error", "skip"))
    fast_verify: bool = _f(False, "Skip the shard file sha256 check (stamps, rows and values are still verified).",
                           "Reference cache")
    # loss
    beta: float = _f(0.1, "DPO beta (strength of the pull towards the reference).", "Loss")
    loss_type: str = _f("sigmoid", "Preference loss (formulas in dpo/losses.py).", "Loss", choices=LOSS_TYPES)
    label_smoothing: float = _f(0.0, "Label noise e for sigmoid (cDPO) and robust losses.", "Loss")
    rpo_alpha: float = _f(0.0, "Weight of the SFT (NLL) term on chosen completions (RPO); 0 disables it.", "Loss")
    ld_alpha: float = _f(1.0, "LD-DPO: weight of tokens past the shorter completion's length; 1 disables it.", "Loss")
    # transformers.TrainingArguments (same names and meaning; defaults as in TRL's DPOConfig where it sets one)
    learning_rate: float = _f(1e-6, "Initial AdamW learning rate.", "Training")
    lr_scheduler_type: str = _f("linear", "Scheduler (transformers SchedulerType).", "Training")
    warmup_steps: float = _f(0, "Linear warmup steps (a float < 1 is a fraction of the total).", "Training")
    num_train_epochs: float = _f(1.0, "Epochs over --data.", "Training")
    max_steps: int = _f(-1, "Total optimizer steps; overrides --num-train-epochs when > 0.", "Training")
    per_device_train_batch_size: int = _f(8, "Pairs per device per step.", "Training")
    per_device_eval_batch_size: int = _f(8, "Pairs per device per eval step.", "Training")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.", "Training")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.", "Training")
    weight_decay: float = _f(0.0, "AdamW weight decay.", "Training")
    optim: str = _f("adamw_torch", "Optimizer (transformers OptimizerNames).", "Training")
    seed: int = _f(42, "Seed of the run (model init, sampler; data_seed defaults to it).", "Training")
    bf16: bool = _f(False, "bf16 mixed precision: fp32 master weights, bf16 autocast (the Trainer's meaning). On CPU "
                           "add --use-cpu.", "Training")
    fp16: bool = _f(False, "fp16 mixed precision with loss scaling (CUDA).", "Training")
    model_dtype: str = _f("float32", "dtype the policy is loaded in (its master weights). Pure bf16 training: "
                                     "bfloat16 without --bf16.", "Training",
                          choices=("float32", "bfloat16", "float16"))
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass to save memory.",
                                      "Training")
    logging_steps: float = _f(10, "Log train metrics every N steps.", "Training")
    eval_strategy: str = _f("steps", "When to evaluate (no, steps, epoch); used with --eval-data.", "Training")
    eval_steps: float | None = _f(None, "Evaluate every N steps.", "Training", show_default="--logging-steps")
    eval_on_start: bool = _f(True, "Evaluate before the first step (with --eval-data).", "Training")
    save_strategy: str = _f("steps", "When to save checkpoints (no, steps, epoch, best).", "Training")
    save_steps: float = _f(500, "Save a checkpoint every N steps.", "Training")
    save_total_limit: int | None = _f(None, "Keep at most N checkpoints.", "Training")
    report_to: str = _f("none", "Comma-separated trackers (tensorboard, wandb, ...) or none; checked before any "
                                "work. Name the run with --run-name.", "Training")
    resume_from_checkpoint: str | None = _f(None, "A checkpoint-N folder, or true for the latest in --output-dir.",
                                            "Training")
    dataloader_num_workers: int = _f(0, "Data loader worker processes.", "Training")
    use_cpu: bool = _f(False, "Train on CPU even if a GPU is present (needed for --bf16 on CPU).", "Training")
    fsdp: str = _f("", "FSDP mode, e.g. 'full_shard auto_wrap' (under torchrun).", "Training")
    fsdp_config: str | None = _f(None, "FSDP config JSON file.", "Training")
    deepspeed: str | None = _f(None, "DeepSpeed config JSON file (needs the deepspeed package).", "Training")
    # ours
    trust_remote_code: bool = _f(False, "Allow custom model code from checkpoint folders.", "Model")
    plot: bool = _f(True, "Write metrics.png at the end.", "Output")
    overwrite_output_dir: bool = _f(False, "Train into an --output-dir that already holds a run's files (they are "
                                           "overwritten as the Trainer saves).", "Output")
    batch_layout: str = _f("auto", "padded, prefix_shared (each prompt once per pair, pairs packed with a tree mask) "
                                   "or auto (prefix_shared when it is less work and matches the plain forward on a "
                                   "probe; dpo/layout.py).", "Training", choices=("auto", "padded", "prefix_shared"))
    # every other transformers.TrainingArguments option given (generated options; see dpo/cli.py)
    training_args: dict = field(default_factory=dict, metadata={"cli": False})
    lora: lora.LoraOptions = field(default_factory=lora.LoraOptions, metadata={"cli": False})  # dpo/lora.py options

    def loss_config(self) -> LossConfig:
        return LossConfig(self.beta, self.loss_type, self.label_smoothing, self.rpo_alpha, self.ld_alpha)

    def encoding_request(self) -> dict:
        return {"max_length": self.max_length, "truncation_mode": self.truncation_mode,
                "chat_template": self.chat_template}

    def training_arguments(self):
        import transformers

        fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
        ours = {f.name for f in dataclasses.fields(self)} - {"resume_from_checkpoint", "report_to",
                                                              "gradient_checkpointing", "eval_strategy", "eval_on_start"}
        kwargs = {n: getattr(self, n) for n in sorted(ours & fields)}
        checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
        has_eval = self.eval_data is not None
        kwargs.update({
            checkpointing: self.gradient_checkpointing,
            "eval_strategy": self.eval_strategy if has_eval else "no",
            "eval_on_start": self.eval_on_start and has_eval,
            "report_to": self.trackers() or "none",
            "logging_first_step": True,
            "data_seed": self.seed,
            "dataloader_pin_memory": not self.use_cpu and _has_accelerator(),
            "disable_tqdm": False,  # the Trainer's bar with ETA, although the libraries' logging is quietened
        })
        kwargs.update(self.training_args)  # any other TrainingArguments option, as given
        kwargs["remove_unused_columns"] = False  # the collator needs the cached reference columns
        return transformers.TrainingArguments(**kwargs)

    def trackers(self) -> list[str]:
        return [r.strip() for r in self.report_to.replace(" ", ",").split(",") if r.strip() and r.strip() != "none"]


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
    timer = PhaseTimer()  # the run's fixed cost per phase, in the summary and the run manifest
    import datasets
    import torch
    from transformers import AutoModelForCausalLM

    from .layout import PrefixSharedCollator
    from .provenance import check_resume_reference, record_in, reference_record
    from .trainer import DPOTrainer, MetricsFile, PairCollator, disable_dropout

    timer.mark("imports")
    if cfg.ref_cache is None and cfg.ref_model is None:
        raise JobError("give --ref-cache DIR (cached reference) or --ref-model PATH (live reference)")
    if cfg.ref_model_hash and cfg.ref_cache is None:
        raise JobError("--ref-model-hash only declares which reference a --ref-cache must hold; add --ref-cache")
    same_rows = (cfg.eval_data, cfg.eval_split) == (cfg.data, cfg.split)  # then the training cache holds them
    if cfg.eval_data and cfg.ref_cache is not None and cfg.eval_ref_cache is None and not same_rows:
        raise JobError(
            f"--eval-data {cfg.eval_data} needs the reference log-probs of its rows: run `precompute-ref --model "
            f"{cfg.ref_model or cfg.model} --data {cfg.eval_data} --split {cfg.eval_split} --out EVAL_CACHE` "
            "(same encoding options as the training cache) and pass --eval-ref-cache EVAL_CACHE")
    check_trackers(cfg.trackers())
    cfg.model, cfg.ref_model = resolve_model(cfg.model), resolve_model(cfg.ref_model)
    check_checkpoint(cfg.model, cfg.trust_remote_code)
    lora.check_options(cfg.lora)
    for note in lora.notes(cfg.lora, cached=cfg.ref_cache is not None):
        log(note)
    loss_config = cfg.loss_config()
    if cfg.batch_layout not in ("auto", "padded", "prefix_shared"):
        raise JobError(f"--batch-layout must be auto, padded or prefix_shared, got {cfg.batch_layout!r}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(cfg, name) < 1:  # from the command line or --config
            raise JobError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    try:
        args = cfg.training_arguments()
    except ValueError as e:  # transformers' own checks of the training options
        raise JobError(training_options_error(cfg, e)) from None
    out = Path(cfg.output_dir)
    cfg.resume_from_checkpoint = latest_checkpoint(cfg.resume_from_checkpoint, out)
    check_output_dir(cfg)
    check_resume(cfg.resume_from_checkpoint)
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    timer.mark("checks")
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
    timer.mark("verify")

    # --bf16/--fp16 are the Trainer's mixed precision (autocast over float32 master weights); the load dtype is
    # --model-dtype. A live reference needs no master weights: it runs in the autocast dtype.
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else getattr(torch, cfg.model_dtype)
    policy = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.model_dtype),
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
    pad = pad_id(tokenizer)
    timer.mark("load")
    layout = _choose_layout(cfg, args, policy, ref_model, train, pad, log)
    timer.mark("layout")
    out.mkdir(parents=True, exist_ok=True)
    seen = prepare_metrics(out / "metrics.jsonl", cfg.resume_from_checkpoint) if _rank()[0] == 0 else set()
    trainer = DPOTrainer(
        model=policy,
        args=args,
        data_collator=PrefixSharedCollator(pad) if layout == "prefix_shared" else PairCollator(pad),
        train_dataset=datasets.Dataset(train.table),
        eval_dataset=datasets.Dataset(evaluation.table) if evaluation else None,
        processing_class=tokenizer,
        callbacks=[MetricsFile(out / "metrics.jsonl", seen)],
        loss_config=loss_config,
        ref_model=ref_model,
        save_with=lambda folder: record_in(folder, record),
    )
    timer.mark("setup")
    t_train = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint)
    train_s = time.perf_counter() - t_train
    final_eval = {}
    if evaluation:  # reuse the eval of the last step when there was one
        last = [r for r in trainer.state.log_history if "eval_loss" in r]
        final_eval = last[-1] if last and last[-1].get("step") == result.global_step else trainer.evaluate()
    timer.mark("train")
    trainer.save_model(str(out))
    if cfg.lora.use_peft and trainer.is_world_process_zero():
        lora.save_outputs(trainer.model, out, cfg.lora, tokenizer)
    timer.mark("save")
    first = [r for r in trainer.state.log_history if "eval_loss" in r and r.get("step") == 0]
    summary = {"eval_start": first[0] if first else {}, "output_dir": str(out.resolve()), "steps": result.global_step,
               "batch_layout": layout,
               "train_loss": result.training_loss, "train_s": train_s, "verify_s": verify_s, "eval": final_eval,
               "phases": timer.phases}
    if trainer.is_world_process_zero():
        _finish(cfg, out, train, record, initial_hash, summary, reference, timer)
    return summary


TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
                    "comet_ml": ("comet_ml",), "clearml": ("clearml",), "dvclive": ("dvclive",),
                    "trackio": ("trackio",), "swanlab": ("swanlab",), "neptune": ("neptune",)}


def check_trackers(trackers: list[str]) -> None:
    """A tracker whose package is missing is refused before verification and model load, with the install line."""
    import importlib.util

    for name in trackers:
        if name == "all":
            continue
        packages = TRACKER_PACKAGES.get(name)
        if packages is None:
            raise JobError(f"--report-to {name}: unknown tracker; use one of {', '.join(TRACKER_PACKAGES)} or none")
        if not any(importlib.util.find_spec(p) for p in packages):
            extra = "pip install 'refcache[tensorboard]'" if name == "tensorboard" else f"pip install {packages[0]}"
            raise JobError(f"--report-to {name}: the {packages[0]} package is not installed; install it with `{extra}`")


def training_options_error(cfg: TrainConfig, e: ValueError) -> str:
    detail = " ".join(str(e).split())
    if (cfg.bf16 or cfg.fp16) and not cfg.use_cpu and not _has_accelerator():
        flag = "--bf16" if cfg.bf16 else "--fp16"
        return f"{flag} needs a GPU here; to train on CPU add --use-cpu (bf16 autocast on CPU), or drop {flag}"
    return f"invalid training options: {detail}"


def latest_checkpoint(value: str | None, out: Path) -> str | None:
    """--resume-from-checkpoint true means the latest checkpoint-N in --output-dir, as in the Trainer."""
    if value is None or value.strip().lower() not in ("true", "yes", "1"):
        return None if value is None or value.strip().lower() in ("false", "no", "0", "") else value
    from transformers.trainer_utils import get_last_checkpoint

    latest = get_last_checkpoint(str(out)) if out.is_dir() else None
    if latest is None:
        raise JobError(f"--resume-from-checkpoint true: no checkpoint-N folder in --output-dir {out}")
    return latest
def _choose_layout(cfg: TrainConfig, args, policy, ref_model, train, pad_id: int, log) -> str:
    """The batch layout (dpo/layout.py), probed where training runs unless the model is sharded."""
    import torch

    from .layout import choose_layout

    sharded = bool(cfg.fsdp or cfg.deepspeed)
    if not sharded and cfg.batch_layout != "padded":
        policy.to(args.device)
    rank, _ = _rank()
    autocast = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None  # the Trainer's mixed precision
    return choose_layout(cfg.batch_layout, [m for m in (policy, ref_model) if m is not None], train.table,
                         cfg.per_device_train_batch_size, pad_id, log if rank == 0 else (lambda _m: None),
                         can_probe=not sharded, autocast=autocast)




def check_resume(checkpoint: str | None) -> None:
    """A checkpoint to resume from must be complete: the Trainer writes trainer_state.json last, and a folder without
    it (a save that was interrupted) fails deep inside the Trainer, after verification (some transformers versions
    instead restart at step 0 from the half-saved weights)."""
    if checkpoint and not (Path(checkpoint) / "trainer_state.json").is_file():
        reason = ("no such directory" if not Path(checkpoint).is_dir() else
                  "no trainer_state.json in it (not a Trainer checkpoint, or one interrupted while being saved)")
        raise JobError(f"--resume-from-checkpoint {checkpoint}: {reason}; resume from a complete checkpoint-N folder")


def _finish(cfg, out: Path, train, record: dict, initial_hash: str, summary: dict, reference: str | None,
            timer: PhaseTimer) -> None:
    from .provenance import write_run_manifest
    from .trainer import plot_metrics

    if cfg.plot and (out / "metrics.jsonl").exists():
        plot_metrics(out / "metrics.jsonl", out / "metrics.png")
    timer.mark("plot")
    if cfg.lora.use_peft:  # the checkpoint is an adapter: its own hash, and the merged model's if written
        peft = lora.manifest_section(cfg.lora, out, initial_hash, reference or lora.reference_hash(cfg.lora, initial_hash))
        sections = {"final_model_hash": peft["merged_model_hash"], "peft": peft}
    else:
        sections = {"final_model_hash": model_hash(out)}
    timer.mark("final_hash")
    manifest = write_run_manifest(cfg, out, record, train, initial_hash, summary, **sections)
    summary["final_model_hash"] = manifest["final_model_hash"]
    timer.mark("manifest")  # in the summary only: the manifest is written by then
