"""train-dpo end to end on a tiny Llama (hidden 32, 2 layers) and 40 pairs: loss at the start, cached vs live
reference, the number of models built, the output checkpoint and run manifest, resume, gradient
accumulation and the other loss types (dpo/recipe.py). Options and config files: test_cli.py."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from conftest import DPO_PAIRS, REPO, assert_close, count_models, records, step_records
from dpo.cli import main
from dpo.losses import LossConfig
from dpo.config import TrainConfig
from dpo.recipe import latest_checkpoint, run_train
from runtime.errors import JobError
from schemas.stamps import model_hash, tokenizer_hash
from storage.reads import file_sha256

LN2 = math.log(2)
BASE = dict(use_cpu=True, learning_rate=1e-3, per_device_train_batch_size=4, logging_steps=1, seed=7, plot=False)
METRIC_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "logratio/chosen", "lengths/chosen", "grad_norm", "learning_rate")
NOT_COMPARED = ("runtime", "per_second", "epoch")  # wall-clock and epoch bookkeeping


def train(model, data, out, **kwargs) -> dict:
    return run_train(TrainConfig(model=str(model), data=str(data), output_dir=str(out), **{**BASE, **kwargs}),
                     log=lambda m: None)


# ---------------------------------------------------------------------------------------------------------------
# one cached and one live run of 20 steps, shared by several tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory, llama_dir, dpo_data, dpo_cache):
    root = tmp_path_factory.mktemp("train-runs")
    with count_models() as built_cached:
        cached = train(llama_dir, dpo_data, root / "cached", ref_cache=str(dpo_cache), max_steps=20, plot=True)
    with count_models() as built_live:
        live = train(llama_dir, dpo_data, root / "live", ref_model=str(llama_dir), max_steps=20)
    return {"cached": (root / "cached", cached, built_cached), "live": (root / "live", live, built_live)}


def test_first_step_loss_is_ln2_when_policy_starts_at_reference(runs):
    for mode in ("cached", "live"):
        first = step_records(runs[mode][0])[1]
        assert abs(first["loss"] - LN2) < 1e-6, (mode, first["loss"])
        assert abs(first["rewards/margins"]) < 1e-6
        assert abs(first["logratio/chosen"]) < 1e-6


def test_cached_and_live_reference_give_the_same_metrics(runs):
    cached, live = records(runs["cached"][0]), records(runs["live"][0])
    assert [r["step"] for r in cached] == [r["step"] for r in live]
    assert sorted(step_records(runs["cached"][0])) == list(range(1, 21))
    compared = 0
    for a, b in zip(cached, live):
        assert set(a) == set(b)
        for key, value in a.items():
            if isinstance(value, (int, float)) and not any(word in key for word in NOT_COMPARED):
                assert_close(value, b[key], f"step {a['step']} {key}")
                compared += 1
    assert compared >= 20 * len(METRIC_KEYS)
    # The runs did train: the loss moved well away from ln 2, so agreement is not agreement of two idle runs.
    assert step_records(runs["cached"][0])[20]["loss"] < LN2 - 0.05
    assert runs["cached"][1]["train_loss"] == pytest.approx(runs["live"][1]["train_loss"], abs=1e-6)


def test_cached_run_builds_one_model_and_live_run_two(runs):
    assert sorted(runs["cached"][2]) == ["LlamaForCausalLM", "LlamaModel"]
    assert sorted(runs["live"][2]) == ["LlamaForCausalLM", "LlamaForCausalLM", "LlamaModel", "LlamaModel"]


def test_output_is_a_loadable_checkpoint_with_changed_weights(runs, llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = runs["cached"][0]
    assert (out / "model.safetensors").is_file()
    assert not list(out.glob("pytorch_model*.bin"))
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    a, b = trained.state_dict(), start.state_dict()
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape for k in a)
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert len(changed) > len(a) // 2
    tok = AutoTokenizer.from_pretrained(out)
    assert tokenizer_hash(tok) == tokenizer_hash(AutoTokenizer.from_pretrained(llama_dir))
    assert model_hash(out) != model_hash(llama_dir)


def test_run_manifest(runs, llama_dir, dpo_data, dpo_cache):
    from runtime.data import load_rows

    out, summary, _ = runs["cached"]
    m = json.loads((out / "run-manifest.json").read_text())
    cache_manifest = json.loads((dpo_cache / "manifest.json").read_text())
    assert m["initial_model"]["model_hash"] == model_hash(llama_dir) == cache_manifest["stamps"]["model_hash"]
    assert m["reference"]["cache"]["manifest_sha256"] == file_sha256(dpo_cache / "manifest.json")
    assert m["reference"]["cache"]["stamps"] == cache_manifest["stamps"]
    assert m["reference"]["live_model"] is None
    assert m["data"]["fingerprint"] == load_rows(dpo_data).fingerprint
    assert m["data"]["rows"] == DPO_PAIRS
    assert m["config"]["max_steps"] == 20 and m["config"]["beta"] == 0.1 and m["config"]["loss_type"] == "sigmoid"
    assert m["config"]["ref_cache"] == str(dpo_cache)
    assert m["seed"] == 7
    assert {"torch", "transformers", "python"} <= set(m["software"])
    assert m["final_model_hash"] == model_hash(out) == summary["final_model_hash"]
    assert m["result"]["steps"] == 20

    live = json.loads((runs["live"][0] / "run-manifest.json").read_text())
    assert live["reference"]["cache"] is None and live["reference"]["eval_cache"] is None
    assert live["reference"]["live_model"] == {"path": str(llama_dir), "model_hash": model_hash(llama_dir)}
    assert live["initial_model"]["model_hash"] == m["initial_model"]["model_hash"]


def test_metrics_file_and_plot(runs):
    out = runs["cached"][0]
    steps = step_records(out)
    for step, record in steps.items():
        missing = [k for k in METRIC_KEYS if k not in record]
        assert not missing, (step, missing)
        assert all(math.isfinite(record[k]) for k in METRIC_KEYS)
        assert 0 <= record["rewards/accuracies"] <= 1
        assert record["logps/chosen"] < 0
    # the learning rate follows the linear schedule from 1e-3 towards 0
    assert steps[1]["learning_rate"] == pytest.approx(1e-3)
    assert steps[20]["learning_rate"] < steps[10]["learning_rate"] < steps[1]["learning_rate"]
    png = out / "metrics.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (runs["live"][0] / "metrics.png").exists()  # plot=False there


def test_model_card_of_a_full_model_run(runs, dpo_cache):
    """Issue 25 item 8 (LoRA runs: test_model_card.py): README.md names the cache's identity, the data, the options
    and the final metrics with the plot; a live run says it had no cache."""
    from huggingface_hub import ModelCard

    out = runs["cached"][0]
    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers" and meta["tags"] == ["dpo", "refcache"]
    m = json.loads((out / "run-manifest.json").read_text())
    cache = m["reference"]["cache"]
    for value in (cache["cache_id"], file_sha256(dpo_cache / "manifest.json"), *cache["stamps"].values(),
                  m["data"]["fingerprint"], m["final_model_hash"]):
        assert f"`{value}`" in card.text, value
    assert f"| loss | {step_records(out)[20]['loss']:.4g} |" in card.text
    assert "](metrics.png)" in card.text and "| `learning_rate` | `0.001` |" in card.text
    live = ModelCard.load(runs["live"][0] / "README.md")
    assert "A live reference model, no cache" in live.text and "adapter disabled" not in live.text
    assert "cache_id" not in live.text and "metrics.png" not in live.text  # plot=False


# ---------------------------------------------------------------------------------------------------------------
# resume, gradient accumulation, other losses


def _cli(args: list[str]):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_resume_from_checkpoint_reaches_the_same_final_step(tmp_path, llama_dir, dpo_data, dpo_cache):
    full = tmp_path / "full"
    summary = train(llama_dir, dpo_data, full, ref_cache=str(dpo_cache), max_steps=6, save_steps=3)
    assert summary["steps"] == 6
    assert (full / "checkpoint-3").is_dir() and (full / "checkpoint-6").is_dir()

    resumed = tmp_path / "resumed"  # a copy of the run (record and checkpoint-3): a resume continues in its own dir
    resumed.mkdir()
    shutil.copy(full / "refcache-run.json", resumed)
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    result = _cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", resumed,
                   "--max-steps", 6, "--save-steps", 3, "--use-cpu", "--learning-rate", 1e-3,
                   "--per-device-train-batch-size", 4, "--logging-steps", 1, "--seed", 7, "--no-plot",
                   "--resume-from-checkpoint", resumed / "checkpoint-3"])
    assert result.exit_code == 0, result.output
    assert "trained 6 steps" in result.output
    manifest = json.loads((resumed / "run-manifest.json").read_text())
    assert manifest["result"]["steps"] == 6
    a, b = step_records(full), step_records(resumed)
    assert sorted(b) == [4, 5, 6]  # only the steps after the checkpoint were run
    for step in (4, 5, 6):
        for key in METRIC_KEYS:
            assert_close(a[step][key], b[step][key], f"step {step} {key}")
    # Optimizer, scheduler and data order were restored: the final weights are those of the uninterrupted run.
    assert manifest["final_model_hash"] == model_hash(full)


def test_gradient_accumulation_matches_a_larger_batch(tmp_path, llama_dir, dpo_data, dpo_cache):
    big = tmp_path / "big"
    acc = tmp_path / "acc"
    train(llama_dir, dpo_data, big, ref_cache=str(dpo_cache), max_steps=2, per_device_train_batch_size=8,
          gradient_accumulation_steps=1)
    train(llama_dir, dpo_data, acc, ref_cache=str(dpo_cache), max_steps=2, per_device_train_batch_size=4,
          gradient_accumulation_steps=2)
    a, b = step_records(big), step_records(acc)
    # Step 1 sees the same 8 pairs (the sampler's order is the same), as one batch or as two micro-batches.
    for key in METRIC_KEYS:
        assert_close(a[1][key], b[1][key], f"step 1 {key}")
    # The accumulated gradient equals the big batch's, so the second step starts from the same weights.
    for key in METRIC_KEYS:
        assert_close(a[2][key], b[2][key], f"step 2 {key}", tol=1e-5)
    assert a[2]["loss"] != pytest.approx(LN2, abs=1e-3)


def _expected_rpo_first_step(dpo_cache: Path, alpha: float) -> float:
    """ln 2 plus alpha times the mean over all pairs of the chosen completion's mean per-token NLL, from the cache
    (at step 1 the policy equals the reference, so the policy's log-probs are the cached ones)."""
    nll = []
    for shard in sorted(dpo_cache.glob("*.parquet")):
        for values in pq.read_table(shard, columns=["chosen_logps"]).column("chosen_logps").to_pylist():
            nll.append(-sum(values) / len(values))
    assert len(nll) == DPO_PAIRS
    return LN2 + alpha * sum(nll) / len(nll)


@pytest.mark.parametrize("options,first", [
    ({"loss_type": "ipo"}, lambda cache: (1 / (2 * 0.1)) ** 2),
    ({"loss_type": "hinge"}, lambda cache: 1.0),
    ({"loss_type": "apo_zero"}, lambda cache: 1.0),
    ({"loss_type": "sigmoid", "ld_alpha": 0.5}, lambda cache: LN2),
    ({"loss_type": "sigmoid", "rpo_alpha": 0.5}, lambda cache: _expected_rpo_first_step(cache, 0.5)),
], ids=["ipo", "hinge", "apo_zero", "ld_alpha", "rpo_alpha"])
def test_other_losses_train_end_to_end(tmp_path, llama_dir, dpo_data, dpo_cache, options, first):
    out = tmp_path / "out"
    # One batch holds every pair, so step 1's loss is a value over the whole data set that we can compute.
    summary = train(llama_dir, dpo_data, out, ref_cache=str(dpo_cache), max_steps=4,
                    per_device_train_batch_size=DPO_PAIRS, **options)
    assert summary["steps"] == 4
    steps = step_records(out)
    assert sorted(steps) == [1, 2, 3, 4]
    losses = [steps[s]["loss"] for s in (1, 2, 3, 4)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(first(dpo_cache), abs=1e-5)
    assert losses[-1] < losses[0]  # full-batch steps on the same data lower the loss
    manifest = json.loads((out / "run-manifest.json").read_text())
    assert all(manifest["config"][k] == v for k, v in options.items())


def test_loss_config_takes_every_loss_option_by_name():
    """Each LossConfig field comes from the TrainConfig option of the same name (set apart from its default)."""
    given = {"beta": 0.3, "loss_type": "ipo", "label_smoothing": 0.2, "rpo_alpha": 0.5, "ld_alpha": 0.7,
             "tdpo_alpha": 0.2, "kl_coef": 0.1, "beta_dpo_alpha": 1.0, "beta_dpo_rho": 0.3, "beta_dpo_momentum": 0.5}
    assert set(given) == {f.name for f in dataclasses.fields(LossConfig)}  # a new loss option: add it here too
    assert all(given[k] != getattr(LossConfig(), k) for k in given)
    cfg = TrainConfig(model="m", data="d", output_dir="o", **given)
    assert cfg.loss_config() == LossConfig(**given)


# ---------------------------------------------------------------------------------------------------------------
# issue 16 (what a TRL user expects): --resume-from-checkpoint true, the eval split, the progress bar, trackers


def test_resume_true_means_the_latest_checkpoint(tmp_path):
    for n in (5, 20, 10):
        (tmp_path / f"checkpoint-{n}").mkdir()
    assert latest_checkpoint("true", tmp_path) == str(tmp_path / "checkpoint-20")
    assert latest_checkpoint("False", tmp_path) is None
    assert latest_checkpoint(str(tmp_path / "checkpoint-5"), tmp_path) == str(tmp_path / "checkpoint-5")
    with pytest.raises(JobError, match="no checkpoint-N folder"):
        latest_checkpoint("true", tmp_path / "empty")


def test_eval_data_without_its_cache_says_what_to_run(tmp_path, llama_dir, dpo_data, dpo_cache):
    assert TrainConfig(model="m", data="d", output_dir="o").eval_split == "test"
    cfg = TrainConfig(model=str(llama_dir), data=str(dpo_data), output_dir=str(tmp_path / "o"),
                      ref_cache=str(dpo_cache), eval_data=str(tmp_path / "eval.jsonl"), use_cpu=True)
    with pytest.raises(JobError, match=r"run `precompute-ref --model .* --split test --out EVAL_CACHE`.*--eval-ref-cache"):
        run_train(cfg)
    assert not (tmp_path / "o").exists()


def test_progress_bar_is_on():
    from runtime.cli import quiet_libraries

    quiet_libraries()
    assert TrainConfig(model="m", data="d", output_dir="o", use_cpu=True).training_arguments().disable_tqdm is False


def test_missing_tracker_is_refused_first(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    cfg = TrainConfig(model=str(tmp_path / "no-model"), data="d", output_dir=str(tmp_path / "o"),
                      ref_cache=str(tmp_path / "no-cache"), report_to="wandb", use_cpu=True)
    with pytest.raises(JobError, match=r"--report-to wandb: the wandb package is not installed; install it with `pip install wandb`"):
        run_train(cfg)
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "tensorboard" in extras["project"]["optional-dependencies"]


# ---------------------------------------------------------------------------------------------------------------
# a live reference split by --ref-device-map (issue 27): accelerate's dispatch, CPU memory then disk


@pytest.fixture(scope="module")
def other_reference(tmp_path_factory, tokenizer) -> Path:
    """A reference that is not the policy (another seed, the same tokenizer): step 1's loss is not ln 2, so the
    reference's own values decide every metric."""
    from conftest import build_llama, save_checkpoint

    return save_checkpoint(build_llama(len(tokenizer), seed=11), tokenizer, tmp_path_factory.mktemp("other-ref"))


@pytest.mark.parametrize("layout", ["auto", "padded"])
def test_live_reference_split_with_disk_offload_trains_as_in_memory(tmp_path, llama_dir, dpo_data, other_reference,
                                                                     dpo_cache, layout):
    """Both batch layouts through the split reference; auto picks prefix_shared only after its probe against the
    model's own forward passes on the split model itself."""
    weights = sum(p.stat().st_size for p in other_reference.glob("*.safetensors"))
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "mine.txt").write_text("the user's\n")  # a folder in use: only the run's own subfolder is removed
    steps = dict(ref_model=str(other_reference), max_steps=4, batch_layout=layout)
    in_memory = train(llama_dir, dpo_data, tmp_path / "in-memory", **steps)
    lines = []
    split = run_train(TrainConfig(model=str(llama_dir), data=str(dpo_data), output_dir=str(tmp_path / "split"),
                                  **{**BASE, **steps}, ref_device_map="auto", ref_max_memory=str(weights * 2 // 3),
                                  ref_offload_folder=str(offload)), log=lines.append)
    said = "\n".join(lines)
    assert "live reference: device map auto" in said and "disk:" in said, said

    a, b = step_records(tmp_path / "in-memory"), step_records(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert abs(a[1]["loss"] - LN2) > 1e-3  # the reference is not the policy: its values shape every metric
    for step in a:
        for key in METRIC_KEYS:
            assert_close(a[step][key], b[step][key], f"step {step} {key}", tol=1e-5)
    assert split["train_loss"] == pytest.approx(in_memory["train_loss"], abs=1e-5)
    assert split["batch_layout"] == in_memory["batch_layout"] == ("prefix_shared" if layout == "auto" else "padded")
    if layout == "auto":  # the probe ran with the split reference among the models it checks
        assert "batch layout: prefix_shared" in said and "matches the plain forward on a probe" in said, said

    manifest = json.loads((tmp_path / "split" / "run-manifest.json").read_text())
    live = manifest["reference"]["live_model"]
    assert live["path"] == str(other_reference) and live["model_hash"] == model_hash(other_reference)
    layout = live["layout"]
    assert layout["device_map"] == "auto" and layout["max_memory"] == f"cpu={weights * 2 // 3}"
    assert set(layout["modules"]) == {"cpu", "disk"} and layout["modules"]["disk"]  # split between memory and disk
    assert "layout" not in json.loads((tmp_path / "in-memory" / "run-manifest.json").read_text())["reference"][
        "live_model"]
    assert manifest["config"]["ref_device_map"] == "auto"
    assert [p.name for p in offload.iterdir()] == ["mine.txt"]  # the run's own offload folder is gone, nothing else
    card = " ".join((tmp_path / "split" / "README.md").read_text().split())  # the model card says so too
    assert "A live reference model, no cache" in card and "split by device map auto" in card, card
    assert "split by" not in (tmp_path / "in-memory" / "README.md").read_text()

    # audit-ref --run names the split of the live reference the run was trained against
    from conftest import audit_ref

    code, report, output = audit_ref(dpo_cache, "--run", tmp_path / "split", json_path=tmp_path / "audit.json")
    assert code == 1 and "live reference" in output, output
    assert "split by device map auto" in " ".join(output.split()) and "disk: " in output, output
