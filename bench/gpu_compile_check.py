"""precompute-ref's compile figures on a CUDA device (issue 39 item 1: `--torch-compile` auto weighs a job's eager
scoring against the compile cost): score_pairs eager vs compiled (precompute/compiled.py compile_scoring) on a
Llama-style model in bfloat16 with sdpa, on long-prompt pairs, with only the device image's packages. Measured: the
first compiled call (the compile, a cold inductor cache in a fresh folder), then the median of timed rounds each
way, and the largest difference of the two caches' log-probs. One JSON file.

    python bench/gpu_compile_check.py --out compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))  # cold: a fresh folder

from precompute.compiled import compile_scoring
from precompute.modes import score_pairs
from schemas.encoding import EncodedPair

SIZES = {"35M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=8192),
         "350M": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                      num_key_value_heads=8, vocab_size=32000)}


def model_of(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval().requires_grad_(False)


def pairs_of(n: int, vocab: int) -> list[EncodedPair]:
    rng = np.random.default_rng(0)
    ids = lambda k: rng.integers(3, vocab, k).tolist()
    return [EncodedPair(ids(512), ids(128), ids(128)) for _ in range(n)]


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def case(size: str, mode: str, pairs: int = 64, budget: int = 16384, rounds: int = 5) -> dict:
    model = model_of(size)
    work = pairs_of(pairs, SIZES[size]["vocab_size"])
    eager = lambda: score_pairs(model, work, 0, budget, mode)
    timed(eager, 1)  # warm-up (cuBLAS, allocator)
    eager_s = timed(eager, rounds)
    compiled = compile_scoring(model)
    fast = lambda: score_pairs(compiled, work, 0, budget, mode)
    first = timed(fast, 1)[0]  # the compile (cold inductor cache), then the first compiled batches
    compiled_s = timed(fast, rounds)
    a = np.concatenate([np.asarray(x.logps, np.float32) for x in eager()[0]])
    b = np.concatenate([np.asarray(x.logps, np.float32) for x in fast()[0]])
    row = {"size": size, "mode": mode, "pairs": pairs, "tokens": pairs * (512 + 256),
           "eager_s": statistics.median(eager_s), "compiled_s": statistics.median(compiled_s),
           "first_compiled_call_s": first, "max_abs_difference_bf16": float(np.max(np.abs(a - b)))}
    row["speedup"] = row["eager_s"] / row["compiled_s"]
    row["compile_cost_s"] = first - row["compiled_s"]
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default="35M:full_forward,350M:full_forward,350M:kv_cache")
    args = ap.parse_args()
    import transformers

    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "transformers": transformers.__version__, "cases": []}
    for size, mode in (c.split(":") for c in args.cases.split(",")):
        try:
            result["cases"].append(case(size, mode))
        except Exception as e:  # said, not hidden
            result["cases"].append({"size": size, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(result["cases"][-1]), flush=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
