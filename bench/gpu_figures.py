"""The GPU check's figures (bench/gpu_check.py runs the measurements): the device's peak (datasheet table with each
figure's source, and the measured torch.mm rate), the model's shape, the FLOPs of scoring pairs, and the Markdown
tables of a result."""

from __future__ import annotations

import math
import re
import time

import common
import measure
from common import torch

TRAIN = {  # the train-dpo configurations: (reference, batch layout)
    "cached_padded": ("cached", "padded"),
    "live_padded": ("live", "padded"),
    "cached_prefix_shared": ("cached", "prefix_shared"),
}

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by a pattern of the device's name (torch.cuda.get_device_name);
# the first pattern that matches wins, so the more specific ones come first. NVIDIA's datasheets print these rates
# "with sparsity", twice the dense figure. The third field is where the figure was checked (issue 39, 2026-12-04),
# or "unchecked" where no copy of the datasheet was at hand; README "GPU check" lists the same.
HOPPER_CHECK = ("H200 and H100 SXM: 989 = 1,979 / 2 (NVIDIA's 'with sparsity' figure); dense 989 for the H200 SXM at "
                "https://itkb.uw.cz/2026/06/nvidia-h200-vs-b300-precisions-cores.html, BF16 matrix 989.4 (sparse "
                "1978.9) for Hopper SXM at https://glennklockwood.com/garden/processors/h100; KINDS.md: 'NVIDIA "
                "H200' is the SXM part")
H100_DATASHEET = ("NVIDIA's H100 table (SXM 1,979 / PCIe 1,513 TFLOPS 'shown with sparsity', half without) at "
                  "https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html")
PEAK_BF16_TFLOPS = [
    (r"GH200", 989.0, HOPPER_CHECK),
    (r"H200.*NVL", 835.0, "unchecked (NVIDIA's H200 NVL figure 1,671 with sparsity; no copy found)"),
    (r"H200", 989.0, HOPPER_CHECK),
    (r"H100.*PCIe", 756.0, H100_DATASHEET),
    (r"H100.*NVL", 835.0, "unchecked (NVIDIA's H100 NVL figure 1,671 with sparsity; no copy found)"),
    (r"H100|H800", 989.0, H100_DATASHEET),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"B200", 2250.0, "HGX B200 per GPU 4.5 PFLOPS FP16/BF16 (NVIDIA's sparse figure) at "
                      "https://zdszero.github.io/Computer/Artificial_Intelligence/Hardware.html"),
    (r"A100|A800", 312.0, "BF16 311.87 tensor, 623.74 sparse at https://hmc-tech.com/gpu/nvidia-l4-vs-nvidia-a100-40gb"),
    (r"L40S", 362.0, "BF16 366.43 tensor at boost clock (NVIDIA: 362.05) at https://hmc-tech.com/gpu/nvidia-l40s-vs-nvidia-a16"),
    (r"L40\b", 181.0, "unchecked (NVIDIA's L40 datasheet: 181.05 with FP32 accumulate, 362.1 sparse)"),
    (r"L4\b", 121.0, "BF16 125.34 tensor at boost clock (NVIDIA: 121) at https://hmc-tech.com/gpu/nvidia-l4-vs-nvidia-a100-40gb"),
    (r"A10\b", 125.0, "unchecked (NVIDIA's A10 datasheet: 125, 250 sparse)"),
]


def datasheet_entry(name: str) -> tuple[float, str] | None:
    """(dense bf16 peak TFLOP/s, where it was checked) of a device by name; None for one not in the table."""
    return next(((peak, source) for pattern, peak, source in PEAK_BF16_TFLOPS if re.search(pattern, name)), None)


def datasheet_peak(name: str) -> float | None:
    entry = datasheet_entry(name)
    return entry[0] if entry else None


def measured_mm_tflops(dev: torch.device, dtype: torch.dtype) -> float:
    """The rate of square torch.mm in `dtype` on `dev`, TFLOP/s (best of a few timed batches after a warm-up)."""
    n, reps = (8192, 20) if dev.type == "cuda" else (512, 4)
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    best = math.inf
    for i in range(4):
        common.sync()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        common.sync()
        if i:  # the first batch is a warm-up
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 * reps / best / 1e12


def peak(dev: torch.device, dtype: torch.dtype) -> dict:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else common.cpu_model()
    mm = measured_mm_tflops(dev, dtype)
    entry = datasheet_entry(name) if dev.type == "cuda" else None
    dtype_name = str(dtype).removeprefix("torch.")
    source = ("datasheet, dense bf16" if entry else
              f"not in the datasheet table: the measured torch.mm {dtype_name} rate")
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the children need the memory, not this process's allocator
    return {"device": name, "tflops": entry[0] if entry else mm, "source": source,
            "checked": entry[1] if entry else None, "mm_tflops": mm, "mm_dtype": dtype_name}


