"""train-dpo's options: TrainConfig, every field an option of the command line (dpo/cli.py generates them) and a
--config key, and what the recipe reads from them (the loss, the encoding asked for, transformers'
TrainingArguments)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import click

from runtime.distributed import Dist
from runtime.locations import read_locations
from runtime.options import field_help, model_hash_text
from runtime.placed import Attention, Placement, included
from runtime import kl_control
from runtime.kl_control import alarm_text, target_text  # (the class body has a field named kl_control)
from schemas.encoding import CHAT_TEMPLATE_MODES, COMPLETION_END_MODES, TRUNCATION_MODES, column_mapping

from . import lora
from .loss_config import LOSS_TYPES, LossConfig, loss_field
from .preflight import has_accelerator


def _f(default, help, group, **extra):
    return field(default=default, metadata=field_help(help, group, **extra))


def _loss(name: str, help: str):
    """A loss option: its default and domain are LossConfig's (dpo/loss_config.py), declared there once."""
    declared = loss_field(name)
    return _f(declared.default, help, "Loss", domain=declared.metadata["domain"])


@dataclass
@included(Attention, after="trust_remote_code", section="Model", notes={"attn_implementation": (
    "For the policy and a live reference (--ref-model without --ref-cache); TRL's attn_implementation.")})
# a live reference split by accelerate's dispatch: precompute-ref's placement options with the ref_ prefix, for
# --ref-model (older TRL's DPOConfig.ref_model_init_kwargs, passed to the reference's from_pretrained; TRL 1.16 loads
# its reference with the policy's model_init_kwargs)
@included(Placement, prefix="ref_", after="ref_model_hash", section="Live reference", notes={"device_map": (
    "For the live reference (--ref-model, no --ref-cache), as precompute-ref --device-map; not with --use-peft. The "
    "batch layout is probed on the split model.")})
