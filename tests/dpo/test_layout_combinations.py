"""The prefix_shared batch layout combined with the rest of training: DDP under torchrun, gradient checkpointing,
bf16 autocast, LoRA; and attention implementations that cannot take the tree mask. Each run is compared with the
padded layout on the same seed and data (the padded layout is itself tested against each sequence's own forward)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TORCHRUN, WORDS, build_llama, run_in_session, save_checkpoint, write_jsonl
from dpo.layout import choose_layout
from dpo.config import TrainConfig
from dpo.recipe import run_train
from precompute.job import PrecomputeConfig, run_precompute
from runtime.probe import max_difference, reference_values
from runtime.tolerance import probe_tolerance
from schemas.encoding import EncodingConfig
from schemas.stamps import model_hash

TOL = 1e-5
NOT_COMPARED = ("runtime", "per_second", "epoch", "total_flos")  # wall clock, bookkeeping, the Trainer's slot count


def close(a: float, b: float, tol: float = TOL) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a))  # relative for large values (log-prob sums)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_same_metrics(a: Path, b: Path, steps: int, tol: float = TOL):
    ra, rb = records(a), records(b)
    assert len(ra) == len(rb) and sum("loss" in r for r in ra) == steps
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys() and x["step"] == y["step"]
        for key in x:
            if isinstance(x[key], float) and not any(n in key for n in NOT_COMPARED):
                assert close(x[key], y[key], tol), f"step {x['step']} {key}: {x[key]} vs {y[key]}"


def assert_same_weights(a: Path, b: Path, start: dict, name: str = "model.safetensors"):
    wa, wb = load_file(a / name), load_file(b / name)
    assert wa.keys() == wb.keys() and wa
    for key in wa:
        assert torch.allclose(wa[key], wb[key], rtol=TOL, atol=TOL), key
    moved = max(float((wa[k] - start[k]).abs().max()) if k in start else float(wa[k].abs().max()) for k in wa)
    assert moved > 1e-4  # they trained: not both still where they started


def train(model: Path, data: Path, out: Path, **kwargs) -> tuple[dict, list[str]]:
    logs: list[str] = []
    options = dict(use_cpu=True, learning_rate=1e-4, per_device_train_batch_size=4, logging_steps=1, seed=3,
                   plot=False, max_steps=3, save_strategy="no")
    summary = run_train(TrainConfig(model=str(model), data=str(data), output_dir=str(out), **{**options, **kwargs}),
                        log=logs.append)
    return summary, logs


def run_both(model: Path, data: Path, root: Path, **kwargs) -> dict[str, tuple[Path, list[str]]]:
    runs = {}
    for name in ("padded", "prefix_shared"):
        summary, logs = train(model, data, root / name, batch_layout=name, **kwargs)
        assert summary["batch_layout"] == name, logs
        runs[name] = (root / name, logs)
    return runs


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory, tokenizer) -> dict:
    """A tiny Llama, 16 long-prompt pairs and their cache under a perturbed copy of the model (so the policy differs
    from the reference from step 0 on and no metric sits on a float tie)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("combos")
    model = save_checkpoint(build_llama(len(tokenizer), seed=4, hidden=64), tokenizer, root / "model")
    perturbed = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    torch.manual_seed(12)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.003)
    reference = save_checkpoint(perturbed, tokenizer, root / "reference")
    rng = random.Random(5)
    words = lambda a, b: " ".join(rng.choice(WORDS) for _ in range(rng.randint(a, b)))
    rows = [{"id": f"l{i:03d}", "prompt": words(40, 100) + "?", "chosen": "sure " + words(2, 10),
             "rejected": "hmm " + words(2, 10)} for i in range(16)]
    data = write_jsonl(root / "data" / "train.jsonl", rows)
    cache = root / "cache"
    run_precompute(PrecomputeConfig(model=str(reference), data=str(data), out=str(cache), progress=False,
                                    encoding=EncodingConfig(max_length=512)), log=lambda m: None)
    return {"model": model, "data": data, "cache": cache, "reference": reference, "hash": model_hash(reference),
            "start": load_file(model / "model.safetensors")}


def cached(fx: dict) -> dict:
    return {"ref_cache": str(fx["cache"]), "ref_model_hash": fx["hash"]}


# ---------------------------------------------------------------------------------------------------------------
# DDP: torchrun, 2 processes, gloo on CPU



