"""train-dpo recipe: verify the cache, build the rows, train with the Trainer, write the checkpoint, metrics, plot and
run manifest. With a cache the reference model is never constructed in this process."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.cli import heap_settled
from runtime.locations import read_locations
from runtime.options import field_help
from runtime.disk import writing
from runtime.distributed import Dist
from runtime.errors import JobError
from runtime.hub import origin
from runtime.placed import Attention, Placement, attention_of, attention_refused, included, load_placed
from runtime import kl_control, placement
from runtime.kl_control import alarm_text, target_text  # (the class body has a field named kl_control)
from runtime.terminal import echo
from schemas.encoding import (CHAT_TEMPLATE_MODES, COMPLETION_END_MODES, TRUNCATION_MODES, EncodingConfig,
                              column_mapping)
from schemas.stamps import model_hash

from . import lora
from .loss_config import LOSS_TYPES, LossConfig, loss_field
from .outdir import check_no_links, check_output_dir, inputs, prepare_metrics
from .phases import PhaseTimer
from .preflight import check_reference_options, check_training_options, has_accelerator
from .preflight import latest_checkpoint  # noqa: F401  (re-exported)
from .verify import EncodedOnly, Verified, declared_reference, encode_only, verify_and_join

if TYPE_CHECKING:  # imported where used: `train-dpo --help` reads TrainConfig without importing torch
    from runtime.checkpoint import Checkpoint


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
        "or a hub id in the local Hugging Face cache.", "Model", required=True, location="input"))
    data: str = field(metadata=field_help(
        "Training preference data (file, folder, save_to_disk folder or hub data set id), encoded exactly as the "
        "cache was.", "Data", required=True, location="input"))
    output_dir: str = field(metadata=field_help(
        "Where checkpoints, metrics.jsonl, metrics.png and run-manifest.json go.", "Output", required=True,
        location="output"))
    ref_cache: str | None = _f(None, "Cache written by precompute-ref for --data (a folder or an object-store URL); "
                                     "verified before use.", "Reference cache", location="input", store=True)
    cache_version: int | None = field(default=None, metadata=field_help(
        "Train on this version of an updated --ref-cache (precompute-ref --update keeps each earlier version's "
        "manifest as manifest-NNNNN.json); also of the eval rows when they come from --ref-cache.", "Reference cache",
        min=1, show_default="the current version", domain="count"))
    ref_model: str | None = _f(None, "Reference checkpoint: with --ref-cache it is only hashed (never loaded); "
                                     "without, live-reference mode.", "Reference cache", location="input")
    ref_model_hash: str | None = _f(None, "Model hash the cache must carry, when the reference differs from --model "
                                          "and is not at hand.", "Reference cache")
    split: str = _f("train", "Split of --data to train on (datasets' split names: train, test/eval, validation).",
                    "Data")
    eval_data: str | None = _f(None, "Evaluation preference data (needs its own cache: --eval-ref-cache).", "Data",
                               location="input")
    eval_split: str = _f("test", "Split of --eval-data (eval.jsonl and test.jsonl are split test, as in datasets).",
                         "Data")
    eval_ref_cache: str | None = _f(None, "Cache of the eval rows: precompute-ref --data EVAL_DATA --split "
                                          "EVAL_SPLIT --out DIR.", "Reference cache", location="input",
                                    store=True)
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
    fsdp_config: str | None = _f(None, "FSDP config JSON file.", "Training", location="input", json_text=True)
    deepspeed: str | None = _f(None, "DeepSpeed config JSON file (needs the deepspeed package).", "Training",
                               location="input", json_text=True)
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


@dataclass
class Run:
    """What train-dpo has opened and verified before any model is built."""

    policy: Checkpoint  # --model, with --init-adapter merged in on load (LoRA)
    live: Checkpoint | None  # the live --ref-model (the policy's own Checkpoint when it names the same folder)
    reference: str | None  # the model hash the caches carry (hashed once, for train and eval caches alike)
    train: Verified | EncodedOnly  # EncodedOnly with a live reference: nothing to verify against
    evaluation: Verified | EncodedOnly | None
    record: dict
    verify_s: float
    ref_layout: dict | None = None  # where a live reference split by --ref-device-map went (runtime/placement.py)


def run_train(cfg: TrainConfig, log=echo) -> dict:
    """The steps, in order: refuse what the options alone show, open the policy checkpoint and refuse the rest of the
    options, verify the cache(s) and join the rows, load the models, build the Trainer, train and write the outputs."""
    timer = PhaseTimer()  # the run's fixed cost per phase, in the summary and the run manifest
    import datasets, torch, transformers  # noqa: E401, F401  (the libraries' import time, as its own phase)

    timer.mark("imports")
    check_reference_options(cfg, log)
    from .kl_governor import check_kl_options  # (transformers: not for --help and the options' refusals)

    check_kl_options(cfg)
    policy = _open_policy(cfg, log)
    args = check_training_options(cfg)
    timer.mark("checks")
    run = _verify(cfg, policy, log)
    check_top_k(cfg, run)
    note_eval_without_top_k(cfg, run, log)
    timer.mark("verify")
    with contextlib.ExitStack() as held:  # the lock of --output-dir, and a split reference's offload folder
        model, ref_model = _load_models(cfg, run, args, held, log)
        timer.mark("load")
        _take_output_dir(cfg, held)
        trainer, layout = _build_trainer(cfg, args, run, model, ref_model, log, timer)
        heap_settled()  # the libraries, the rows, the model and the Trainer: alive until the process ends
        timer.mark("setup")
        return _train(cfg, trainer, run, layout, timer)


def _take_output_dir(cfg: TrainConfig, held: contextlib.ExitStack) -> None:
    """Lock --output-dir for the whole run before anything is written in it, so that a second train-dpo into the
    same folder is refused; then check it again (another run may have used it since the first check). Rank 0 holds
    the lock for every rank of its job."""
    from runtime import locks

    def take():
        out = Path(cfg.output_dir)  # made by the lock, which takes it back if the run is refused or fails before
        held.enter_context(locks.exclusive(out, "train-dpo", "--output-dir"))  # writing anything else there
        check_output_dir(cfg)
        check_no_links(out)

    Dist.joined().share(take)


def _open_policy(cfg: TrainConfig, log) -> Checkpoint:
    """The policy checkpoint, checked (with --init-adapter, a LoRA run's), and the LoRA options."""
    from runtime.checkpoint import Checkpoint

    cfg.origins = {name: origin(getattr(cfg, name), "model") for name in ("model", "ref_model") if getattr(cfg, name)}
    cfg.model = cfg.origins["model"]["path"]  # a hub id in the local Hugging Face cache -> its snapshot folder
    cfg.ref_model = cfg.origins["ref_model"]["path"] if cfg.ref_model else None
    Placement.of(cfg).check_apart(lambda: inputs(cfg) | {"--output-dir": cfg.output_dir})  # an output as well
    policy = Checkpoint.open(cfg.model, cfg.trust_remote_code, lora.init_adapter(cfg.lora))
    policy.start_hashing()  # while the tokenizer loads and the cache's files are hashed
    lora.check_options(cfg.lora)
    for note in lora.notes(cfg.lora, cached=cfg.ref_cache is not None):
        log(note)
    return policy


def _verify(cfg: TrainConfig, policy: Checkpoint, log) -> Run:
    """The reference the cache(s) must hold, then the rows: verified and joined to the cached values (or, live,
    encoded); a resume must be against the same reference and data."""
    from runtime.checkpoint import Checkpoint

    from .provenance import check_resume_reference, reference_record

    tokenizer = policy.tokenizer  # loaded (a broken one refused) before the clock starts
    t0 = time.perf_counter()
    live = None
    if cfg.ref_cache is None:
        live = policy if _same_folder(cfg.ref_model, cfg.model) else Checkpoint.open(cfg.ref_model,
                                                                                      cfg.trust_remote_code)
    initial_hash = policy.base_hash
    reference = None
    if cfg.ref_cache is not None:
        reference = _declared_reference(cfg, policy)
    elif cfg.lora.use_peft:
        lora.check_live_reference(policy, live)
    with lora.explained_reference(cfg.lora, cfg.model, initial_hash):
        train = _rows(cfg, tokenizer, cfg.data, cfg.split, cfg.ref_cache, reference, log, cfg.cache_version)
        evaluation = None
        if cfg.eval_data:
            evaluation = _rows(cfg, tokenizer, cfg.eval_data, cfg.eval_split, cfg.eval_ref_cache or cfg.ref_cache,
                               reference, log, None if cfg.eval_ref_cache else cfg.cache_version)
    record = reference_record(cfg, train, evaluation, live.base_hash if live else None)
    if cfg.resume_from_checkpoint:
        check_resume_reference(cfg.resume_from_checkpoint, record, train, evaluation, log)  # before any model loads
    return Run(policy, live, reference, train, evaluation, record, time.perf_counter() - t0)


def check_top_k(cfg: TrainConfig, run: Run) -> None:
    """A loss or option that needs the reference's top-k distribution (dpo/losses.py) refuses rows without it,
    before any model is loaded: a live reference, or a cache made without --top-k."""
    from .kl_governor import needs_top_k

    option = cfg.loss_config().needs_top_k or needs_top_k(cfg)
    if option is None:
        return
    wanted = [(run.train, cfg.data, cfg.split, cfg.ref_cache, "--ref-cache")]
    if run.evaluation is not None:
        wanted.append((run.evaluation, cfg.eval_data, cfg.eval_split, cfg.eval_ref_cache or cfg.ref_cache,
                       "--eval-ref-cache" if cfg.eval_ref_cache else "--ref-cache"))
    for rows, data, split, cache, flag in wanted:
        if "ref_chosen_top_ids" in rows.table.column_names:
            continue
        held = (f"the cache {cache} holds only the log-probs of the dataset's tokens" if cache else
                "a live reference is scored on the dataset's tokens only")
        raise JobError(
            f"{option} needs the reference's top-k distribution at every completion token, and {held}: run "
            f"`precompute-ref --model {cfg.ref_model or cfg.model} --data {data} --split {split} --out NEW_CACHE "
            f"--top-k 32` (the same encoding options; any K > 0) and pass {flag} NEW_CACHE")


def note_eval_without_top_k(cfg: TrainConfig, run: Run, log) -> None:
    """A top-k train cache with eval rows without top-k: the train steps log the KL figures, the evaluations cannot;
    one note, so a missing eval KL is not a surprise."""
    has = lambda rows: rows is not None and "ref_chosen_top_ids" in rows.table.column_names
    if has(run.train) and run.evaluation is not None and not has(run.evaluation):
        where = (f"the eval cache {cfg.eval_ref_cache} was made without --top-k" if cfg.eval_ref_cache else
                 "the eval rows have no top-k distribution")
        log(f"note: {where}, so the evaluations log no KL figures (the train steps do, from --ref-cache's top-k); "
            f"precompute-ref the eval split with --top-k for them")


def _same_folder(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def _hashed_reference(cfg: TrainConfig, policy: Checkpoint) -> str:
    """The model hash of --ref-model beside a cache: only hashed, never loaded (nor checked as a model to load)."""
    return policy.base_hash if _same_folder(cfg.ref_model, cfg.model) else model_hash(cfg.ref_model)


def _declared_reference(cfg: TrainConfig, policy: Checkpoint) -> str:
    """The model hash the cache(s) must carry, train and eval alike: --ref-model's, --ref-model-hash, else the
    policy's starting point (with --init-adapter, base + adapter). --ref-model and --ref-model-hash are two
    declarations of one reference: where they disagree neither is taken."""
    hashed = _hashed_reference(cfg, policy) if cfg.ref_model else None
    return declared_reference(cfg.ref_model, hashed, cfg.ref_model_hash) or policy.model_hash


def _rows(cfg: TrainConfig, tokenizer, data, split, cache, reference: str | None, log, version: int | None = None):
    if cache is not None:
        dist = Dist.joined()  # under torchrun every rank verifies (it needs the joined rows) and refuses together
        return dist.share(lambda: verify_and_join(
            tokenizer=tokenizer, model_dir=cfg.model, data=data, split=split, cache_dir=cache, cache_version=version,
            expected_model_hash=reference, encoding_request=cfg.encoding_request(),
            on_bad_row=cfg.on_bad_row, verify_files=not cfg.fast_verify and dist.rank == 0,  # files hashed once
            log=log if dist.rank == 0 else (lambda _m: None),
        ), every_rank=True, what="the cache")
    request = {k: v for k, v in cfg.encoding_request().items() if v is not None}
    return encode_only(tokenizer=tokenizer, data=data, split=split, encoding=EncodingConfig(**request),
                       on_bad_row=cfg.on_bad_row)


def _load_models(cfg: TrainConfig, run: Run, args, held: contextlib.ExitStack, log):
    """The policy (LoRA-wrapped with --use-peft) and the live reference model (None with a cache), split by
    --ref-device-map where asked (its offload folder held by `held`)."""
    import torch

    from .trainer import disable_dropout

    # --bf16/--fp16 are the Trainer's mixed precision (autocast over float32 master weights); the load dtype is
    # --model-dtype. A live reference needs no master weights: it runs in the autocast dtype.
    dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else getattr(torch, cfg.model_dtype)
    policy = _load(cfg, run.policy, f"--model {cfg.model}", getattr(torch, cfg.model_dtype), trainable=True,
                   **lora.load_kwargs(cfg.lora, dtype))
    disable_dropout(policy)
    ref_model = None
    placed = Placement.of(cfg)
    if cfg.lora.use_peft:
        policy = lora.wrap_policy(policy, cfg.lora, cfg.gradient_checkpointing, cfg.seed, cfg.origins["model"])
        ref_model = lora.AdapterDisabled(policy) if cfg.ref_cache is None else None
    elif cfg.ref_cache is None and placed.split:  # dispatched as precompute-ref does (runtime/placed.py)
        what = f"--ref-model {cfg.ref_model}"
        ref_model, run.ref_layout = load_placed(lambda **split: _load(cfg, run.live, what, dtype, None, **split),
                                                what, placed, held)
        log(f"live reference: {placement.describe(run.ref_layout)}")
    elif cfg.ref_cache is None:
        ref_model = _load(cfg, run.live, f"--ref-model {cfg.ref_model}", dtype, args.device)
    return policy, ref_model


def _load(cfg: TrainConfig, checkpoint: Checkpoint, what: str, dtype, device=None, **kwargs):
    """A model of train-dpo with --attn-implementation: one the model or this installation cannot use is refused
    naming those it can (as precompute-ref refuses it)."""
    attention = attention_of(cfg)
    try:
        return checkpoint.load_model(dtype, device, attention, **kwargs)
    except (ImportError, ValueError) as e:
        # transformers' own choice, or an error about something else (--load-in-4bit without bitsandbytes, ...)
        if attention is None or not any(w in str(e).lower() for w in ("attn", "attention")):
            raise
        raise attention_refused(what, cfg.attn_implementation, checkpoint, e) from None


def _build_trainer(cfg: TrainConfig, args, run: Run, policy, ref_model, log, timer: PhaseTimer):
    import datasets

    from .layout import PrefixSharedCollator
    from .provenance import record_in
    from .resume import start_run
    from .kl_governor import save_beta_dpo
    from .trainer import DPOTrainer, MetricsFile, PairCollator

    pad = run.policy.pad_id
    layout = _choose_layout(cfg, args, policy, ref_model, run.train, pad, log)
    timer.mark("layout")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if Dist.joined().rank == 0:
        cfg.run_id = start_run(cfg, log)
    seen = prepare_metrics(out / "metrics.jsonl", cfg.resume_from_checkpoint) if Dist.joined().rank == 0 else set()
    record = run.record | {"run_id": cfg.run_id}  # what each checkpoint says it was trained on, and by which run
    metrics = MetricsFile(out / "metrics.jsonl", seen)
    governor = _governor(cfg, out, metrics, log)
    trainer = DPOTrainer(
        model=policy,
        args=args,
        data_collator=PrefixSharedCollator(pad) if layout == "prefix_shared" else PairCollator(pad),
        train_dataset=datasets.Dataset(run.train.table),
        eval_dataset=datasets.Dataset(run.evaluation.table) if run.evaluation else None,
        processing_class=run.policy.tokenizer,
        callbacks=[c for c in (governor, metrics) if c is not None],
        loss_config=cfg.loss_config(),
        ref_model=ref_model,
        save_with=lambda folder: (record_in(folder, record), governor and governor.save(folder),
                                  save_beta_dpo(trainer, folder)),
    )
    if cfg.loss_type == "beta_dpo":
        from .losses import BetaDPO

        trainer.beta_dpo = BetaDPO(cfg.loss_config(), cfg.seed)
    if governor is not None:
        governor.attach(trainer)
    return trainer, layout


def _governor(cfg: TrainConfig, out: Path, metrics, log):
    """The KL governor (dpo/kl_governor.py) when the options ask for more than a fixed β; rank 0 writes its
    records. The run id is every rank's (from the output dir's record) so that each can pick a rollback."""
    from .kl_governor import KLGovernor, governs, settings_of

    if not governs(cfg):
        return None
    rank0 = Dist.joined().rank == 0
    run_id = Dist.joined().share(lambda: cfg.run_id, what="the run id")
    return KLGovernor(settings_of(cfg), out, write=metrics.append if rank0 else None, log=log, run_id=run_id)


def _train(cfg: TrainConfig, trainer, run: Run, layout: str, timer: PhaseTimer) -> dict:
    """Train, evaluate, save; rank 0 writes the plot and the run manifest."""
    out = Path(cfg.output_dir)
    t_train = time.perf_counter()
    from .kl_governor import KLGovernor, train

    governor = next((c for c in trainer.callback_handler.callbacks if isinstance(c, KLGovernor)), None)
    metrics_file = next((c for c in trainer.callback_handler.callbacks if type(c).__name__ == "MetricsFile"), None)
    result = train(trainer, governor, cfg.resume_from_checkpoint, metrics_file if trainer.is_world_process_zero()
                   else None)

    train_s = time.perf_counter() - t_train
    final_eval = {}
    if run.evaluation and cfg.evaluation_strategy() != "no":  # reuse the eval of the last step when there was one
        last = [r for r in trainer.state.log_history if "eval_loss" in r]
        final_eval = last[-1] if last and last[-1].get("step") == result.global_step else trainer.evaluate()
    timer.mark("train")
    trainer.save_model(str(out))
    if cfg.lora.use_peft and trainer.is_world_process_zero():
        lora.save_outputs(trainer.model, out, cfg.lora, run.policy.tokenizer)
    timer.mark("save")
    first = [r for r in trainer.state.log_history if "eval_loss" in r and r.get("step") == 0]
    summary = {"eval_start": first[0] if first else {}, "output_dir": str(out.resolve()), "steps": result.global_step,
               "batch_layout": layout, "world_size": trainer.args.world_size,
               "reference": "live" if cfg.ref_cache is None else "cache",
               "train_loss": result.training_loss, "train_s": train_s, "verify_s": run.verify_s, "eval": final_eval,
               "phases": timer.phases}
    if governor is not None:
        summary["kl_control"] = governor.summary()
    if trainer.is_world_process_zero():
        from .run_summary import closing_facts

        merged = out / lora.MERGED_DIR if cfg.lora.use_peft and cfg.lora.merge_adapter else None
        summary |= closing_facts(cfg, trainer, run, result, out / "metrics.jsonl", merged)
        with writing(out, "the run's last files (metrics.png, run-manifest.json, README.md) are incomplete"):
            _finish(cfg, out, run, summary, timer)
    return summary


def _choose_layout(cfg: TrainConfig, args, policy, ref_model, train, pad_id: int, log) -> str:
    """The batch layout (dpo/layout.py), probed where training runs unless the model is sharded."""
    import torch

    from .layout import choose_layout

    sharded = bool(cfg.fsdp or cfg.deepspeed)
    if not sharded and cfg.batch_layout != "padded":
        policy.to(args.device)
    autocast = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None  # the Trainer's mixed precision
    # rank 0 probes and decides, so every rank trains (and the manifest says) the same layout
    return Dist.joined().share(lambda: choose_layout(
        cfg.batch_layout, [m for m in (policy, ref_model) if m is not None], train.table,
        cfg.per_device_train_batch_size, pad_id, log, can_probe=not sharded, autocast=autocast), what="the batch layout")


def _finish(cfg, out: Path, run: Run, summary: dict, timer: PhaseTimer) -> None:
    from .card import write_cards
    from .provenance import write_run_manifest
    from .trainer import plot_metrics, plot_title

    if cfg.plot and (out / "metrics.jsonl").exists():
        run_name = cfg.training_args.get("run_name") or out.resolve().name  # --run-name, else the output dir's
        plot_metrics(out / "metrics.jsonl", out / "metrics.png",
                     plot_title(run_name, cfg.loss_type, cfg.beta, cfg.learning_rate))
    timer.mark("plot")
    if cfg.lora.use_peft:  # the checkpoint is an adapter: its own hash, and the merged model's if written
        peft = lora.manifest_section(cfg.lora, out, run.policy, run.reference or run.policy.model_hash)
        sections = {"final_model_hash": peft["merged_model_hash"], "peft": peft}
    else:
        sections = {"final_model_hash": model_hash(out)}
    if "kl_control" in summary:  # the rule, its final state and every alarm (dpo/kl_governor.py)
        sections["kl_control"] = summary["kl_control"]
    timer.mark("final_hash")
    manifest = write_run_manifest(cfg, out, run.record, run.train, run.policy.base_hash, summary, run_id=cfg.run_id,
                                  live_layout=run.ref_layout, **sections)
    summary["final_model_hash"] = manifest["final_model_hash"]
    write_cards(out, manifest)
    timer.mark("manifest")  # in the summary only: the manifest is written by then
