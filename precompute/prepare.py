"""What precompute-ref decides before any model is loaded: the data read and encoded, the stamps computed and the
rows cut into shards (the Job), the placement options checked, then --out taken (locked, cleared with --overwrite)
and what an earlier run left there judged for resuming or --update."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.checkpoint import Checkpoint, resolve_device, resolve_dtype
from runtime.data import Encoded, load_rows, recorded_config, usable_rows
from runtime.data_files import split_of_file
from runtime.distributed import Dist
from runtime import locks
from runtime.errors import JobError
from runtime.locations import named
from runtime.placed import Placement, check_flex_here
from runtime import placement
from schemas import format as fmt
from schemas.stamps import combined_mask_checksum, tokenizer_hash

from .config import PrecomputeConfig, _given, cache_settings, checked_inputs
from .plan import plan_shards
from .resume import Resume, clear_cache_dir, finished_shards, own_files
from . import update


@dataclass
class Job:
    """Everything decided before the model is loaded."""

    out: Path
    checkpoint: Checkpoint  # its tokenizer encoded the rows
    source: object
    encoded: Encoded
    stamps: dict
    plan: list[dict]
    device: torch.device
    dtype: torch.dtype
    origins: dict = field(default_factory=dict)  # {"model", "data"}: runtime.hub.origin, hub ids beside the paths
    placed: Placement | None = None  # --device-map, --max-memory, --offload-folder (runtime/placed.py)
    change: object = None  # --update: what the update does (precompute/update.py Change)
    batching: str | None = None  # --update: the batching mode that scored the cache, asked for by name

    def claimed(self, cfg: PrecomputeConfig) -> dict:
        """The computation values known before loading: what a resume compares first."""
        # The requested attention and batching are recorded beside what they resolved to (known after loading), so
        # a rerun with other options is refused before loading, even where they would resolve the same way.
        return {"dtype": str(self.dtype).removeprefix("torch."), "device_type": self.device.type,
                "token_budget": cfg.token_budget, "rows_per_shard": cfg.rows_per_shard,
                "requested_attn_implementation": cfg.attn_implementation, "requested_batching": cfg.batching,
                **({"top_k": cfg.top_k} if cfg.top_k else {})}  # a cache without top-k records none (format.py)


def _plan(cfg: PrecomputeConfig, log, dist: Dist) -> Job:
    """Read and encode the data, compute the stamps and cut the rows into shards; nothing is written yet."""
    whose, taken = cache_settings(cfg)  # what --out's rows were scored with, for the options not given
    if taken:
        log(f"{'--update' if cfg.update else 'resume'}: {whose} settings: "
            + ", ".join(f"{k} {v}" for k, v in taken.items()))
    out, origins, inputs = checked_inputs(cfg)
    split = cfg.device_map is not None or cfg.tp_size > 1  # placed by the split itself
    check_flex_here(cfg, None if split else cfg.device)  # before the tokenizer, the data and the model
    # one file is the one split its name says: recorded as read; a --split naming another is refused
    cfg.split = split_of_file(cfg.data, cfg.split, _given(cfg, cfg, "split", "train"),
                              named(cfg, "split"), named(cfg, "data"))
    cfg.model = origins["model"]["path"]  # a hub id in the local Hugging Face cache -> its snapshot folder
    checkpoint = Checkpoint.open(cfg.model, cfg.trust_remote_code, cfg.adapter)
    _check_top_k(cfg.top_k, (checkpoint.config.get("text_config") or {}).get("vocab_size")
                 or checkpoint.config.get("vocab_size"))  # from config.json: before anything is made in --out
    if dist.rank == 0:  # the one rank that hashes it (stamps below): while the tokenizer loads and the rows encode
        checkpoint.start_hashing()
    placed = _placement(cfg, inputs, dist)
    if cfg.tp_size > 1:  # an architecture transformers cannot split is refused before any weight is read
        _check_tp_plan(cfg, checkpoint)
    device = placed.main_device(resolve_device(cfg.device))  # a bad --device is refused before any work
    tokenizer = checkpoint.tokenizer
    source = load_rows(cfg.data, cfg.split, _data_config(cfg, out))
    encoded = usable_rows(source, tokenizer, cfg.encoding, cfg.on_bad_row, cfg.data)
    if encoded.skipped:
        log(f"skipped {len(encoded.skipped)} bad rows: {encoded.skipped_by_reason} (listed in {out / fmt.SKIPPED})")
    if encoded.identical:
        log(f"warning: {encoded.identical} pairs have identical chosen and rejected completions")
    stamps = {
        "model_hash": dist.share(lambda: checkpoint.model_hash),  # once, not once per rank
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "mask_checksum": combined_mask_checksum([p.mask_checksum for p in encoded.pairs], cfg.encoding.to_json()),
    }
    plan = plan_shards(encoded, cfg.rows_per_shard, cfg.encoding)
    return Job(out, checkpoint, source, encoded, stamps, plan, device, resolve_dtype(cfg.dtype, device), origins,
               placed)


def _check_top_k(top_k: int, vocab) -> None:
    if isinstance(vocab, int) and not isinstance(vocab, bool) and top_k > vocab:
        raise JobError(f"--top-k {top_k} is more than the model's vocabulary of {vocab} tokens; pass at most "
                       f"{vocab} (--top-k {vocab} stores the whole distribution)")


def _data_config(cfg: PrecomputeConfig, out) -> str | None:
    """--data-config, else for --update the card config the cache's rows were read with (as train-dpo reads it)."""
    if cfg.data_config is not None or not cfg.update or not (out / fmt.MANIFEST).is_file():
        return cfg.data_config
    try:
        return recorded_config(cfg.data, fmt.read_manifest(out))
    except fmt.CacheError:  # an unreadable cache: --update refuses it, naming why
        return None


