"""Part 15: precompute-ref under torchrun (2 ranks) on skewed lengths: shards dealt by their tokens (longest first, to
the least loaded rank: what precompute-ref does) against round-robin (what it did), the spread of the ranks' scoring
wall times; and the tokens/s of those 2 ranks against one process on the same machine.

The data is sorted by source, as real data often is: even shards hold long pairs, odd shards short ones, so
round-robin gives rank 0 every long shard. Each way runs as `torchrun --standalone --nproc-per-node 2` (gloo, one
thread per rank), round-robin over reps after a warm-up; the summary's per-rank scoring wall times (rank 0 gathers
them) are the figures. In the same rounds, one process without torchrun scores the same job, with one thread
(`one_process_1_thread`) and with as many threads as the machine has cores (`one_process_all_cores`: the whole
machine, as the 2 ranks use it): their tokens/s beside the 2 ranks' (dealt by tokens), over the job's wall and over
the scoring alone (the slowest rank's). All ways must write the same shards byte for byte.

    .venv/bin/python bench/bench_ranks.py [--quick]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics

import common
import measure

QUICK = dict(model="1M", long=256, short=32, shards=8, rows_per_shard=6, reps=2)
FULL = dict(model="5M", long=512, short=64, shards=8, rows_per_shard=8, reps=3)
GPU = FULL
WAYS = ("round_robin", "by_tokens")  # the 2-rank dealings
ONES = ("one_process_1_thread", "one_process_all_cores")  # the same job, one process


def round_robin(work, world):
    return [list(range(r, len(work), world)) for r in range(world)]


def child(args):
    """One torchrun rank: precompute-ref, the shards dealt `args.child`'s way; rank 0 prints the summary's figures."""
    import json
    import os

    from precompute import job

    if args.child == "round_robin":
        job.balanced_assignment = round_robin
    s = common.precompute(args.model, args.data, args.out, args.seq, rows_per_shard=args.rows_per_shard)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({"rank_wall_s": s["rank_wall_s"], "wall_s": s["wall_s"], "tokens": s["tokens"]}))


def skewed_rows(size: dict) -> list[dict]:
    vocab = common.MODELS[size["model"]]["vocab"]
    rows = []
    for s in range(size["shards"]):
        seq = size["long"] if s % 2 == 0 else size["short"]
        rows += common.synthetic_pairs(size["rows_per_shard"], seq, vocab, seed=100 + s)
    return [{**r, "id": f"p{i:05d}"} for i, r in enumerate(rows)]


def shard_tokens(out) -> list[int]:
    import polars as pl

    from schemas import format as fmt

    tokens = []
    for entry in fmt.read_manifest(out)["shards"]:
        df = pl.read_parquet(out / entry["file"], columns=["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"])
        n = df.select(pl.col("prompt_input_ids").list.len() * 2 + pl.col("chosen_input_ids").list.len()
                      + pl.col("rejected_input_ids").list.len()).to_series().sum()
        tokens.append(int(n))
    return tokens


def throughput(runs: dict, threads: dict) -> dict:
    """Tokens/s of the 2 ranks (dealt by tokens) and of one process (each of ONES), per round: over the job's wall time
    (start-up, planning, load and probe included) and over the scoring (the slowest rank's scoring wall); the ratios
    of the medians, 2 ranks over each 1-process way."""
    ways = (("two_ranks", "by_tokens", 2), *((one, one, 1) for one in ONES))
    out = {name: {"processes": processes, "threads": threads[way],
                  "job_tokens_per_s": measure.stats([r["tokens"] / r["wall_s"] for r in runs[way]]),
                  "scoring_tokens_per_s": measure.stats([r["tokens"] / max(r["rank_wall_s"]) for r in runs[way]])}
           for name, way, processes in ways}
    two = out["two_ranks"]
    return {"runs": out,
            "job_ratio": {one: measure.ratio(two["job_tokens_per_s"], out[one]["job_tokens_per_s"]) for one in ONES},
            "scoring_ratio": {one: measure.ratio(two["scoring_tokens_per_s"], out[one]["scoring_tokens_per_s"])
                              for one in ONES}}


def main():
    ap = common.child_parser(__doc__, (*WAYS, *ONES), ints=("seq", "rows-per-shard"))
    args = ap.parse_args()
    if args.child:
        return child(args)
    from precompute.job import balanced_assignment

    common.quiet()
    size = GPU if common.device().type == "cuda" else (QUICK if args.quick else FULL)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    with common.workdir("ranks") as work:
        model_dir = common.make_checkpoint(work, size["model"])
        data = common.write_jsonl(work / "data" / "train.jsonl", skewed_rows(size))

        def argv(way):
            out = work / f"cache-{way}"
            shutil.rmtree(out, ignore_errors=True)
            return [*([] if way in ONES else torchrun),
                    *common.child_argv(str(common.BENCH / "bench_ranks.py"), way, model=model_dir, data=data, out=out,
                                       seq=size["long"], rows_per_shard=size["rows_per_shard"])]

        cores = os.cpu_count() or 1
        threads = {w: 1 for w in WAYS} | {ONES[0]: 1, ONES[1]: cores}
        env = {w: {"OMP_NUM_THREADS": str(n)} for w, n in threads.items()}
        runs = {w: [] for w in (*WAYS, *ONES)}
        for i in range(size["reps"] + 1):  # round 0: the warm-up (file cache, imports)
            for way in (*WAYS, *ONES):
                got = common.run_child(argv(way), env=env[way])
                walls = got["rank_wall_s"]
                print(f"round {i} {way:<11} ranks {' / '.join(f'{w:.2f}' for w in walls)} s, spread "
                      f"{max(walls) - min(walls):.2f} s, job {got['wall_s']:.1f} s, "
                      f"{got['tokens'] / got['wall_s']:,.0f} tokens/s", flush=True)
                if i:
                    runs[way].append(got)
        hashes = {w: {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                      for p in sorted((work / f"cache-{w}").glob("*.parquet"))} for w in (*WAYS, *ONES)}
        assert all(hashes[w] == hashes["by_tokens"] for w in hashes), "the dealing changed the cache"
        tokens = shard_tokens(work / "cache-by_tokens")
    dealt = {"round_robin": round_robin(tokens, 2), "by_tokens": balanced_assignment(tokens, 2)}
    res = {"size": size, "shard_tokens": tokens, "same_cache": True, "ways": {}}
    for way in WAYS:
        spread = [max(r["rank_wall_s"]) - min(r["rank_wall_s"]) for r in runs[way]]
        slowest = [max(r["rank_wall_s"]) for r in runs[way]]
        res["ways"][way] = {
            "rank_tokens": [sum(tokens[i] for i in rank) for rank in dealt[way]],
            "rank_wall_s": [r["rank_wall_s"] for r in runs[way]],
            "spread_s": measure.stats(spread), "slowest_rank_s": measure.stats(slowest),
            "job_wall_s": measure.stats([r["wall_s"] for r in runs[way]]),
            "spread_share": statistics.median(s / m for s, m in zip(spread, slowest)),
        }
    res["slowest_rank_ratio"] = measure.ratio(res["ways"]["round_robin"]["slowest_rank_s"],
                                             res["ways"]["by_tokens"]["slowest_rank_s"])
    res["throughput"] = throughput(runs, threads)
    for way, r in res["ways"].items():
        print(f"{way:>11}: tokens per rank {r['rank_tokens']}, spread {common.fmt_s(r['spread_s'])} "
              f"({r['spread_share']:.0%} of the slowest rank), slowest rank {common.fmt_s(r['slowest_rank_s'])}, "
              f"job {common.fmt_s(r['job_wall_s'])}")
    print(f"slowest rank, round-robin over by tokens: x{res['slowest_rank_ratio']:.2f}; same cache every way")
    t = res["throughput"]
    for name, r in t["runs"].items():
        print(f"{name:>11} ({r['processes']} x {r['threads']} threads): {r['job_tokens_per_s']['median']:,.0f} tokens/s "
              f"over the job's wall, {r['scoring_tokens_per_s']['median']:,.0f} over the scoring")
    for one in ONES:
        print(f"2 ranks over {one}: x{t['job_ratio'][one]:.2f} (job wall), x{t['scoring_ratio'][one]:.2f} (scoring)")
    print(f"wrote {common.save('ranks', res, args)}")


if __name__ == "__main__":
    main()
