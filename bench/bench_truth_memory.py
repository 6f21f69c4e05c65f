"""precompute-ref's peak memory set by the truth (issue 39 item 2): the probe runs the truth on the job's longest pair;
whole, that pair's logits over the vocabulary (and their log_softmax) set the peak, chunked (runtime/truth.py) one
piece of them. Each in a process of its own: `baseline` (load the model, a 16-token forward), `whole`
(precompute-ref on one pair with WHOLE_ELEMENTS set past it) and `chunked` (as shipped), on a small-body model
(hidden 64, 2 layers) at 128k vocabulary x 2k tokens and 32k x one 16k-token pair. Reported: each peak RSS (wait4)
and its excess over the baseline. Targets: chunked excess <= 0.5 GiB at 128k x 2k, <= 1 GiB at 32k x 16k.

    .venv/bin/python bench/bench_truth_memory.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

import common

BODY = dict(hidden=64, layers=2, heads=4, kv=2, inter=128)
FULL = [("128k x 2k", 128256, 2048), ("32k x 16k", 32000, 16384)]
QUICK = [("32k x 2k", 32000, 2048)]

BASELINE = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    model(torch.arange(3, 19)[None])
"""
WHOLE = """
import sys
import runtime.truth
runtime.truth.WHOLE_ELEMENTS = 1 << 62
from precompute.cli import main
main(sys.argv[1:])
"""


def case(work: Path, name: str, vocab: int, tokens: int) -> tuple[Path, Path]:
    """A checkpoint of that vocabulary and one pair: a prompt and two completions of tokens/2 words each, so each
    scored sequence is `tokens` long (the word tokenizer gives one token a word)."""
    folder = common.make_checkpoint(work, str(vocab), spec={**BODY, "vocab": vocab},
                                    max_positions=max(tokens, 2048) + 8)
    half = tokens // 2 - 2
    words = lambda start: " ".join(f"w{3 + (start + i) % (vocab - 3)}" for i in range(half))
    data = common.write_jsonl(work / name.replace(" ", "") / "train.jsonl",
                              [{"id": "p0", "prompt": words(0), "chosen": " " + words(7), "rejected": " " + words(11)}])
    return folder, data


def main():
    args = common.parser(__doc__).parse_args()
    log = lambda m: print(m, flush=True)
    results = {}
    with common.workdir("truth-memory") as work:
        for name, vocab, tokens in QUICK if args.quick else FULL:
            model, data = case(work, name, vocab, tokens)
            run = lambda what, cmd: common.run_process(cmd, work / f"{name}-{what}.log".replace(" ", ""))
            cli = ["--model", str(model), "--data", str(data), "--max-length", str(tokens + 8), "--no-progress"]
            row = {"baseline": run("baseline", [sys.executable, "-c", BASELINE, str(model)]),
                   "whole": run("whole", [sys.executable, "-c", WHOLE, *cli, "--out", str(work / f"whole-{vocab}")]),
                   "chunked": run("chunked", [sys.executable, "-m", "precompute.cli", *cli,
                                              "--out", str(work / f"chunked-{vocab}")])}
            base = row["baseline"]["maxrss_mb"]
            row["excess_gib"] = {k: (row[k]["maxrss_mb"] - base) / 1024 for k in ("whole", "chunked")}
            results[name] = row
            log(f"{name}: peak RSS over a load + 16-token forward: whole {row['excess_gib']['whole']:.2f} GiB, "
                f"chunked {row['excess_gib']['chunked']:.2f} GiB (baseline {base / 1024:.2f} GiB; wall whole "
                f"{row['whole']['wall_s']:.1f} s, chunked {row['chunked']['wall_s']:.1f} s)")
    print(f"wrote {common.save('truth-memory', results, args)}")


if __name__ == "__main__":
    main()
