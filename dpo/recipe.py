"""train-dpo recipe: verify the cache, build the rows, train with the Trainer, write the checkpoint, metrics, plot and
run manifest. With a cache the reference model is never constructed in this process."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.cli import heap_settled, shell_word
from runtime.disk import writing
from runtime.distributed import Dist
from runtime.errors import JobError
from runtime.hub import origin
from runtime.data_files import split_of_file
from runtime.locations import check_present, named, was_given
from runtime.placed import (Placement, attention_of, attention_refused, check_flex_here, flex_on_cpu,
                            load_placed)
from runtime import placement, remedies
from runtime.terminal import echo
from schemas.encoding import EncodingConfig
from schemas.stamps import model_hash

from . import lora
from .config import TrainConfig
from .outdir import check_no_links, check_output_dir, inputs, prepare_metrics
from .phases import PhaseTimer
from .preflight import check_option_values, check_reference_options, check_training_options
from .preflight import latest_checkpoint  # noqa: F401  (re-exported)
from .verify import EncodedOnly, Verified, declared_reference, encode_only, verify_and_join

if TYPE_CHECKING:  # imported where used: `train-dpo --help` reads TrainConfig without importing torch
    from runtime.checkpoint import Checkpoint


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
    check_flex_here(cfg, "cpu" if cfg.use_cpu else None, "use_cpu")  # before the data, the tokenizer, the cache
    for data, split in (("data", "split"), ("eval_data", "eval_split")):  # one file: the one split its name says
        setattr(cfg, split, split_of_file(getattr(cfg, data), getattr(cfg, split), was_given(cfg, split),
                                          named(cfg, split), named(cfg, data)))
    check_reference_options(cfg, log)
    from .kl_governor import check_kl_options  # (transformers: not for --help and the options' refusals)

    check_kl_options(cfg)
    check_option_values(cfg)
    check_present(cfg)  # --model, --data, --ref-cache, ...: there, named as given (runtime/locations.py)
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

    from .provenance import check_resume_reference, checkpoint_record, reference_record

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
            eval_cache = cfg.eval_ref_cache or cfg.ref_cache
            shared = cfg.ref_cache is not None and _same_place(eval_cache, cfg.ref_cache)
            evaluation = _rows(cfg, tokenizer, cfg.eval_data, cfg.eval_split, eval_cache, reference, log,
                               None if cfg.eval_ref_cache else cfg.cache_version,
                               "--eval-ref-cache" if cfg.eval_ref_cache else "--ref-cache", shared)
    record = reference_record(cfg, train, evaluation, live.base_hash if live else None)
    if cfg.resume_from_checkpoint:
        check_resume_reference(cfg.resume_from_checkpoint, checkpoint_record(record, cfg.loss_config()), train,
                               evaluation, log)  # before any model loads
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
            f"`precompute-ref --model {shell_word(cfg.ref_model or cfg.model)} --data {shell_word(data)} --split "
            f"{shell_word(split)} --out NEW_CACHE "
            f"--top-k 32` (the same encoding options; any K > 0) and pass {flag} NEW_CACHE")


def note_eval_without_top_k(cfg: TrainConfig, run: Run, log) -> None:
    """A top-k train cache with eval rows without top-k: the train steps log the KL figures, the evaluations cannot;
    one note, so a missing eval KL is not a surprise."""
    has = lambda rows: rows is not None and "ref_chosen_top_ids" in rows.table.column_names
    if has(run.train) and run.evaluation is not None and not has(run.evaluation):
        where = (f"the eval cache {cfg.eval_ref_cache} was made without --top-k" if cfg.eval_ref_cache else
                 "the eval rows have no top-k distribution")
        k = run.train.report.get("top_k")
        log(f"note: {where}, so the evaluations log no KL figures (the train steps do, from --ref-cache's top-k"
            f"{f' {k}' if k else ''}); for them, "
            + remedies.eval_cache(cfg.ref_model or cfg.model, cfg.eval_data or cfg.data, cfg.eval_split, top_k=k))


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


def _same_place(a, b) -> bool:
    return str(a) == str(b) or (isinstance(a, Path) and isinstance(b, Path) and a.resolve() == b.resolve())


def _rows(cfg: TrainConfig, tokenizer, data, split, cache, reference: str | None, log, version: int | None = None,
          cache_option: str = "--ref-cache", serves_training: bool = False):
    if cache is not None:
        dist = Dist.joined()  # under torchrun every rank verifies (it needs the joined rows) and refuses together
        return dist.share(lambda: verify_and_join(
            tokenizer=tokenizer, model_dir=cfg.model, data=data, split=split, cache_dir=cache, cache_version=version,
            expected_model_hash=reference, encoding_request=cfg.encoding_request(),
            on_bad_row=cfg.on_bad_row, verify_files=not cfg.fast_verify and dist.rank == 0,  # files hashed once
            resuming=cfg.resume_from_checkpoint, cache_option=cache_option, serves_training=serves_training,
            log=log if dist.rank == 0 else (lambda _m: None),
            cache_named=named(cfg, cache_option[2:].replace("-", "_")).rstrip(": "),  # a --config key as written
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
    flex_on_cpu(what, attention, "cpu" if getattr(cfg, "use_cpu", False) else device)
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
    from .provenance import checkpoint_record, record_in
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
        save_with=lambda folder: (record_in(folder, checkpoint_record(record, cfg.loss_config())),
                                  governor and governor.save(folder), save_beta_dpo(trainer, folder)),
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
