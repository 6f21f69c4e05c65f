"""precompute-ref: run the frozen reference once over preference pairs and write a stamped, resumable cache.

The work is planned before any model is loaded: rows are encoded, the stamps computed and the rows cut into
shards in input order. Each shard is scored in length-sorted batches formed inside that shard, so a resumed run
scores every shard exactly as an uninterrupted run would (bitwise on CPU float32).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from runtime.cli import heap_settled
from runtime.checkpoint import Checkpoint, preserved_rng, software_versions
from runtime.data import Encoded
from runtime.budget import DEFAULT_TOKEN_BUDGET, auto_budget
from runtime.distributed import Dist, balanced_assignment, distributed
from runtime.errors import JobError
from runtime.logprobs import verified_head
from runtime.placed import Placement, attention_of, attention_refused, flex_on_cpu, load_placed
from runtime.terminal import counted, echo
from runtime import placement
from schemas import format as fmt
from schemas import rules
from storage import writes
from schemas.card import write_card
from schemas.stamps import tokenizer_parts

from .compiled import AutoCompile, compile_choice, compiled_scorer, inductor_cache
from .config import PrecomputeConfig
from .modes import REGISTRY, choose_mode, effective_budget, score_known, to_score
from .prepare import Job, _check_top_k, _plan, _resume
from .resume import COMPUTATION, Resume
from . import update


# ---------------------------------------------------------------------------------------------------------------
# the job, in four steps: plan, resume (precompute/prepare.py), score, finish


def run_precompute(cfg: PrecomputeConfig, log=echo) -> dict:
    with preserved_rng(), distributed(cfg.tp_size) as dist:
        return _run(cfg, log, dist)


def _run(cfg: PrecomputeConfig, log, dist: Dist) -> dict:
    t0 = time.perf_counter()
    # torch.compile's caches under refcache's home unless the user placed them, set before anything of inductor runs
    # (it fills the variable in with its own default, /tmp/torchinductor_USER, when it first reads it)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache()))
    rank_log = log if dist.world > 1 else None  # every rank's own progress lines
    log = log if dist.rank == 0 else (lambda _m: None)
    job = _plan(cfg, log, dist)
    with contextlib.ExitStack() as lock:
        resume, change = dist.share(lambda: _resume(cfg, job, lock, log))  # rank 0 holds the lock for the whole job
        if change is not None:  # --update: only the new rows, into new shards
            job = update.applied(job, change)
        scored = _score(cfg, job, resume, log, dist, lock, rank_log)
        if dist.rank != 0:
            return {"rank": dist.rank, "shards_scored": scored["mine"]}
        entries = _finish(cfg, job, scored)
    return _summary(job, resume, scored, entries, time.perf_counter() - t0)


def shard_work(encoded: Encoded, shards: list[dict]) -> list[int]:
    """Tokens each shard runs through the model in the plain forward: [prompt | chosen] and [prompt | rejected] of
    every pair."""
    seqs = np.array([2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in encoded.pairs],
                    dtype=np.int64)
    return [int(seqs[s["start"] : s["stop"]].sum()) for s in shards]


def _score(cfg: PrecomputeConfig, job: Job, resume: Resume, log, dist: Dist, stack: contextlib.ExitStack,
           rank_log=None) -> dict:
    """Load the model (only when this rank has shards to score; under --tp-size on every rank), check the computation
    it actually gives against what the kept shards record, and score this rank's shards. Shards are dealt to ranks
    (under --tp-size to groups of ranks, which score theirs together) by their tokens (longest first, each to the
    least loaded) so that they finish together; each rank (group's first rank) writes its own, so the cache is the
    same whoever scores a shard."""
    todo = [s for s in job.plan if s["file"] not in resume.done]
    work = shard_work(job.encoded, todo)
    dealt = balanced_assignment(work, dist.groups)  # to tensor-parallel groups: every rank of one scores its shards
    mine = [todo[i] for i in dealt[dist.group]]
    stats = {"tokens": 0, "processed": 0, "slots": 0, "written": {}, "computation": None, "wall_s": 0.0}
    if todo:
        split = (f" (tensor parallel: {dist.groups} group{'s' if dist.groups > 1 else ''} of {dist.tp_size} ranks)"
                 if dist.tp_size > 1 else "")
        log(f"scoring {counted(sum(s['stop'] - s['start'] for s in todo), 'pair')} in {counted(len(todo), 'shard')} "
            f"({len(resume.done)} already done) on {dist.world} x {job.device.type}{split} in "
            f"{str(job.dtype).removeprefix('torch.')}" + (
                f"; tokens per {'group' if dist.tp_size > 1 else 'rank'}: "
                + ", ".join(f"{sum(work[i] for i in r):,}" for r in dealt) if dist.groups > 1 else ""))
    # Under tensor parallelism loading is collective (the device mesh spans every rank): all ranks load or none.
    loaded = _load(cfg, job, log, stack, dist) if mine or (todo and dist.tp_size > 1) else None
    heap_settled()  # the libraries, the encoded rows and the model: alive until the process ends
    if dist.tp_size > 1 and loaded:
        _same_in_each_group(loaded[1], dist)
    if cfg.token_budget == "auto":  # every rank scores with the same budget: the least any rank's memory allows
        notes = dist.gather(loaded[-1].note() if loaded else None)
        agreed = min((n for n in notes if n is not None), key=lambda n: n["tokens"], default=None)
        if agreed is not None:
            log(f"token budget: auto -> {agreed['tokens']} ({agreed['why']})")
    if loaded:
        model, computation, mode, pad_id, budget, probed, known, _sized = loaded
        if cfg.token_budget == "auto":
            computation = {**computation, "token_budget_resolved": agreed}  # a note (COMPUTATION_NOTES)
            budget = effective_budget(model, agreed["tokens"], _longest(job.encoded))
        if resume.computation is not None:  # compared after load, before any row is scored
            differs = rules.computation_findings(resume.computation, computation, where=str(job.out),
                                                  remedy=COMPUTATION)
            if job.change is not None:  # --update: new rows another mode scores exactly (fmt.MODE_KEYS) are fine
                differs = update.beyond_batching(differs, resume.computation, computation, log)
            if differs:
                raise JobError(f"{differs[0].message}; {differs[0].remedy}")
        auto = None if probed is None else AutoCompile(  # the batches to run: the pairs not known from the probe
            model, [(s["file"], to_score(job.encoded.pairs[s["start"] : s["stop"]], known, mode, cfg.top_k))
                    for s in mine], mode, budget, pad_id,
            cfg.top_k, probed, computation, (lambda m: rank_log(f"{dist.name()}: {m}")) if rank_log else log,
            job.device.type)
        stats = {**_score_shards(model, job.encoded, mine, job.out, job.stamps, cfg, pad_id, mode, computation,
                                 dist.rank == 0, budget, rank_log, dist, auto, known), "computation": computation}
    box = dist.gather(stats)[:: dist.tp_size]  # also the barrier before the manifest; one rank of each group
    made = [b["computation"] for b in box if b["computation"] is not None]
    stats = {**{k: sum(b[k] for b in box) for k in ("tokens", "processed", "slots")},
             "computation": (made[0] if made else None) or resume.computation,
             "written": {f: e for b in box for f, e in b["written"].items()},
             "rank_wall_s": [b["wall_s"] for b in box]}
    return {**stats, "mine": len(mine), "todo": todo, "tp_size": dist.tp_size}


def _same_in_each_group(computation: dict, dist: Dist) -> None:
    """The ranks of a tensor-parallel group must have chosen alike (mode, head, ...): they run every forward
    together. They do, from the same gathered numbers; a group that did not is refused on every rank."""
    chosen = dist.gather(computation)
    for g in range(dist.groups):
        ranks = chosen[g * dist.tp_size : (g + 1) * dist.tp_size]
        if any(c != ranks[0] for c in ranks):
            raise JobError(f"the ranks of tensor-parallel group {g} chose differently how to score ({ranks}); "
                           "run without --tp-size, or report this")


def _length(pair) -> int:
    """A pair's longest sequence: prompt + its longer completion."""
    return len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids))


