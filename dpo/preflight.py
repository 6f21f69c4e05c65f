"""train-dpo's refusals that need only the options: reference flags, trackers, Trainer arguments, output dir and
the checkpoint to resume from. All run before any cache or data is read and before any model is loaded."""

from __future__ import annotations

from pathlib import Path

from runtime.cli import shell_word
from runtime.distributed import Dist
from runtime.errors import JobError
from runtime.locations import named, renamed
from runtime.terminal import echo

from .outdir import at_last_step, check_no_links, check_output_dir
from .resume import check_resume, overwrite_plan

TRUE = ("true", "yes", "1")


def check_reference_options(cfg, log=echo) -> None:
    """--ref-cache / --ref-model / --ref-model-hash / --eval-ref-cache agree, the evaluation asked for can happen,
    and the trackers are installed."""
    if cfg.ref_cache is None and cfg.ref_model is None:
        from runtime.remedies import split_words

        raise JobError("give --ref-cache DIR (the reference's log-probs, made once with `precompute-ref --model "
                       f"{shell_word(cfg.model)} --data {shell_word(cfg.data)}{split_words(cfg.split)} --out REF_CACHE`, then "
                       "--ref-cache REF_CACHE) or --ref-model PATH (a live reference, loaded beside the policy)")
    if cfg.ref_model_hash and cfg.ref_cache is None:
        raise JobError("--ref-model-hash only declares which reference a --ref-cache must hold; add --ref-cache")
    if cfg.cache_version is not None and cfg.ref_cache is None:
        raise JobError(f"--cache-version {cfg.cache_version} names a version of the --ref-cache; add --ref-cache")
    check_reference_split(cfg)
    rows = check_evaluation(cfg, log)
    same_rows = (cfg.eval_data, cfg.eval_split) == (cfg.data, cfg.split)  # then the training cache holds them
    if cfg.eval_data and cfg.ref_cache is not None and cfg.eval_ref_cache is None and not same_rows:
        raise JobError(
            f"evaluation on {rows} needs the reference log-probs of its rows: run `precompute-ref --model "
            f"{shell_word(cfg.ref_model or cfg.model)} --data {shell_word(cfg.eval_data)} --split "
            f"{shell_word(cfg.eval_split)} --out EVAL_CACHE` "
            "(same encoding options as the training cache) and pass --eval-ref-cache EVAL_CACHE"
            + ("" if cfg.evaluation_strategy() == "no" else ", or pass --eval-strategy no to train without evaluation"))
    check_trackers(cfg.trackers(), named(cfg, "report_to"))


def check_reference_split(cfg) -> None:
    """--ref-device-map / --ref-max-memory / --ref-offload-folder place a live reference model of its own: refused
    where there is none (a cache; --use-peft, whose reference is the policy with its adapter disabled) and where
    precompute-ref refuses its own (runtime/placement.py)."""
    from runtime.placed import Placement

    placed = Placement.of(cfg)
    given = placed.given()
    if not given:
        return
    if cfg.ref_cache is not None:
        raise JobError(f"{', '.join(given)}: with --ref-cache no reference model is loaded (its log-probs are read "
                       "from the cache), so there is nothing to split; drop them, or give --ref-model without "
                       "--ref-cache for a live reference (precompute-ref takes --device-map to make the cache)")
    if cfg.lora.use_peft:
        raise JobError(f"{', '.join(given)} with --use-peft: the live reference is the policy itself with its adapter "
                       "disabled (one model, placed with the policy), so there is no separate reference to split; drop "
                       "them, or train against a --ref-cache made by precompute-ref --device-map")
    placed.check(world=Dist().world)