def torchrun_train(fx: dict, out: Path, layout: str, batch: int) -> str:
    """train-dpo under torchrun (its own session, so a timeout kills the workers too); returns stderr."""
    cmd = [*TORCHRUN, "-m", "dpo.cli", "--model", str(fx["model"]), "--data", str(fx["data"]), "--ref-cache",
           str(fx["cache"]), "--ref-model-hash", fx["hash"], "--output-dir", str(out), "--max-steps", "3",
           "--per-device-train-batch-size", str(batch), "--logging-steps", "1", "--learning-rate", "1e-4",
           "--seed", "3", "--use-cpu", "--save-strategy", "no", "--no-plot", "--batch-layout", layout]
    return run_in_session(cmd, out.parent, timeout=300).stderr


def test_ddp_two_ranks_prefix_shared_equal_one_padded_process_with_the_double_batch(tmp_path, long_prompts):
    """Each rank packs its own half of every batch. tests/test_distributed.py shows 2 padded ranks of batch B equal one
    padded process of batch 2B; one torchrun run of prefix_shared against that process closes the square."""
    log = torchrun_train(long_prompts, tmp_path / "ranks", "prefix_shared", 2)
    assert log.count("batch layout:") == 1 and "batch layout: prefix_shared (sdpa attention" in log  # rank 0, once
    train(long_prompts["model"], long_prompts["data"], tmp_path / "one", batch_layout="padded", **cached(long_prompts))
    assert_same_metrics(tmp_path / "one", tmp_path / "ranks", 3)
    assert_same_weights(tmp_path / "one", tmp_path / "ranks", long_prompts["start"])


# ---------------------------------------------------------------------------------------------------------------
# gradient checkpointing, LoRA, bf16


def test_gradient_checkpointing_prefix_shared_equals_padded(tmp_path, long_prompts, monkeypatch):
    import transformers.modeling_utils as modeling_utils

    calls = []
    real = modeling_utils.checkpoint

    def counted(*args, **kwargs):  # the function transformers recomputes each decoder layer with
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", counted)
    runs = run_both(long_prompts["model"], long_prompts["data"], tmp_path, gradient_checkpointing=True,
                    **cached(long_prompts))
    assert len(calls) >= 2 * 3 * 2  # both runs, 3 steps, 2 layers: checkpointing was on
    assert_same_metrics(runs["padded"][0], runs["prefix_shared"][0], 3)
    assert_same_weights(runs["padded"][0], runs["prefix_shared"][0], long_prompts["start"])