def _longest(encoded: Encoded) -> int:
    """The job's longest prompt + completion."""
    return max(map(_length, encoded.pairs))


def _load(cfg: PrecomputeConfig, job: Job, log, stack: contextlib.ExitStack, dist: Dist):
    """The model, and how it scores: the batching mode (probed against the plain forward on the job's first shard and
    longest pair, not this rank's, so every rank and every resumed run agrees; with --device-map or --tp-size on the
    split model itself), the head path and the budget. `stack` holds the offload folder for as long as the job runs."""
    if cfg.tp_size > 1:
        model = load_model_for(cfg, job.dtype, None, job.checkpoint,
                               distributed_config=placement.distributed_config(cfg.tp_size, dist.world))
        layout = placement.tensor_parallel_layout(cfg.tp_size, dist.world)
        log(f"split by {placement.describe(layout)}")
    elif not job.placed.split:
        model, layout = load_model_for(cfg, job.dtype, job.device, job.checkpoint), None
    else:
        model, layout = _load_dispatched(cfg, job, log, stack)
    encoded, plan = job.encoded, job.plan
    pad = job.checkpoint.pad_id
    first = encoded.pairs[plan[0]["start"] : plan[0]["stop"]]
    longest_pair = max(encoded.pairs, key=_length)
    longest = _length(longest_pair)
    # auto: the mode is weighed at the default budget (the same on every rank and machine), the budget sized for it
    requested = DEFAULT_TOKEN_BUDGET if cfg.token_budget == "auto" else cfg.token_budget
    budget = effective_budget(model, requested, longest)
    _check_top_k(cfg.top_k, model.get_output_embeddings().weight.shape[0])  # the head itself decides
    notes = {}  # the truth's record, when the probe's longest sequence is scored in pieces (runtime/truth.py)
    probed = {}  # the probe's pairs and their truth: --torch-compile is checked against the same, not recomputed
    mode = choose_mode(model, job.batching or cfg.batching, first, longest, pad, budget, log, long_pairs=[longest_pair],
                       top_k=cfg.top_k, notes=notes, probed=probed)
    computation = {**job.claimed(cfg), "attn_implementation": model.config._attn_implementation, "mode": mode,
                   "head": verified_head(model), "batching": REGISTRY[mode].description,
                   **({"layout": layout} if layout else {}), **notes}  # notes, not compared on a rerun (COMPUTATION_NOTES)
    sized = auto_budget(model, mode, computation["head"], longest) if cfg.token_budget == "auto" else None
    if cfg.torch_compile is None and layout is None:  # auto: decided on this rank's first batches (AutoCompile)
        return model, computation, mode, pad, budget, probed, probed.get("scores"), sized
    compile_it, why = compile_choice(cfg.torch_compile, None, split=layout is not None)
    if cfg.torch_compile is not None:  # a note; a split model under auto records none, as before
        computation["compile_choice"] = why
    else:
        log(f"torch.compile {why}")
    if compile_it:  # a note too: compiled or not, the same numbers (proven by the probe) and the same cache
        model, computation["compiled"] = compiled_scorer(model, mode, probed["pairs"], pad, cfg.top_k, log, budget,
                                                         truth=probed["truth"])
    return model, computation, mode, pad, budget, None, probed.get("scores"), sized  # the probe's scores: kept


