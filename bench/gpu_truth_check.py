"""The chunked truth on a CUDA device with only the device image's packages (torch, transformers, pyarrow, numpy; no
polars, datasets or fsspec needed): runtime/truth.py against the whole forward (runtime.logprobs.reference_scores)
in float32 and bfloat16, sdpa attention, on tiny models of several architectures (the matrix's shrinking: hidden
32, 2 layers, vocabulary 300, weights drawn at 0.25 so that errors show), and the truth's peak CUDA memory, whole
forward vs pieces, at a 128k vocabulary x 8k tokens. One JSON file.

    python bench/gpu_truth_check.py --out truth.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import truth
from runtime.logprobs import reference_scores
from runtime.tolerance import truth_tolerance

ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma2", "cohere", "granite", "phi3", "olmo2", "gpt_neox", "gpt2",
                 "falcon", "stablelm")
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=300, max_position_embeddings=512, n_embd=32, n_layer=2, n_head=4,
             n_positions=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def build(model_type: str, dtype, **override):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type]()
    for key, value in {**SMALL, **override}.items():
        if key in override or hasattr(config, key):
            try:
                setattr(config, key, value)
            except AttributeError:
                pass
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and name.endswith("weight"):
                p.normal_(0.0, 0.25)
    return model.to("cuda", dtype).eval().requires_grad_(False)


def matrix() -> list[dict]:
    rng = np.random.default_rng(0)
    seq = (rng.integers(3, 300, 20).tolist(), rng.integers(3, 300, 30).tolist())
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for arch in ARCHITECTURES:
            row = {"architecture": arch, "dtype": str(dtype).removeprefix("torch."),
                   "tolerance": truth_tolerance(dtype)}
            try:
                model = build(arch, dtype)
                row["supports_chunks"] = truth.supports_chunks(model)
                if row["supports_chunks"]:
                    row["logps"] = truth.chunked_difference(model, [seq])
                    row["top_k"] = truth.chunked_difference(model, [seq], top_k=4)
                    row["within"] = max(row["logps"], row["top_k"]) <= row["tolerance"]
            except Exception as e:  # an architecture this transformers builds otherwise: said, not hidden
                row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def memory(vocab: int = 128256, tokens: int = 8192) -> dict:
    """Peak CUDA memory of the truth of one sequence, whole forward vs pieces, over the model's own weights."""
    model = build("llama", torch.bfloat16, hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=vocab,
                  max_position_embeddings=tokens + 8)
    rng = np.random.default_rng(1)
    prompt, completion = rng.integers(3, vocab, tokens // 2).tolist(), rng.integers(3, vocab, tokens // 2).tolist()
    out = {"vocab": vocab, "tokens": tokens}
    for kind, fn in (("whole", lambda: reference_scores(model, prompt, completion, 8)),
                     ("chunked", lambda: truth.chunked_scores(model, prompt, completion, 8))):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        scores = fn()
        torch.cuda.synchronize()
        out[kind] = {"peak_over_weights_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
                     "seconds": time.perf_counter() - start}
        out[kind + "_logps"] = scores.logps.float().cpu().numpy()
    a, b = out.pop("chunked_logps"), out.pop("whole_logps")
    out["max_relative_difference_bf16"] = float(np.max(np.abs(a - b) / np.maximum(1.0, np.abs(b))))
    print(json.dumps(out), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import transformers

    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "transformers": transformers.__version__}
    print(json.dumps(result), flush=True)
    result["matrix"] = matrix()
    result["memory"] = memory()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