def model_shape(model) -> dict:
    cfg = model.config
    total = common.n_params(model)
    return {"params": total, "linear_params": total - model.get_input_embeddings().weight.numel(),
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
            "attn_width": cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)}


def pairs_flops(prompt_lens, chosen_lens, rejected_lens, shape: dict) -> float:
    """FLOPs of scoring pairs, each prompt once: 2 x linear params per token, plus attention (QK^T and AV: 4 x
    width per key) over the keys each token attends causally: 1..P for the prompt, P+1..P+C for a completion."""
    import numpy as np

    p, c, r = (np.asarray(v, np.float64) for v in (prompt_lens, chosen_lens, rejected_lens))
    keys = p * (p + 1) / 2 + c * (2 * p + c + 1) / 2 + r * (2 * p + r + 1) / 2
    return float(2 * shape["linear_params"] * (p + c + r).sum()
                 + 4 * shape["layers"] * shape["attn_width"] * keys.sum())


# the tables


def _g(v, digits=3) -> str:
    return f"{v:.{digits}g}"


def _not_run(c: dict) -> str | None:
    return c.get("skipped") or c.get("error")


def tables(r: dict) -> list[str]:
    """The check's result as Markdown lines: header, precompute table, training table (those it holds)."""
    from report import table

    p, size = r["peak"], r["size"]
    memory = "torch.cuda.max_memory_allocated" if r["device"] == "cuda" else "peak RSS"
    L = [f"Device: {p['device']}; peak {_g(p['tflops'])} TFLOP/s ({p['source']}); torch.mm {p['mm_dtype']} "
         f"measured {_g(p['mm_tflops'])} TFLOP/s."]
    if "model" in r:
        m = r["model"]
        params = f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e9 else f"{m['params'] / 1e6:.1f}M"
        L[0] += (f" Model: Llama-style, {params} parameters (hidden {m['hidden']} x {m['layers']} layers, "
                 f"{m['heads']} heads, {m['kv_heads']} key/value heads, vocab {m['vocab']}), random init, "
                 f"{r['dtype']}. Data: {size['pairs']} synthetic pairs of up to {size['seq']} tokens.")
    stages = r.get("stages_s", {})
    L[0] += (f" Wall: {stages.get('total', sum(stages.values())):.0f} s "
             f"({', '.join(f'{k} {v:.0f} s' for k, v in stages.items() if k != 'total')}).")
    L.append("")
    if "precompute" in r:
        rows = []
        for attn, c in r["precompute"].items():
            if _not_run(c):
                rows.append([attn, f"not run: {_not_run(c)}"] + [""] * 7)
                continue
            v = c.get("vs_fp32") or {}
            diffs = ([f"{v['max_abs_diff']:.3g}", f"{v['mean_abs_diff']:.3g}",
                      f"{v['tokens']:,} ({v['pairs']} pairs); {v['tolerance']:g} "
                      f"({'within' if v['max_abs_diff'] <= v['tolerance'] else 'EXCEEDED'})"] if v else ["n/a"] * 3)
            rows.append([attn, c["mode"], f"{c['tokens_per_s']:,.0f}", f"{c['share_of_peak']:.1%}",
                         f"{c['score_s']:.2f} / {c['wall_s']:.1f}", f"{c['peak_mb']:,.0f} MiB", *diffs])
        L += [f"precompute-ref, {r['dtype']}:", ""]
        L += table(f"attention | batching | tokens/s (scoring) | share of peak | scoring / end-to-end s | {memory} | "
                   "max abs diff vs fp32 | mean abs diff | tokens compared; tolerance", rows)
    if "train" in r:
        rows = []
        base = r["train"].get("cached_padded", {})
        for name, t in r["train"].items():
            reference, layout = TRAIN[name]
            if _not_run(t):
                rows.append([reference, layout, f"not run: {_not_run(t)[:200]}", "", ""])
                continue
            ratio = (f"{measure.ratio(t['step'], base['step']):.2f}x" if "step" in base else "n/a")
            rows.append([reference, layout, f"{t['step']['median'] * 1000:,.1f} ms ({len(t['step_s'])} steps)",
                         ratio, f"{t['peak_mb']:,.0f} MiB"])
        precision = "bf16 mixed precision" if r["dtype"] == "bfloat16" else "float32"
        L += ["", f"train-dpo, batch {size['batch']} pairs, {precision}:", ""]
        L += table(f"reference | batch layout | step time (median) | vs cached padded | {memory}", rows)
    return L