def _load_dispatched(cfg: PrecomputeConfig, job: Job, log, stack: contextlib.ExitStack):
    """The model split by accelerate's dispatch (--device-map), and its layout. Weights offloaded to disk go to a
    fresh folder of this job's own inside --offload-folder (or the system's temporary folder), removed at the end."""
    model, layout = load_placed(lambda **split: load_model_for(cfg, job.dtype, None, job.checkpoint, **split),
                                cfg.model, job.placed, stack)
    log(f"device map: {placement.describe(layout)}")
    return model, layout


def _finish(cfg: PrecomputeConfig, job: Job, scored: dict) -> list[dict]:
    """skipped.jsonl, then the manifest (its presence means the cache is complete), then the dataset card rendered
    from it (not part of the cache's identity: a cache without one is complete)."""
    out, encoded, tokenizer = job.out, job.encoded, job.checkpoint.tokenizer
    # Shards written now come with their entries; only those kept from an earlier run are hashed here.
    entries = [scored["written"].get(s["file"]) or fmt.shard_entry(out / s["file"], s["stop"] - s["start"],
                                                                    s["mask_checksum"], s["ids_checksum"])
               for s in job.plan]
    if job.change is None or not job.change.nothing:  # a no-op update keeps the cache as it is, skipped.jsonl too
        _write_skipped(out, encoded)
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "stamps": job.stamps,
        "encoding": cfg.encoding.to_dict(),
        # where the model and data came from (a hub id beside its snapshot path): not part of the cache's content
        "model": {"name": job.origins["model"].get("hub_id") or Path(cfg.model).resolve().name}
        | job.origins["model"] | ({"adapter": str(cfg.adapter)} if cfg.adapter else {}),
        "tokenizer": {"class": type(tokenizer).__name__, "size": len(tokenizer), "parts": tokenizer_parts(tokenizer)},
        "computation": scored["computation"],  # what scored the rows (the recorded one when nothing was left)
        "software": software_versions(),
        "source": {
            "data": job.origins["data"]["path"],
            **{k: v for k, v in job.origins["data"].items() if k != "path"},  # hub_id, revision
            "split": cfg.split,
            **({"config": job.source.config} if job.source.config is not None else {}),  # the card's config
            "files": job.source.files,
            "fingerprint": job.source.fingerprint,
            "rows_in": len(job.source.rows),
            "skipped": len(encoded.skipped),
            "skipped_by_reason": encoded.skipped_by_reason,
            "identical_pairs": encoded.identical,
            "formats": dict(sorted(encoded.formats.items())),
        },
        "rows": len(encoded.pairs),
        "shards": entries,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if job.change is not None:  # --update: the new version (precompute/update.py)
        manifest, entries = update.versioned(out, manifest, entries, job, cfg)
    if not _says_the_same(out, manifest):
        fmt.write_manifest(out, manifest)
    write_card(out, fmt.read_manifest(out))  # the card of the manifest that stays (kept or just written)
    return entries