class TrainConfig:
    """Every field is a train-dpo option (dpo/cli.py generates them, help from the metadata) and a --config key.
    Fields named as transformers.TrainingArguments fields are passed to it (refcache's defaults, TRL's where they
    differ from the Trainer's); any other TrainingArguments option lands in `training_args`."""

    model: str = field(metadata=field_help(
        "Policy checkpoint to start from (in standard DPO also the reference the cache was computed with): a folder "
        "or a hub id in the local Hugging Face cache.", "Model", required=True, location="input",
        present="checkpoint"))
    data: str = field(metadata=field_help(
        "Training preference data (file, folder, save_to_disk folder or hub data set id), encoded exactly as the "
        "cache was.", "Data", required=True, location="input", present="data"))
    output_dir: str = field(metadata=field_help(
        "Where checkpoints, metrics.jsonl, metrics.png and run-manifest.json go.", "Output", required=True,
        location="output"))
    ref_cache: str | None = _f(None, "Cache written by precompute-ref for --data (a folder or an object-store URL); "
                                     "verified before use.", "Reference cache", location="input", store=True,
                               present="cache")
    cache_version: int | None = field(default=None, metadata=field_help(
        "Train on this version of an updated --ref-cache (precompute-ref --update keeps each earlier version's "
        "manifest as manifest-NNNNN.json); also of the eval rows when they come from --ref-cache.", "Reference cache",
        min=1, show_default="the current version", domain="count"))
    ref_model: str | None = _f(None, "Reference checkpoint: with --ref-cache it is only hashed (never loaded); "
                                     "without, live-reference mode.", "Reference cache", location="input",
                               present="checkpoint")
    ref_model_hash: str | None = _f(None, "Model hash the cache must carry, when the reference differs from --model "
                                          "and is not at hand: 64 hex digits, the cache's stamps.model_hash.",
                                    "Reference cache", parse=model_hash_text, metavar="SHA256")
    split: str = _f("train", "Split of --data to train on (datasets' split names: train, test/eval, validation).",
                    "Data")
    eval_data: str | None = _f(None, "Evaluation preference data (needs its own cache: --eval-ref-cache).", "Data",
                               location="input", present="data")
    eval_split: str = _f("test", "Split of --eval-data (eval.jsonl and test.jsonl are split test, as in datasets).",
                         "Data")
    eval_ref_cache: str | None = _f(None, "Cache of the eval rows: precompute-ref --data EVAL_DATA --split "
                                          "EVAL_SPLIT --out DIR.", "Reference cache", location="input",
                                    store=True, present="cache")
    # encoding: taken from the cache; a value given here must agree with it
    max_length: int | None = _f(None, "Must agree with the cache's value.", "Data", show_default="the cache's",
                                 domain="count", min=2)
    truncation_mode: str | None = _f(None, "Must agree with the cache's value.", "Data", choices=TRUNCATION_MODES,
                                     show_default="the cache's")
    chat_template: str | None = _f(None, "Must agree with the cache's value.", "Data", choices=CHAT_TEMPLATE_MODES,
                                   show_default="the cache's")
    completion_end: str | None = _f(None, "Must agree with the cache's value.", "Data", choices=COMPLETION_END_MODES,
                                    show_default="the cache's")
    columns: str | None = _f(None, "Data columns under other names (TARGET=COLUMN pairs joined by commas, e.g. "
                                   "prompt=question,chosen=good); must agree with the cache's value.", "Data",
                             parse=column_mapping, metavar="TARGET=COLUMN,...", show_default="the cache's")
    on_bad_row: str = _f("error", "error, or skip rows the encoder rejects.", "Data", choices=("error", "skip"))
    fast_verify: bool = _f(False, "Skip the shard file sha256 check (stamps, rows and values are still verified).",
                           "Reference cache")
    # loss
    beta: float = _loss("beta", "DPO beta (strength of the pull towards the reference).")
    loss_type: str = _f("sigmoid", "Preference loss (formulas in dpo/losses.py).", "Loss", choices=LOSS_TYPES)
    label_smoothing: float = _loss("label_smoothing", "Label noise e (< 0.5) for sigmoid (cDPO) and robust losses.")
    rpo_alpha: float = _loss("rpo_alpha", "Weight of the SFT (NLL) term on chosen completions (RPO); 0 disables it.")
    ld_alpha: float = _loss("ld_alpha", "LD-DPO: weight of tokens past the shorter completion's length; 1 disables it.")
    tdpo_alpha: float = _loss("tdpo_alpha", "TDPO2: weight of the sequential-KL term (tdpo2 only).")
    kl_coef: float = _loss("kl_coef", "Add C x the mean per-token KL(policy||reference) bound of the chosen completions "
                                      "to the loss; needs a top-k cache (precompute-ref --top-k K). 0 disables it.")
    beta_dpo_alpha: float = _loss("beta_dpo_alpha", "β-DPO (--loss-type beta_dpo): α, how far the batch's reward "
                                                    "discrepancy moves β.")
    beta_dpo_rho: float = _loss("beta_dpo_rho", "β-DPO: ρ, the share of each batch its β-guided filtering leaves out "
                                                "(< 1).")
    beta_dpo_momentum: float = _loss("beta_dpo_momentum", "β-DPO: m, momentum of the discrepancy's moving mean and "
                                                          "deviation (< 1).")
    # β over the run: schedules, KL controllers and alarms (dpo/kl_governor.py, runtime/kl_control.py; README
    # "Controlling KL")
    beta_schedule: str = _f("constant", "β over the optimizer steps, from --beta to --beta-end (after the Trainer's "
                                        "warm-up, if set).", "KL control", choices=kl_control.SCHEDULES)
    beta_end: float | None = _f(None, "β of the last step with --beta-schedule.", "KL control", domain="coefficient")
    kl_target: str | None = _f(None, "Adapt β to the KL(policy||reference) bound of a top-k cache: LO:HI, a band "
                                     "(--kl-controller band), or T, a target (proportional); nats per token.",
                               "KL control", parse=target_text, metavar="LO:HI|T")
    kl_controller: str = _f("band", "band: ×/÷ --kl-adapt-factor outside LO:HI; proportional: Ziegler et al.'s "
                                    "controller on target T with --kl-horizon.", "KL control",
                            choices=kl_control.CONTROLLERS)
    kl_adapt_every: int = _f(1, "Decide every N optimizer steps, on the mean KL of their batches.", "KL control",
                             domain="count")
    kl_adapt_factor: float = _f(1.2, "Band controller's factor (and a KL rollback's).", "KL control",
                                domain="factor")
    kl_horizon: float = _f(10000.0, "Proportional controller's horizon, in pairs (OpenRLHF's kl_horizon).",
                           "KL control", domain="positive")
    kl_measure: str = _f("chosen", "The KL controllers and alarms watch: chosen completions, or both.", "KL control",
                         choices=kl_control.MEASURES)
    kl_control: str = _f("beta", "What the controller moves: beta, or kl_coef (--kl-coef).", "KL control",
                         choices=kl_control.CONTROLLED)
    beta_min: float = _f(0.001, "Lower clamp of the controlled coefficient.", "KL control", domain="coefficient")
    beta_max: float = _f(0.5, "Upper clamp of the controlled coefficient.", "KL control", domain="coefficient")
    kl_alarm: str | None = _f(None, "LEVEL[:warn|checkpoint|stop|rollback]: act when the logged KL bound exceeds "
                                    "LEVEL nats per token (needs a top-k cache).", "KL control",
                              parse=alarm_text, metavar="LEVEL[:ACTION]")
    kl_alarm_retries: int = _f(2, "Rollbacks at most, then stop.", "KL control", domain="natural")
    # transformers.TrainingArguments (same names and meaning; defaults as in TRL's DPOConfig where it sets one)
    learning_rate: float = _f(1e-6, "Initial AdamW learning rate.", "Training", domain="nonnegative")
    lr_scheduler_type: str = _f("linear", "Scheduler (transformers SchedulerType).", "Training")
    warmup_steps: float = _f(0, "Linear warmup steps (a float < 1 is a fraction of the total).", "Training",
                            domain="nonnegative")
    num_train_epochs: float = _f(1.0, "Epochs over --data.", "Training", domain="positive")
    max_steps: int = _f(-1, "Total optimizer steps; overrides --num-train-epochs when > 0.", "Training",
                       domain="integer")
    per_device_train_batch_size: int = _f(8, "Pairs per device per step.", "Training", domain="count")
    per_device_eval_batch_size: int = _f(8, "Pairs per device per eval step.", "Training", domain="count")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.", "Training", domain="count")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0: no clipping).", "Training",
                             domain="nonnegative")
    weight_decay: float = _f(0.0, "AdamW weight decay.", "Training", domain="nonnegative")
    optim: str | None = _f(None, "Optimizer (transformers OptimizerNames); default: the Trainer's own, as in TRL "
                           "(adamw_torch_fused on torch >= 2.8, else adamw_torch), recorded as resolved.", "Training")
    seed: int = _f(42, "Seed of the run (model init, sampler; data_seed defaults to it).", "Training",
                  domain="natural")
    bf16: bool = _f(False, "bf16 mixed precision: fp32 master weights, bf16 autocast (the Trainer's meaning). On CPU "
                           "add --use-cpu.", "Training")
    fp16: bool = _f(False, "fp16 mixed precision with loss scaling (CUDA).", "Training")
    model_dtype: str = _f("float32", "dtype the policy is loaded in (its master weights). Pure bf16 training: "
                                     "bfloat16 without --bf16.", "Training",
                          choices=("float32", "bfloat16", "float16"))
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass to save memory.",
                                      "Training")
    logging_steps: float = _f(10, "Log train metrics every N steps.", "Training", domain="positive")
    eval_strategy: str | None = _f(None, "When to evaluate (no, steps, epoch). steps or epoch without --eval-data "
                                         "evaluates on --data's --eval-split (TRL's dataset_test_split); no: the eval "
                                         "rows are verified, not evaluated.", "Training",
                                   choices=("no", "steps", "epoch"), show_default="steps with --eval-data, else no")
    eval_steps: float | None = _f(None, "Evaluate every N steps.", "Training", show_default="--logging-steps",
                                  domain="positive")
    eval_on_start: bool = _f(False, "Also evaluate before the first step (needs evaluation rows).", "Training")
    save_strategy: str = _f("steps", "When to save checkpoints (no, steps, epoch, best).", "Training")
    save_steps: float = _f(500, "Save a checkpoint every N steps.", "Training", domain="positive")
    save_total_limit: int | None = _f(None, "Keep at most N checkpoints (0: no limit).", "Training",
                                         domain="natural")
    report_to: str = _f("none", "Comma-separated trackers (tensorboard, wandb, ...) or none; checked before any "
                                "work. Name the run with --run-name.", "Training")
    resume_from_checkpoint: str | None = _f(None, "A checkpoint-N folder of this --output-dir's run, or true for the "
                                                  "latest there.", "Training", location="input",
                                             words=("true", "yes", "1", "false", "no", "0"))
    dataloader_num_workers: int = _f(0, "Data loader worker processes.", "Training", domain="natural")
    use_cpu: bool = _f(False, "Train on CPU even if a GPU is present (needed for --bf16 on CPU).", "Training")
    fsdp: str = _f("", "FSDP mode, e.g. 'full_shard auto_wrap' (under torchrun).", "Training")
    fsdp_config: str | None = _f(None, "FSDP config JSON file.", "Training", location="input", json_text=True,
                                 click_type=click.Path(exists=True, dir_okay=False))
    deepspeed: str | None = _f(None, "DeepSpeed config JSON file (needs the deepspeed package).", "Training",
                               location="input", json_text=True, click_type=click.Path(exists=True, dir_okay=False))
    # ours
    trust_remote_code: bool = _f(False, "Allow custom model code from checkpoint folders.", "Model")
    plot: bool = _f(True, "Write metrics.png at the end.", "Output")
    overwrite_output_dir: bool = _f(False, "Start a new run in an --output-dir that holds an earlier run's files "
                                           "(its checkpoints, record, manifest and metrics are deleted; nothing else "
                                           "is).", "Output")
    batch_layout: str = _f("auto", "padded, prefix_shared (each prompt once per pair, pairs packed with a tree mask) "
                                   "or auto (prefix_shared when it is less work and matches the plain forward on a "
                                   "probe; dpo/layout.py).", "Training", choices=("auto", "padded", "prefix_shared"))
    # every other transformers.TrainingArguments option given (generated options; see dpo/cli.py)
    training_args: dict = field(default_factory=dict, metadata={"cli": False})
    config_file: str | None = field(default=None, metadata={"cli": False, "location": "input"})  # --config: an input
    lora: lora.LoraOptions = field(default_factory=lora.LoraOptions, metadata={"cli": False})  # dpo/lora.py options
    # set once the run starts writing --output-dir (dpo/resume.start_run): in its checkpoints and run manifest
    run_id: str | None = field(default=None, init=False, metadata={"cli": False})
    # where --model and --ref-model came from (runtime.hub.origin: a hub id beside its snapshot), set when resolved
    origins: dict = field(default_factory=dict, init=False, metadata={"cli": False})

    def __post_init__(self):
        read_locations(self)

    def loss_config(self) -> LossConfig:
        return LossConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LossConfig)})  # same names

    def encoding_request(self) -> dict:
        return {"max_length": self.max_length, "truncation_mode": self.truncation_mode,
                "chat_template": self.chat_template, "columns": column_mapping(self.columns),
                "completion_end": self.completion_end}

    def training_arguments(self):
        import transformers

        fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init}
        ours = {f.name for f in dataclasses.fields(self)} - {"resume_from_checkpoint", "report_to",
                                                              "gradient_checkpointing", "eval_strategy", "eval_on_start"}
        kwargs = {n: getattr(self, n) for n in sorted(ours & fields) if not (n == "optim" and self.optim is None)}
        checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
        strategy = self.evaluation_strategy()
        kwargs.update({
            checkpointing: self.gradient_checkpointing,
            "eval_strategy": strategy,
            "eval_on_start": self.eval_on_start and strategy != "no",
            # under torchrun on a machine without a GPU: the Trainer (accelerate) starts the gloo process group only
            # when told the device is the CPU; otherwise every process would train alone, as world size 1
            "use_cpu": self.use_cpu or (Dist().world > 1 and not has_accelerator()),
            "report_to": self.trackers() or "none",
            "logging_first_step": True,
            "data_seed": self.seed,
            "dataloader_pin_memory": not self.use_cpu and has_accelerator(),
            "disable_tqdm": False,  # the Trainer's bar with ETA, although the libraries' logging is quietened
        })
        kwargs.update(self.training_args)  # any other TrainingArguments option, as given
        # paths as the text TrainingArguments takes (it reads a str as a file name, anything else as a dict)
        kwargs = {k: str(v) if isinstance(v, Path) else v for k, v in kwargs.items()}
        kwargs["remove_unused_columns"] = False  # the collator needs the cached reference columns
        return transformers.TrainingArguments(**kwargs)

    def evaluation_strategy(self) -> str:
        """The Trainer's eval_strategy: --eval-strategy as given (steps when it is not and there are eval rows);
        no without eval rows (dpo/preflight.check_evaluation has refused an explicit one by then)."""
        if self.eval_data is None:
            return "no"
        return self.eval_strategy or "steps"

    def trackers(self) -> list[str]:
        return [r.strip() for r in self.report_to.replace(" ", ",").split(",") if r.strip() and r.strip() != "none"]