def check_evaluation(cfg, log) -> str:
    """The evaluation asked for happens or is refused, never dropped in silence: --eval-strategy steps/epoch without
    --eval-data evaluates on --data's --eval-split (as `trl dpo` does with dataset_test_split), or is refused when
    --data is one file; --eval-strategy no evaluates nothing (the eval rows are still verified); --eval-on-start
    needs an evaluation. Returns what the eval rows are, for the messages that follow."""
    asked = cfg.eval_strategy not in (None, "no")
    if asked and cfg.eval_data is None:
        if Path(cfg.data).is_file():
            raise JobError(
                f"--eval-strategy {cfg.eval_strategy} needs evaluation rows, and --data {cfg.data} is one file (it has "
                f"no split {cfg.eval_split!r} to evaluate on): give --eval-data EVAL_FILE with --eval-ref-cache "
                "EVAL_CACHE (precompute-ref --data EVAL_FILE --out EVAL_CACHE), or --eval-strategy no")
        cfg.eval_data = cfg.data
        log(f"note: --eval-strategy {cfg.eval_strategy}: evaluating on split {cfg.eval_split!r} of --data {cfg.data} "
            "(TRL's dataset_test_split; --eval-data names other rows)")
        rows = f"split {cfg.eval_split!r} of --data {cfg.data} (for --eval-strategy {cfg.eval_strategy})"
    else:
        rows = f"--eval-data {cfg.eval_data}"
    if cfg.eval_on_start and cfg.evaluation_strategy() == "no":
        raise JobError("--eval-on-start asks for an evaluation, and there is none: "
                       + ("--eval-strategy no" if cfg.eval_data else "no --eval-data (nor --eval-strategy steps)")
                       + "; give --eval-data with --eval-strategy steps or epoch, or drop --eval-on-start")
    if cfg.eval_strategy == "no" and cfg.eval_data is not None:
        log(f"note: --eval-strategy no: --eval-data {cfg.eval_data} is verified, not evaluated")
    return rows


def check_option_values(cfg) -> None:
    """Values the options alone show wrong: refused before any place is looked at."""
    if cfg.batch_layout not in ("auto", "padded", "prefix_shared"):
        raise JobError(f"--batch-layout must be auto, padded or prefix_shared, got {cfg.batch_layout!r}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(cfg, name) < 1:  # from the command line or --config
            raise JobError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")


def check_training_options(cfg):
    """The Trainer's arguments, the output dir and the checkpoint to resume from; refused before any data is read."""
    check_option_values(cfg)
    check_json_configs(cfg)
    try:
        args = cfg.training_arguments()
    except ValueError as e:  # transformers' own checks of the training options
        raise JobError(training_options_error(cfg, e)) from None
    if cfg.optim is None:  # the Trainer's default, what TRL users get: recorded as what it resolved to
        cfg.optim = str(getattr(args.optim, "value", args.optim))
    _check_optimizer_and_scheduler(args)
    check_one_job(args.world_size)
    given = None if cfg.resume_from_checkpoint is None else str(cfg.resume_from_checkpoint)  # a path, or a word
    latest = given is not None and given.strip().lower() in TRUE
    cfg.resume_from_checkpoint = latest_checkpoint(given, Path(cfg.output_dir), named(cfg, "resume_from_checkpoint"))
    if cfg.resume_from_checkpoint and cfg.overwrite_output_dir:
        raise JobError("--overwrite-output-dir starts a new run over the output dir's, --resume-from-checkpoint "
                       "continues that run: give one of them")
    check_output_dir(cfg)
    if cfg.overwrite_output_dir:
        overwrite_plan(Path(cfg.output_dir))  # refuses what it could not prove an earlier run's own
    try:
        check_resume(cfg.resume_from_checkpoint, Path(cfg.output_dir), latest)
    except JobError as e:  # a checkpoint from --config: its file and key
        raise renamed(e, cfg, "resume_from_checkpoint") from None
    done = at_last_step(cfg.resume_from_checkpoint, cfg.max_steps) if cfg.resume_from_checkpoint else None
    if done is not None:
        raise JobError(f"--resume-from-checkpoint {cfg.resume_from_checkpoint}: the checkpoint is at step {done} of "
                       f"--max-steps {cfg.max_steps}, so nothing is left to train; its weights are the run's last "
                       "step's (load them from the checkpoint), or raise --max-steps to train on")
    check_no_links(Path(cfg.output_dir))
    return args


# the Trainer's options that take a JSON config (a file, or JSON text): (what it is, an example, its package)
JSON_CONFIGS = {"deepspeed": ("a DeepSpeed config", '{"zero_optimization": {"stage": 2}}', "deepspeed"),
                "fsdp_config": ("an FSDP config", '{"fsdp_version": 2}', None)}


def check_json_configs(cfg) -> None:
    """--deepspeed's and --fsdp-config's JSON read before the Trainer reads them (whose errors name neither the option
    nor the file): a file read as every config file is (runtime.config_file.read_text: a regular file, bounded, never
    waited on), JSON that does not read or is not an object refused naming the option (or the config file's key), the
    file and where it fails; a package the option needs, missing, refused with how to install it."""
    import importlib.util
    import json

    import click

    from runtime.config_file import read_text

    for name, (what, example, package) in JSON_CONFIGS.items():
        value = getattr(cfg, name, None)
        if value is None or isinstance(value, dict):
            continue
        given, text = named(cfg, name), str(value)
        shown = "JSON text" if text.lstrip().startswith("{") else shell_word(text)
        if shown != "JSON text":  # a file (the location type has found it there)
            try:
                text = read_text(value)
            except click.UsageError as e:
                raise JobError(f"{given}{e.message}") from None
        try:
            config = json.loads(text)
        except ValueError as e:
            raise JobError(f"{given}{shown}: not valid JSON ({e}); {what} is a JSON object (e.g. {example})") from None
        if not isinstance(config, dict):
            raise JobError(f"{given}{shown}: {what} is a JSON object, not {type(config).__name__}")
        if package and importlib.util.find_spec(package) is None:
            raise JobError(f"{given}{shown}: the {package} package is not installed here; install it with `pip "
                           f"install {package}` (on a CUDA machine), or leave --{name.replace('_', '-')} out")


def _check_optimizer_and_scheduler(args) -> None:
    """What the Trainer reads of --optim-args and --lr-scheduler-kwargs only when it builds them, after the models
    load and the run record is written: read here by the Trainer's own code, so a bad value is refused first."""
    from transformers import Trainer

    try:
        Trainer.get_optimizer_cls_and_kwargs(args)  # ImportError (a package the optimizer needs): run_cli says so
    except (ValueError, TypeError) as e:
        raise JobError(f"--optim {getattr(args.optim, 'value', args.optim)} --optim-args {args.optim_args!r}: the "
                       f"Trainer cannot build the optimizer ({e}); --optim-args takes key=value pairs separated by "
                       "commas (e.g. betas=0.9,0.99)") from None
    kwargs = args.lr_scheduler_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise JobError(f"--lr-scheduler-kwargs {kwargs!r}: the scheduler's keyword arguments are a JSON object "
                       "(e.g. '{\"num_cycles\": 2}'), or leave the option out")


def check_one_job(trainer_world: int) -> None:
    """Under torchrun the processes train as one job or not at all: a Trainer that did not join the launcher's
    process group would train each process alone, into one --output-dir."""
    launched = Dist().world  # the launcher's WORLD_SIZE
    if launched > 1 and trainer_world != launched:
        raise JobError(
            f"launched as {launched} processes (WORLD_SIZE={launched}), but the Trainer set up a job of "
            f"{trainer_world}: each process would train alone into one --output-dir; on CPU add --use-cpu, on GPUs "
            "give each process its own device (torchrun --nproc-per-node at most the GPU count)")


TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
                    "comet_ml": ("comet_ml",), "clearml": ("clearml",), "dvclive": ("dvclive",),
                    "trackio": ("trackio",), "swanlab": ("swanlab",), "neptune": ("neptune",)}