def _says_the_same(out: Path, manifest: dict) -> bool:
    """The manifest already in `out` says all that `manifest` would, apart from when, with which software and from
    which paths (or hub ids) the cache was made: it is kept as it is (a no-op rerun, or one from another directory, changes no
    file). A run names a cache by its content (schemas.run_manifest.cache_id), so a rewritten one is the same cache
    too; keeping it also keeps runs that pinned the manifest's bytes resumable."""
    if not (out / fmt.MANIFEST).is_file():
        return False
    try:
        there = fmt.read_manifest(out)
    except fmt.CacheError:
        return False

    def content(m: dict) -> dict:
        kept = {k: v for k, v in m.items() if k not in ("created_at", "software", "model")}
        kept["source"] = {k: v for k, v in (m.get("source") or {}).items()
                          if k not in ("data", "files", "hub_id", "revision", "config")}
        return kept

    return content(there) == content(json.loads(json.dumps(manifest)))


def _summary(job: Job, resume: Resume, scored: dict, entries: list[dict], wall: float) -> dict:
    encoded = job.encoded
    size = sum(e["bytes"] for e in entries)
    completion_tokens = sum(len(p.chosen_ids) + len(p.rejected_ids) for p in encoded.pairs)
    versioned = {"update": update.summary(job.change)} if job.change is not None else {}
    return {
        **versioned,
        "out": str(job.out.resolve()),
        "rows": sum(e["rows"] for e in entries),
        "rows_scored": sum(s["stop"] - s["start"] for s in scored["todo"]),
        "skipped": len(encoded.skipped),
        "skipped_by_reason": encoded.skipped_by_reason,
        "identical_pairs": encoded.identical,
        "shards": len(entries),
        "tokens": scored["tokens"],
        "padding_fraction": 1 - scored["processed"] / scored["slots"] if scored["slots"] else 0.0,
        "mode": scored["computation"]["mode"],
        "top_k": scored["computation"].get("top_k") or 0,
        "wall_s": wall,
        "tokens_per_s": scored["tokens"] / wall if wall else 0.0,
        "rank_wall_s": scored["rank_wall_s"],  # each rank's (group's) scoring wall time (torchrun: spread = max - min)
        "tp_size": scored["tp_size"],
        "bytes": size,
        # (an update knows the tokens of the rows it scored only)
        "bytes_per_completion_token": size / completion_tokens if completion_tokens and not versioned else None,
    }


