"""precompute-ref: run the frozen reference once over preference pairs and write a stamped, resumable cache.

The work is planned before any model is loaded: rows are encoded, the stamps computed and the rows cut into
shards in input order. Each shard is scored in length-sorted batches formed inside that shard, so a resumed run
scores every shard exactly as an uninterrupted run would (bitwise on CPU float32).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.checkpoint import (  # noqa: F401  (re-exported: part of this module's API)
    attention_choices, check_checkpoint, load_model, load_tokenizer, preserved_rng, resolve_device, resolve_dtype, software_versions)
from runtime.data import Encoded, encode_rows, load_rows
from runtime.distributed import Dist, distributed
from runtime.errors import JobError
from runtime.head import verified_head
from schemas import format as fmt
from schemas.encoding import EncodingConfig
from schemas.stamps import combined_mask_checksum, model_hash, tokenizer_hash

from .modes import DESCRIPTIONS, choose_mode, effective_budget, score_pairs  # noqa: F401  (score_pairs: API)


@dataclass
class PrecomputeConfig:
    model: str
    data: str
    out: str = "ref-cache"
    split: str = "train"
    encoding: EncodingConfig = field(default_factory=EncodingConfig)
    token_budget: int = 16384  # padded tokens per forward batch
    rows_per_shard: int = 2048
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 elsewhere
    device: str = "auto"
    attn_implementation: str = "auto"  # auto: what transformers picks for the model
    batching: str = "auto"  # auto or one of modes.MODES
    overwrite: bool = False
    on_bad_row: str = "error"
    trust_remote_code: bool = False
    progress: bool = True


# ---------------------------------------------------------------------------------------------------------------
# the cache directory


@contextlib.contextmanager
def exclusive(out: Path):
    """One writer per cache directory; the OS drops the lock if the process dies."""
    lock_path = out / fmt.LOCK
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise JobError(
                f"{out} is being written by another precompute-ref process (pid {f.read().strip() or '?'}); wait for "
                "it to finish or choose another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield


def clear_cache_dir(out: Path) -> None:
    (out / fmt.MANIFEST).unlink(missing_ok=True)  # first: from here on the directory reads as incomplete
    for p in list(out.glob("*.parquet")) + [out / fmt.SKIPPED]:
        p.unlink(missing_ok=True)


def finished_shards(out: Path, plan: list[dict], stamps: dict, encoding: EncodingConfig) -> set[str]:
    """Shards already written by an earlier run of this same job; refuse anything from a different job."""
    for tmp in out.glob(".*.tmp-*"):
        tmp.unlink()
    refuse = f"{out} already holds a different cache; use --overwrite to replace it, or choose another --out"
    if (out / fmt.MANIFEST).exists():
        try:
            manifest = fmt.read_manifest(out)
        except fmt.CacheError as e:
            raise JobError(f"{out} holds an unreadable cache ({e.message}); use --overwrite to replace it") from None
        for key in fmt.STAMPS:
            if manifest["stamps"][key] != stamps[key]:
                raise JobError(f"{refuse}\n  {key}: existing {manifest['stamps'][key]}, this job {stamps[key]}")
        if manifest["encoding"] != encoding.to_dict():
            raise JobError(f"{refuse}\n  encoding: existing {manifest['encoding']}, this job {encoding.to_dict()}")
    planned = {s["file"]: s for s in plan}
    done = set()
    for path in sorted(out.glob("*.parquet")):
        want = planned.get(path.name)
        try:
            meta = fmt.read_shard_metadata(path)
        except Exception:
            meta = None
        if meta is None or want is None:
            raise JobError(f"{refuse}\n  {path.name} is not a shard of this job (other data or --rows-per-shard?)")
        for key, value in (("model_hash", stamps["model_hash"]), ("tokenizer_hash", stamps["tokenizer_hash"]),
                           ("mask_checksum", want["mask_checksum"]), ("encoding", encoding.to_json())):
            if meta.get(key) != value:
                raise JobError(f"{refuse}\n  {path.name}: {key} is {meta.get(key)}, this job has {value}")
        done.add(path.name)
    return done


# ---------------------------------------------------------------------------------------------------------------
# the job


def plan_shards(encoded: Encoded, rows_per_shard: int, encoding: EncodingConfig) -> list[dict]:
    checks = [p.mask_checksum for p in encoded.pairs]
    plan = []
    for n, start in enumerate(range(0, len(checks), rows_per_shard)):
        stop = min(start + rows_per_shard, len(checks))
        plan.append({"file": f"shard-{n:05d}.parquet", "start": start, "stop": stop,
                     "mask_checksum": combined_mask_checksum(checks[start:stop], encoding.to_json())})
    return plan


def run_precompute(cfg: PrecomputeConfig, log=print) -> dict:
    with preserved_rng(), distributed() as dist:
        return _run(cfg, log, dist)


def _run(cfg: PrecomputeConfig, log, dist: Dist) -> dict:
    t0 = time.perf_counter()
    out = Path(cfg.out)
    log = log if dist.rank == 0 else (lambda _m: None)
    check_checkpoint(cfg.model, cfg.trust_remote_code)
    resolve_device(cfg.device)  # a bad --device is refused before any work
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    source = load_rows(cfg.data, cfg.split)
    encoded = encode_rows(source, tokenizer, cfg.encoding, cfg.on_bad_row)
    if not encoded.pairs:
        raise JobError(f"{cfg.data}: no usable rows ({len(encoded.skipped)} skipped: {encoded.skipped_by_reason})")
    if encoded.skipped:
        log(f"skipped {len(encoded.skipped)} bad rows: {encoded.skipped_by_reason} (listed in {out / fmt.SKIPPED})")
    if encoded.identical:
        log(f"warning: {encoded.identical} pairs have identical chosen and rejected completions")
    stamps = {
        "model_hash": dist.share(lambda: model_hash(cfg.model)),  # hashed once, not once per rank
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "mask_checksum": combined_mask_checksum([p.mask_checksum for p in encoded.pairs], cfg.encoding.to_json()),
    }
    plan = plan_shards(encoded, cfg.rows_per_shard, cfg.encoding)
    lock = contextlib.ExitStack()
    with lock:
        def prepare():
            try:
                out.mkdir(parents=True, exist_ok=True)
                lock.enter_context(exclusive(out))  # rank 0 holds the lock for the whole job
            except OSError as e:
                raise JobError(f"--out {out}: cannot write the cache directory there ({e.strerror or e})") from None
            if cfg.overwrite:
                clear_cache_dir(out)
            return finished_shards(out, plan, stamps, cfg.encoding)

        done = dist.share(prepare)
        todo = [s for s in plan if s["file"] not in done]
        mine = todo[dist.rank :: dist.world]  # shards go round-robin to ranks; each rank writes its own
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        stats = {"tokens": 0, "processed": 0, "slots": 0, "mode": None, "head": None, "attn": None, "written": {}}
        if mine:
            log(f"scoring {sum(s['stop'] - s['start'] for s in todo)} pairs in {len(todo)} shards "
                f"({len(done)} already done) on {dist.world} x {device.type} in {str(dtype).removeprefix('torch.')}")
            model = load_model_for(cfg, dtype, device)
            attn = model.config._attn_implementation
            pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            # Decided on the job's first shard and longest pairs (not this rank's), so every rank and every resumed
            # run agrees.
            first = encoded.pairs[plan[0]["start"] : plan[0]["stop"]]
            seq = lambda p: len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))  # noqa: E731
            longest_pair = max(encoded.pairs, key=seq)
            longest = seq(longest_pair)
            budget = effective_budget(model, cfg.token_budget, longest)
            mode = choose_mode(model, cfg.batching, first, longest, pad_id, budget, log, long_pairs=[longest_pair])
            head = verified_head(model)
            stats = {**_score_shards(model, encoded, mine, out, stamps, cfg, pad_id, mode, dist.rank == 0, budget),
                     "mode": mode, "head": head, "attn": attn}
        if dist.world > 1:
            box = [None] * dist.world
            torch.distributed.all_gather_object(box, stats)  # also the barrier before the manifest
            scored = [b for b in box if b["mode"]] or [stats]  # every rank that scored chose the same way
            stats = {**{k: sum(b[k] for b in box) for k in ("tokens", "processed", "slots")},
                     **{k: scored[0][k] for k in ("mode", "head", "attn")},
                     "written": {f: e for b in box for f, e in b["written"].items()}}
        if dist.rank != 0:
            return {"rank": dist.rank, "shards_scored": len(mine)}
        if stats["mode"] is None and (out / fmt.MANIFEST).exists():  # nothing left to score: as the earlier run did
            prior = fmt.read_manifest(out).get("computation") or {}
            stats.update(mode=prior.get("mode"), head=prior.get("head"), attn=prior.get("attn_implementation"))
        # Shards written now come with their entries; only those kept from an earlier run are hashed here.
        entries = [stats["written"].get(s["file"]) or fmt.shard_entry(out / s["file"], s["stop"] - s["start"],
                                                                       s["mask_checksum"]) for s in plan]
        _write_skipped(out, encoded)
        wall = time.perf_counter() - t0
        manifest = {
            "format_version": fmt.FORMAT_VERSION,
            "stamps": stamps,
            "encoding": cfg.encoding.to_dict(),
            "model": {"name": Path(cfg.model).resolve().name, "path": str(cfg.model)},
            "tokenizer": {"class": type(tokenizer).__name__, "size": len(tokenizer)},
            "computation": {
                "mode": stats["mode"],
                "head": stats["head"],
                "dtype": str(dtype).removeprefix("torch."),
                "device_type": device.type,
                "attn_implementation": stats["attn"],
                "token_budget": cfg.token_budget,
                "rows_per_shard": cfg.rows_per_shard,
                "batching": DESCRIPTIONS.get(stats["mode"], stats["mode"]),
            },
            "software": software_versions(),
            "source": {
                "data": str(cfg.data),
                "split": cfg.split,
                "files": source.files,
                "fingerprint": source.fingerprint,
                "rows_in": len(source.rows),
                "skipped": len(encoded.skipped),
                "skipped_by_reason": encoded.skipped_by_reason,
                "identical_pairs": encoded.identical,
            },
            "rows": len(encoded.pairs),
            "shards": entries,
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        fmt.write_manifest(out, manifest)
    size = sum(e["bytes"] for e in entries)
    completion_tokens = sum(len(p.chosen_ids) + len(p.rejected_ids) for p in encoded.pairs)
    return {
        "out": str(out.resolve()),
        "rows": len(encoded.pairs),
        "rows_scored": sum(s["stop"] - s["start"] for s in plan if s["file"] not in done),
        "skipped": len(encoded.skipped),
        "skipped_by_reason": encoded.skipped_by_reason,
        "identical_pairs": encoded.identical,
        "shards": len(entries),
        "tokens": stats["tokens"],
        "padding_fraction": 1 - stats["processed"] / stats["slots"] if stats["slots"] else 0.0,
        "mode": stats["mode"],
        "wall_s": wall,
        "tokens_per_s": stats["tokens"] / wall if wall else 0.0,
        "bytes": size,
        "bytes_per_completion_token": size / completion_tokens,
    }


def load_model_for(cfg: PrecomputeConfig, dtype, device):
    """The reference model with the requested attention implementation (None: transformers' choice); one that
    cannot use it is refused naming those it can."""
    attn = None if cfg.attn_implementation in (None, "auto") else cfg.attn_implementation
    try:
        return load_model(cfg.model, dtype, device, attn, cfg.trust_remote_code)
    except (ImportError, ValueError) as e:  # an implementation the model or this install does not have
        detail = " ".join(str(e).split())[:300]
        raise JobError(f"{cfg.model}: the model cannot be loaded with --attn-implementation {cfg.attn_implementation} "
                       f"({detail}); it supports: {', '.join(attention_choices(cfg.model, cfg.trust_remote_code))}, "
                       "or leave --attn-implementation at auto") from None


def _score_shards(model, encoded, todo, out, stamps, cfg, pad_id, mode, show_progress: bool, budget: int) -> dict:
    from tqdm.auto import tqdm

    total = {"tokens": 0, "processed": 0, "slots": 0, "written": {}}
    t0 = time.perf_counter()
    bar = tqdm(total=sum(s["stop"] - s["start"] for s in todo), unit="row", disable=not (cfg.progress and show_progress),
               file=sys.stderr)

    def tick(rows, tokens):
        total["live"] = total.get("live", 0) + tokens
        bar.update(rows)
        bar.set_postfix_str(f"{total['live'] / (time.perf_counter() - t0):,.0f} tok/s", refresh=False)

    for shard in todo:
        pairs = encoded.pairs[shard["start"] : shard["stop"]]
        chosen, rejected, stats = score_pairs(model, pairs, pad_id, budget, mode, tick)
        table = fmt.shard_table(
            encoded.ids[shard["start"] : shard["stop"]],
            [p.prompt_ids for p in pairs], [p.chosen_ids for p in pairs], [p.rejected_ids for p in pairs],
            chosen, rejected,
        )
        total["written"][shard["file"]] = fmt.write_shard(
            out / shard["file"], table, model_hash=stamps["model_hash"], tokenizer_hash=stamps["tokenizer_hash"],
            encoding=cfg.encoding)
        for key in stats:
            total[key] += stats[key]
    bar.close()
    return total


def _write_skipped(out: Path, encoded: Encoded) -> None:
    path = out / fmt.SKIPPED
    if not encoded.skipped:
        path.unlink(missing_ok=True)
        return
    data = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in encoded.skipped).encode("utf-8")
    fmt.atomic_write(path, lambda f: f.write(data))