def check_trackers(trackers: list[str], given: str = "--report-to ") -> None:
    """A tracker whose package is missing is refused before verification and model load, with the install line
    (`given`: how the value was given, runtime.locations.named)."""
    import importlib.util

    for name in trackers:
        if name == "all":
            continue
        packages = TRACKER_PACKAGES.get(name)
        if packages is None:
            raise JobError(f"{given}{name}: unknown tracker; use one of {', '.join(TRACKER_PACKAGES)} or none")
        if not any(importlib.util.find_spec(p) for p in packages):
            extra = "pip install 'refcache[tensorboard]'" if name == "tensorboard" else f"pip install {packages[0]}"
            raise JobError(f"{given}{name}: the {packages[0]} package is not installed; install it with `{extra}`")


def training_options_error(cfg, e: ValueError) -> str:
    detail = " ".join(str(e).split())
    if (cfg.bf16 or cfg.fp16) and not cfg.use_cpu and not has_accelerator():
        flag = "--bf16" if cfg.bf16 else "--fp16"
        return f"{flag} needs a GPU here; to train on CPU add --use-cpu (bf16 autocast on CPU), or drop {flag}"
    return f"invalid training options: {detail}"


def latest_checkpoint(value: str | None, out: Path, given: str = "--resume-from-checkpoint ") -> str | None:
    """--resume-from-checkpoint true means the latest checkpoint-N in --output-dir, as in the Trainer."""
    if value is None or value.strip().lower() not in TRUE:
        return None if value is None or value.strip().lower() in ("false", "no", "0", "") else value
    from transformers.trainer_utils import get_last_checkpoint

    latest = get_last_checkpoint(str(out)) if out.is_dir() else None
    if latest is None:
        raise JobError(f"{given}{value.strip()}: no checkpoint-N folder in --output-dir {out}")
    return latest


def has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available()
