"""train-dpo --torch-compile (TrainingArguments' option): three steps with the compiled policy equal three uncompiled
steps, in both batch layouts (padded, and prefix_shared with its custom 4-D mask), on data/."""

from __future__ import annotations

import shutil

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, records, save_checkpoint
from dpo.config import TrainConfig
from dpo.recipe import run_train
from precompute.job import PrecomputeConfig, run_precompute
from runtime.tolerance import probe_tolerance
from schemas.stamps import model_hash

# inductor builds its CPU kernels with a C++ compiler (scripts/test.sh installs g++ as root)
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")

LR, STEPS = 1e-4, 3
NOT_COMPARED = ("runtime", "per_second", "epoch", "total_flos")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> tuple[Path, str]:
    """The cache of a perturbed copy of data/'s model, so that from step 0 on the policy differs from its reference
    and metrics such as preference accuracy are not decided by float noise around a tie; and its model hash."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("compile")
    model = AutoModelForCausalLM.from_pretrained(DATA / "sft-model", dtype=torch.float32)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.003)
    reference = save_checkpoint(model, AutoTokenizer.from_pretrained(DATA / "sft-model"), root / "reference")
    run_precompute(PrecomputeConfig(model=str(reference), data=str(DATA / "prefs"), out=str(root / "cache"),
                                    progress=False), log=lambda m: None)
    return root / "cache", model_hash(reference)


def train(out: Path, cache: tuple[Path, str], layout: str, compiled: bool) -> list[str]:
    logs: list[str] = []
    summary = run_train(TrainConfig(model=str(DATA / "sft-model"), data=str(DATA / "prefs"), ref_cache=str(cache[0]),
                                    ref_model_hash=cache[1],
                                    output_dir=str(out), use_cpu=True, learning_rate=LR, max_steps=STEPS,
                                    per_device_train_batch_size=8, logging_steps=1, seed=3, plot=False,
                                    batch_layout=layout, training_args={"torch_compile": compiled}), log=logs.append)
    assert summary["batch_layout"] == layout, logs
    return logs


@pytest.mark.parametrize("layout", ["padded", "prefix_shared"])
def test_three_compiled_steps_equal_the_uncompiled_steps(tmp_path, cache, layout):
    from torch._dynamo.utils import counters

    train(tmp_path / "eager", cache, layout, compiled=False)
    graphs = counters["stats"]["unique_graphs"]
    train(tmp_path / "compiled", cache, layout, compiled=True)
    assert counters["stats"]["unique_graphs"] > graphs  # it did compile (not a silent eager run)
    eager, compiled = records(tmp_path / "eager"), records(tmp_path / "compiled")
    assert len(eager) == len(compiled) and sum("loss" in r for r in eager) == STEPS
    # The compiled forward's per-token log-probs are the eager ones within the float32 probe tolerance (1e-4; ~1e-5
    # seen: inductor fuses and reorders the same sums). Every logged metric is a mean or sum of those values or of
    # the loss built from them, compared at that tolerance (relative above 1: log-prob sums).
    tol = probe_tolerance(torch.float32)
    for x, y in zip(eager, compiled):
        assert x.keys() == y.keys() and x["step"] == y["step"]
        for key in x:
            if not any(n in key for n in NOT_COMPARED):
                assert abs(x[key] - y[key]) <= tol * max(1.0, abs(x[key])), f"step {x['step']} {key}"
    start = load_file(DATA / "sft-model" / "model.safetensors")
    wa, wb = load_file(tmp_path / "eager" / "model.safetensors"), load_file(tmp_path / "compiled" / "model.safetensors")
    assert wa.keys() == wb.keys()
    moved = 0.0
    for name in wa:
        da, db = wa[name] - start[name], wb[name] - start[name]
        # Adam divides each gradient by its own running RMS: an element whose gradient is ~0 can move by up to the
        # learning rate per step on rounding alone, so elements are bounded by STEPS x lr, and the updates as a
        # whole must agree to 1% of their size
        assert float((da - db).abs().max()) <= STEPS * LR, name
        assert float((da - db).norm()) <= 1e-2 * max(float(da.norm()), 1e-12), name
        moved = max(moved, float(da.abs().max()))
    assert moved > LR / 2  # they trained: not both still the start