def _placement(cfg: PrecomputeConfig, inputs: dict, dist: Dist) -> Placement:
    """The placement options and --tp-size checked (the offload folder is an output: apart from every input and from
    --out)."""
    placed = Placement.of(cfg)
    placement.check_tensor_parallel(cfg.tp_size, dist.world, cfg.device, placed.device_map, cfg.adapter,
                                    cfg.torch_compile)
    placed.check(cfg.device, dist.world, cfg.adapter)
    placed.check_apart({**inputs, "--out": cfg.out})
    return placed


def _check_tp_plan(cfg: PrecomputeConfig, checkpoint: Checkpoint) -> None:
    """--tp-size on an architecture without a tensor-parallel plan, or heads it cannot share out evenly: refused
    naming it, from its config alone, before any weight is read."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(checkpoint.path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise JobError(f"{cfg.model}: its config.json cannot be read ({' '.join(str(e).split())[:300]})") from None
    refused = placement.tensor_parallel_refusal(config, cfg.tp_size)
    if refused:
        raise JobError(f"--tp-size {cfg.tp_size}: {refused}, so it cannot be split that way; use --device-map auto "
                       "(one process, the model split across its devices, then CPU and disk), a --tp-size that "
                       "divides its heads, or leave --tp-size out")


def _resume(cfg: PrecomputeConfig, job: Job, lock: contextlib.ExitStack, log) -> Resume:
    """Take the directory (lock; --overwrite clears it) and judge what an earlier run left there. A folder holding
    anything but a cache's own files is refused before the lock file is made in it, and again under the lock; so is
    an --update of a folder holding no finished cache. A refusal under the lock takes back the folder and lock file
    it made (runtime.locks.exclusive)."""
    if cfg.update:
        update.check_finished(job.out, named(cfg, "out"))
    if job.out.is_dir():
        own_files(job.out)
    try:
        lock.enter_context(locks.exclusive(job.out, "precompute-ref", "--out"))  # one writer per cache
    except OSError as e:
        raise JobError(f"--out {job.out}: cannot write the cache directory there ({e.strerror or e})") from None
    if cfg.overwrite:
        clear_cache_dir(job.out)
    change = None
    if cfg.update:
        resume, change = update.prepare(job.out, job, cfg, job.claimed(cfg), log)
    else:
        resume = finished_shards(job.out, job.plan, job.stamps, cfg.encoding, job.claimed(cfg))
    for name, reason in resume.rescore:
        log(f"{name} is damaged ({reason}); scoring it again")
    return resume, change
