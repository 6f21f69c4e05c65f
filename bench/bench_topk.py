"""precompute-ref --top-k: cache bytes per completion token at K = 0, 8, 32, 128, and precompute time at K = 32 vs 0.

Sizes (deterministic, one run per case) on data/ (a trained model: real next-token distributions) and on synthetic
pairs under an untrained 1M model with a 32k vocabulary (near-uniform ids: the pessimistic case for their dictionary
encoding). Time on data/, K = 0 and 32 round-robin: the whole run, the scoring plus shard writing alone, and the whole
run's CPU seconds on one torch thread.

    .venv/bin/python bench/bench_topk.py [--quick]
"""

from __future__ import annotations

import shutil
import time

import common
import measure

KS = (0, 8, 32, 128)


def run(model, data, out, k: int, batching: str = "full_forward") -> dict:
    from precompute.job import PrecomputeConfig, run_precompute

    shutil.rmtree(out, ignore_errors=True)
    return run_precompute(PrecomputeConfig(model=str(model), data=str(data), out=str(out), top_k=k,
                                           batching=batching, progress=False), log=lambda _m: None)


def sizes(model, data, work, name: str) -> dict:
    rows = {}
    for k in KS:
        out = work / f"{name}-k{k}"
        s = run(model, data, out, k)
        cols = common.column_bytes(out)
        tokens = s["bytes"] / s["bytes_per_completion_token"]
        rows[k] = {"bytes": s["bytes"], "bytes_per_completion_token": round(s["bytes_per_completion_token"], 1),
                   "per_column_per_token": {c: round(b / tokens, 2) for c, b in cols.items()
                                            if any(t in c for t in ("top_ids", "top_logps", "tail"))}}
        print(f"{name} K={k}: {s['bytes_per_completion_token']:.1f} B per completion token")
    return rows


def timing(model_dir, data, work, reps: int) -> dict:
    from precompute.job import Checkpoint
    from precompute.modes import score_pairs
    from runtime.data import load_rows, usable_rows
    from schemas import format as fmt
    from schemas.encoding import EncodingConfig

    whole = measure.interleaved({k: (lambda k=k: run(model_dir, data, work / f"time-k{k}", k)) for k in (0, 32)},
                               reps=reps, warmup=1)
    whole_cpu = {}  # CPU seconds on one torch thread: a figure other processes on a shared machine barely move
    with measure.threads(1):
        measure.interleaved({k: (lambda k=k: run(model_dir, data, work / f"time-k{k}", k)) for k in (0, 32)},
                            reps=reps, warmup=1, cpu=whole_cpu)
    checkpoint = Checkpoint.open(str(model_dir), False, None)
    model = checkpoint.load_model(common.torch.float32, common.torch.device("cpu"), None)
    encoded = usable_rows(load_rows(str(data), "train"), checkpoint.tokenizer, EncodingConfig(), "error", str(data))
    pairs = encoded.pairs

    def score_and_write(k):
        chosen, rejected, _ = score_pairs(model, pairs, checkpoint.pad_id, 16384, "full_forward", top_k=k)
        table = fmt.shard_table(encoded.ids, [p.prompt_ids for p in pairs], [p.chosen_ids for p in pairs],
                                [p.rejected_ids for p in pairs], chosen, rejected, top_k=k)
        t = time.perf_counter()
        fmt.write_shard(work / f"shard-k{k}.parquet", table, model_hash="x", tokenizer_hash="y",
                        encoding=EncodingConfig(), computation={"top_k": k} if k else {})
        return time.perf_counter() - t

    score = measure.interleaved({k: (lambda k=k: score_and_write(k)) for k in (0, 32)}, reps=reps, warmup=1)
    write = {k: score_and_write(k) for k in (0, 32)}
    return {"run_s": whole, "run_ratio_k32_over_k0": measure.ratio(whole[32], whole[0]),
            "run_cpu_s_one_thread": whole_cpu,
            "run_cpu_ratio_k32_over_k0": measure.ratio(whole_cpu[32], whole_cpu[0]),
            "score_and_write_s": score, "score_ratio_k32_over_k0": measure.ratio(score[32], score[0]),
            "write_s": write}


def main():
    ap = common.parser(__doc__)
    args = ap.parse_args()
    common.quiet()
    with common.workdir("topk") as work:
        model_dir, data = common.sft_data()
        result = {"data/": sizes(model_dir, data / "train.jsonl", work, "data")}
        big = common.make_checkpoint(work, "1M-32k", spec={**common.MODELS["1M"], "vocab": 32768})
        synthetic = common.write_jsonl(work / "synthetic.jsonl", common.synthetic_pairs(16 if args.quick else 64, 256,
                                                                                         32768))
        result["1M, vocab 32k, untrained"] = sizes(big, synthetic, work, "32k")
        result["time"] = timing(model_dir, data / "train.jsonl", work, reps=1 if args.quick else 5)
    t = result["time"]
    print(f"precompute-ref on data/: K=32 / K=0 = {t['run_ratio_k32_over_k0']:.2f}x (whole run), "
          f"{t['score_ratio_k32_over_k0']:.2f}x (scoring + shard write), {t['run_cpu_ratio_k32_over_k0']:.2f}x (whole "
          "run, CPU seconds on one thread)")
    print(common.save("topk", result, args))


if __name__ == "__main__":
    main()
