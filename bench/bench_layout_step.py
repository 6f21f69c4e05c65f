"""One process, interleaved: forward + backward of the policy on one batch in the prefix_shared and the padded layout
(no Trainer, no optimizer), so load from other processes falls on both alike. A quick complement to
bench_layout.py's whole-step figures on a shared machine. One torch thread, and the process's CPU time is reported
beside the wall time: on an overloaded machine wall time mostly measures the wait for a core, CPU time the work.

    .venv/bin/python bench/bench_layout_step.py [--model 5M] [--batch 2] [--reps 4]
"""

from __future__ import annotations

import argparse
import time

import common
from bench_layout import LONG, long_pairs
from common import torch

from dpo.layout import PrefixSharedCollator, pair_logps
from dpo.trainer import PairCollator


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="5M")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args()
    common.quiet()
    torch.set_num_threads(1)
    spec = common.MODELS[a.model]
    model = common.build_llama(a.model).train()
    tok = common.word_tokenizer(spec["vocab"])
    rows = []
    for r in long_pairs(a.batch, spec["vocab"], **LONG):
        p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
        rows.append({"prompt_ids": p, "chosen_ids": tok(r["chosen"], add_special_tokens=False)["input_ids"],
                     "rejected_ids": tok(r["rejected"], add_special_tokens=False)["input_ids"]})
    batches = {"prefix_shared": PrefixSharedCollator(0)(rows), "padded": PairCollator(0)(rows)}
    times = {(k, clock): [] for k in batches for clock in ("wall", "cpu")}
    for rep in range(a.reps + 1):
        for name, batch in batches.items():
            model.zero_grad(set_to_none=True)
            t, c = time.perf_counter(), time.process_time()
            pair_logps(model, batch).sum().backward()
            if rep:  # the first round is a warm-up
                times[name, "wall"].append(time.perf_counter() - t)
                times[name, "cpu"].append(time.process_time() - c)
    med = {k: common.statistics.median(v) for k, v in times.items()}
    print({f"{k[0]} {k[1]}": [round(x, 3) for x in v] for k, v in times.items()})
    for clock in ("cpu", "wall"):
        print(f"{a.model} prompt {LONG['prompt']} completions {LONG['completion']} batch {a.batch}, {clock} time of "
              f"fwd+bwd (median): prefix_shared {med['prefix_shared', clock]:.3f} s, padded {med['padded', clock]:.3f}"
              f" s, speed-up {med['padded', clock] / med['prefix_shared', clock]:.2f}x")
    print(f"load average {common.os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