def load_model_for(cfg: PrecomputeConfig, dtype, device, checkpoint: Checkpoint | None = None, **placed):
    """The reference model of `checkpoint` (opened from cfg when None) with the requested attention implementation
    (None: transformers' choice); one that cannot use it is refused naming those it can. `placed`: a split's
    from_pretrained options (runtime/placed.py load_placed), or distributed_config (--tp-size); device None then."""
    checkpoint = checkpoint or Checkpoint.open(cfg.model, cfg.trust_remote_code, cfg.adapter)
    attn = attention_of(cfg)
    if not placed:  # a split or tensor-parallel load places the model itself (on CUDA devices where it can)
        flex_on_cpu(cfg.model, attn, device)
    try:
        return checkpoint.load_model(dtype, device, attn, **placed)
    except (ImportError, ValueError) as e:  # an implementation the model or this install does not have
        detail = " ".join(str(e).split())[:300]
        if "distributed_config" in placed and attn is None:
            raise JobError(f"{cfg.model}: transformers cannot split the model with --tp-size {cfg.tp_size} "
                           f"({detail}); pick a --tp-size that divides its attention heads, or use --device-map "
                           "auto") from None
        if placed and attn is None:  # then only the split can be what from_pretrained refused
            raise Placement.of(cfg).cannot_split(cfg.model, e) from None
        raise attention_refused(cfg.model, cfg.attn_implementation, checkpoint, e) from None


def _score_shards(model, encoded, todo, out, stamps, cfg, pad_id, mode, computation, show_progress: bool,
                  budget: int, rank_log=None, dist: Dist | None = None, auto: AutoCompile | None = None,
                  known: dict | None = None) -> dict:
    """Score `todo`'s shards and write them; `rank_log` (under torchrun): this rank's line after each shard. `auto`
    (--torch-compile auto): told of each batch, it may switch the model to the compiled one between batches;
    `known`: the probe's values of the job's pairs it scored whole, kept, not scored again (modes.score_known)."""
    from tqdm.auto import tqdm

    total = {"tokens": 0, "processed": 0, "slots": 0, "written": {}}
    t0 = time.perf_counter()
    bar = tqdm(total=sum(s["stop"] - s["start"] for s in todo), unit="pair", disable=not (cfg.progress and show_progress),
               file=sys.stderr)

    def tick(pairs, tokens, reused=False):  # whole pairs (score_pairs); reused: the probe's, no batch was run
        if auto is not None and not reused:
            auto.after_batch()
        total["live"] = total.get("live", 0) + tokens
        bar.update(pairs)
        bar.set_postfix_str(f"{total['live'] / (time.perf_counter() - t0):,.0f} tok/s", refresh=False)

    done = 0
    for n, shard in enumerate(todo, 1):
        pairs = encoded.pairs[shard["start"] : shard["stop"]]
        if auto is not None:
            auto.begin(shard["file"])
        chosen, rejected, stats = score_known(auto.current if auto else model, pairs, pad_id, budget, mode, tick,
                                              top_k=cfg.top_k, known=known)
        if dist is not None and not dist.leads:  # a tensor-parallel group's other ranks: same forwards, no file
            continue
        table = fmt.shard_table(
            encoded.ids[shard["start"] : shard["stop"]],
            [p.prompt_ids for p in pairs], [p.chosen_ids for p in pairs], [p.rejected_ids for p in pairs],
            chosen, rejected, top_k=cfg.top_k,
        )
        total["written"][shard["file"]] = fmt.write_shard(
            out / shard["file"], table, model_hash=stamps["model_hash"], tokenizer_hash=stamps["tokenizer_hash"],
            encoding=cfg.encoding, computation=computation)
        for key in stats:
            total[key] += stats[key]
        done += len(pairs)
        if rank_log is not None:
            seconds = time.perf_counter() - t0
            with tqdm.external_write_mode(file=sys.stderr):  # around rank 0's bar
                rank_log(f"{dist.name()}: shard {n}/{len(todo)} ({shard['file']}) done, "
                         f"{done / seconds:,.1f} pairs/s, {total['tokens'] / seconds:,.0f} tokens/s")
    bar.close()
    if auto is not None:
        auto.finish()
    total["wall_s"] = time.perf_counter() - t0
    return total


def _write_skipped(out: Path, encoded: Encoded) -> None:
    path = out / fmt.SKIPPED
    if not encoded.skipped:
        writes.remove(path)
        return
    data = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in encoded.skipped).encode("utf-8")
    fmt.write_whole(path, lambda f: f.write(data))
