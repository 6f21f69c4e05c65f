"""Part 19: the cost of precompute-ref's batching-mode probe (precompute.modes.choose_mode) before and after issue 26.

Before, the probe took the first shard's longest pair and the job's longest even where the two had the same lengths
(two more reference forwards over the longest sequences, and one more long row in the mode's batch), and scored all
its pairs in one batch, the short probe pairs padded to the long pair's length. Now a long pair of lengths already
probed is left out, and the padded layouts (kv_cache, full_forward) score the long pair alone and the short pairs as
a padded batch of their own (BatchingMode.probe_budget). `before` below is that old behaviour, rebuilt here from
today's pieces for the measurement only.

On the 35M long-prompt case of part 11 (prompt 512, completions 128/128, pairs of equal lengths: the case where the
first shard's longest and the job's longest differ but have the same lengths), choose_mode(auto) before and now, and
score_pairs of the job's pairs in the mode chosen, interleaved in one process on one torch thread, timed in CPU
seconds (and wall). The probe is a cost per job; the job's scoring grows with its pairs.

    .venv/bin/python bench/bench_probe.py [--quick]
"""

from __future__ import annotations

import time

import common
import measure
from common import torch

import bench_flops


def main():
    ap = common.parser(__doc__)
    ap.add_argument("--reps", type=int, default=None)
    a = ap.parse_args()
    common.quiet()
    torch.set_num_threads(1)
    from precompute.job import _length
    from precompute.modes import choose
    from precompute.modes.scoring import score_pairs
    from runtime.budget import DEFAULT_TOKEN_BUDGET
    from runtime.checkpoint import Checkpoint

    case = bench_flops.cases(a.quick)[0]
    with common.workdir("probe") as work:
        p = bench_flops.prepare(case, work)

        class Args:
            model, data, seq = p["model"], p["data"], p["seq"]

        _encoding, pairs, pad = bench_flops.encoded_pairs(Args)
        model = Checkpoint.open(str(p["model"])).load_model(torch.float32, torch.device("cpu"), "sdpa")
        longest = max(pairs, key=_length)
        now_pairs, now_values = choose.probe_pairs, choose.mode_values

        def before_pairs(sample, prompt_cap=24, completion_cap=8, long_pairs=()):
            probe = now_pairs(sample, prompt_cap, completion_cap)  # the short pairs and the sample's longest
            return probe + [q for q in long_pairs if all(q != x for x in probe)]  # equal pairs only left out

        def before_values(model, mode, pairs, pad_id, top_k=0):
            chosen, rejected, _ = score_pairs(model, pairs, pad_id, 1 << 30, mode, top_k=top_k)  # one batch
            return [x for pair in zip(chosen, rejected) for x in pair]

        chosen = {}

        def probe(kind):
            if kind == "before":
                choose.probe_pairs, choose.mode_values = before_pairs, before_values
            try:
                chosen[kind] = choose.choose_mode(model, "auto", pairs, _length(longest), pad, DEFAULT_TOKEN_BUDGET,
                                                  lambda m: None, long_pairs=[longest])
            finally:
                choose.probe_pairs, choose.mode_values = now_pairs, now_values

        fns = {"before": lambda: probe("before"), "now": lambda: probe("now"),
               "score": lambda: score_pairs(model, pairs, pad, DEFAULT_TOKEN_BUDGET, chosen["now"])}
        cpu = {}
        with torch.no_grad():
            probe("now")
            times = measure.interleaved(fns, reps=a.reps or (2 if a.quick else 3), warmup=1, cpu=cpu)
        shapes = lambda ps: [[len(q.prompt_ids), len(q.chosen_ids), len(q.rejected_ids)] for q in ps]
        result = {"case": case["name"], "pairs": len(pairs), "mode": chosen, "threads": 1,
                  "probe_before": shapes(before_pairs(pairs, long_pairs=[longest])),
                  "probe_now": shapes(now_pairs(pairs, long_pairs=[longest])),
                  "times": times, "cpu_times": cpu, "loadavg_end": round(common.os.getloadavg()[0], 2),
                  "now_over_before_cpu": cpu["now"]["median"] / cpu["before"]["median"]}
    print(f"probe CPU s: before {cpu['before']['median']:.2f}, now {cpu['now']['median']:.2f} "
          f"({result['now_over_before_cpu']:.2f}x); score_pairs of {len(pairs)} pairs {cpu['score']['median']:.2f} "
          f"[{time.strftime('%H:%M:%S')}]")
    print(f"wrote {common.save('probe', result, a)}")


if __name__ == "__main__":
    main()
