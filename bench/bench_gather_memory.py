"""Part 4: peak memory of the log-prob gather at vocabulary 32k and 128k, sequence 1024.

A Llama with a tiny hidden size (64, 2 layers) and a big vocabulary, so the output projection dominates. Rows of
1,024 tokens, the second half the completion. Three no-grad computations, each in a process of its own (peak RSS on
CPU via VmHWM, reset before every repetition; torch.cuda.max_memory_allocated on CUDA), median over repetitions
after a warm-up, reported above the memory held before the call (weights and inputs):
  hidden    the model up to its final hidden states (model.model): the activations the model needs anyway
  chunked   runtime.logprobs.completion_logps: projection + log-softmax over chunks of completion positions
  naive     model(...).logits, then log_softmax over the full [batch, seq, vocab] and a gather
Each child runs with a fixed glibc mmap threshold so that freed tensors go back to the OS between repetitions.

    .venv/bin/python bench/bench_gather_memory.py [--quick]
"""

from __future__ import annotations

import gc
import json
import time

import common
import measure
from common import torch

METHODS = ("hidden", "chunked", "naive")
VOCABS = (32768, 131072)
SEQ = 1024


def child(vocab: int, method: str, batch: int, reps: int) -> dict:
    from runtime.logprobs import completion_logps

    dev = common.device()
    spec = dict(hidden=64, layers=2, heads=4, kv=2, inter=128)
    model = common.build_llama(spec, vocab=vocab, max_positions=SEQ).to(dev, common.torch_dtype(dev))
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, SEQ), generator=gen).to(dev)
    mask = torch.ones_like(ids)
    plen = torch.full((batch,), SEQ // 2)
    clen = torch.full((batch,), SEQ - SEQ // 2)

    @torch.no_grad()
    def run():
        if method == "hidden":
            return model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        if method == "chunked":
            return completion_logps(model, ids, mask, plen, clen)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = logits.float().log_softmax(-1)
        return logp[:, SEQ // 2 - 1 : -1].gather(-1, ids[:, SEQ // 2 :, None]).squeeze(-1)

    peaks, times = [], []
    for i in range(reps + 1):
        gc.collect()
        common.sync()
        measure.reset_peak()
        before = measure.cuda_now_mb() if dev.type == "cuda" else measure.rss_mb()
        t = time.perf_counter()
        out = run()
        common.sync()
        dt = time.perf_counter() - t
        peak = measure.cuda_peak_mb() if dev.type == "cuda" else measure.peak_rss_mb()
        del out
        if i:  # the first run is the warm-up
            peaks.append(peak - before)
            times.append(dt)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"vocab": vocab, "method": method, "batch": batch, "seq": SEQ, "peak_mb": measure.stats(peaks),
            "time": measure.stats(times), "weights_mb": weights,
            "full_logits_mb": batch * SEQ * vocab * 4 / 2**20}


def main():
    args = common.child_parser(__doc__, METHODS, paths=(), ints=("vocab", "batch", "reps")).parse_args()
    if args.child:
        print(json.dumps(child(args.vocab, args.child, args.batch, args.reps)))
        return
    batch = 2 if args.quick else 4
    reps = 3
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    results = []
    for vocab in VOCABS:
        for method in METHODS:
            r = common.run_child(common.child_argv(__file__, method, vocab=vocab, batch=batch, reps=reps), env=env)
            results.append(r)
            print(f"vocab {vocab:>6} {method:<8} peak +{common.fmt_s(r['peak_mb'], 'MiB')}  time "
                  f"{common.fmt_s(r['time'], 's')}  (weights {r['weights_mb']:.0f} MiB, full logits "
                  f"{r['full_logits_mb']:.0f} MiB)", flush=True)
    by = {(r["vocab"], r["method"]): r["peak_mb"]["median"] for r in results}
    summary = {
        "chunked_128k_vs_32k": by[(131072, "chunked")] / by[(32768, "chunked")],
        "naive_128k_vs_32k": by[(131072, "naive")] / by[(32768, "naive")],
        "naive_vs_chunked_128k": by[(131072, "naive")] / by[(131072, "chunked")],
    }
    print(f"chunked 128k/32k {summary['chunked_128k_vs_32k']:.2f}x, naive 128k/32k "
          f"{summary['naive_128k_vs_32k']:.2f}x, naive/chunked at 128k {summary['naive_vs_chunked_128k']:.1f}x")
    print(f"wrote {common.save('gather', {'batch': batch, 'results': results, 'summary': summary}, args)}")


if __name__ == "__main__":
    main()