@pytest.mark.parametrize("reference, checkpointing", [("cache", False), ("live", True)])
def test_lora_prefix_shared_equals_padded(tmp_path, long_prompts, reference, checkpointing):
    pytest.importorskip("peft")
    from dpo.lora import LoraOptions

    # no adapter dropout: its random masks have the shape of the batch, which differs between the layouts
    opts = LoraOptions(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
    ref = cached(long_prompts) if reference == "cache" else {"ref_model": str(long_prompts["model"])}
    runs = run_both(long_prompts["model"], long_prompts["data"], tmp_path, lora=opts, learning_rate=1e-3,
                    gradient_checkpointing=checkpointing, **ref)
    assert_same_metrics(runs["padded"][0], runs["prefix_shared"][0], 3)
    assert_same_weights(runs["padded"][0], runs["prefix_shared"][0], {}, name="adapter_model.safetensors")
    adapter = load_file(runs["prefix_shared"][0] / "adapter_model.safetensors")
    assert max(float(w.abs().max()) for k, w in adapter.items() if "lora_B" in k) > 1e-4  # lora_B starts at 0


@pytest.mark.parametrize("reference", ["cache", "live"])
def test_bf16_autocast_prefix_shared_close_to_padded(tmp_path, long_prompts, reference):
    """--bf16 on CPU: the probe also runs under bf16 autocast and passes (a live reference is loaded in bf16 and
    probed at bf16's tolerance); the runs agree to a small fraction of a bf16 rounding step (bf16 keeps 8 significant
    bits: one step at a loss of 0.69 is 2^-9 = 0.002). They cannot agree to float32's 1e-5: the layouts sum the same
    bf16 products in other groupings (a prompt's gradient once instead of twice). Measured with the cache: loss 7e-5
    apart, about as far as the same padded run in float32 is from bf16 (1e-4)."""
    ref = cached(long_prompts) if reference == "cache" else {"ref_model": str(long_prompts["reference"])}
    runs = run_both(long_prompts["model"], long_prompts["data"], tmp_path, bf16=True, **ref)
    line = [m for m in runs["prefix_shared"][1] if m.startswith("batch layout:")]
    assert line and "also under bfloat16 autocast" in line[0]
    assert_same_metrics(runs["padded"][0], runs["prefix_shared"][0], 3, tol=1e-3)
    if reference == "cache":
        train(long_prompts["model"], long_prompts["data"], tmp_path / "fp32", batch_layout="padded", **ref)
        assert records(tmp_path / "fp32")[0]["loss"] != records(runs["padded"][0])[0]["loss"]  # bf16 was really on


def test_probe_under_autocast_catches_what_only_low_precision_breaks(tokenizer, monkeypatch):
    from dpo import layout

    rows = _table(random_rows(6))
    real = layout.pair_logps

    def worse_in_bf16(model, inputs):  # a kernel that mishandles the tree mask only under autocast
        got = real(model, inputs)
        return got + 1.0 if torch.is_autocast_enabled("cpu") else got

    monkeypatch.setattr(layout, "pair_logps", worse_in_bf16)
    logs: list[str] = []
    model = build_llama(len(tokenizer))
    assert choose_layout("prefix_shared", [model], rows, 4, 0, logs.append) == "prefix_shared"
    assert choose_layout("prefix_shared", [model], rows, 4, 0, logs.append, autocast=torch.bfloat16) == "padded"
    assert "differs from the reference forward by 1.00e+00 under bfloat16 autocast" in logs[1]


def test_a_bf16_live_reference_is_probed_at_its_own_dtypes_tolerance(tokenizer):
    """--bf16 loads a live reference in bf16 beside the float32 policy: each model is held to its own dtype's
    tolerance (the reference's bf16 rounding alone exceeds float32's 1e-4 on these pairs)."""
    from dpo import layout

    rng = random.Random(1)
    ids = lambda a, b: [rng.randrange(3, 300) for _ in range(rng.randint(a, b))]
    table = _table([{"prompt_ids": ids(100, 300), "chosen_ids": ids(5, 40), "rejected_ids": ids(5, 40)}
                    for _ in range(8)])
    policy = build_llama(len(tokenizer), hidden=128, layers=4)
    reference = build_llama(len(tokenizer), hidden=128, layers=4, seed=1).to(torch.bfloat16)
    sample = layout.probe_pairs(table, layout.table_lengths(table))
    diff = max_difference(layout.prefix_shared_logps(reference, sample, 0), reference_values(reference, sample))
    assert probe_tolerance(torch.float32) < diff < probe_tolerance(torch.bfloat16)
    logs: list[str] = []
    assert choose_layout("auto", [policy, reference], table, 4, 0, logs.append, autocast=torch.bfloat16) == \
        "prefix_shared", logs


# ---------------------------------------------------------------------------------------------------------------
# attention implementations


def random_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    ids = lambda a, b: [rng.randrange(3, 300) for _ in range(rng.randint(a, b))]
    return [{"prompt_ids": ids(30, 60), "chosen_ids": ids(1, 8), "rejected_ids": ids(1, 8)} for _ in range(n)]


def _table(rows: list[dict]):
    import pyarrow as pa

    return pa.Table.from_pylist(rows)


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flash_attention_3", "flex_attention", "paged|sdpa"])
def test_attention_that_cannot_take_the_tree_mask_falls_back_before_the_probe(tokenizer, monkeypatch,
                                                                               implementation):
    """Flash kernels take no 4-D mask (flash_attn cannot be installed on CPU, so the name is set on the config, as
    transformers does after loading); FlexAttention would need a BlockMask, which is not built (its backward does not
    run on CPU with torch 2.13, so a BlockMask path could not be tested here)."""
    from dpo import layout

    model = build_llama(len(tokenizer))
    model.config._attn_implementation = implementation
    monkeypatch.setattr(layout, "disagreement", lambda *a, **k: pytest.fail("the probe ran"))
    logs: list[str] = []
    for requested in ("auto", "prefix_shared"):
        assert choose_layout(requested, [model], _table(random_rows(6)), 4, 0, logs.append) == "padded"
    assert logs[0] == f"batch layout: padded ({implementation} attention cannot take the tree mask)"
    assert logs[1].startswith("batch layout: padded, although prefix_shared was requested (" + implementation)


def test_a_live_reference_built_with_flex_attention_keeps_the_policy_padded(tokenizer):
    model = build_llama(len(tokenizer), attn_implementation="flex_attention")
    assert model.config._attn_implementation == "flex_attention"
    logs: list[str] = []
    assert choose_layout("auto", [build_llama(len(tokenizer)), model], _table(random_rows(6)), 4, 0,
                         logs.append) == "padded"  # a live reference on flex keeps the policy padded too
    assert logs == ["batch layout: padded (flex_attention attention cannot take the tree mask)"]
