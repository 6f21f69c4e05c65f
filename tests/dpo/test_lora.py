"""LoRA policies (train-dpo --use-peft): cached vs adapter-disabled live reference on data/, preference accuracy on
data/, the step-0 loss with LoRA dropout, --init-adapter and precompute-ref --adapter (checked against a merge done
by hand), resume, --merge-adapter, the run manifest's peft section with audit-ref --run, and the refusals."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

from conftest import DATA, assert_close, count_models, make_lora_adapter, records, step_records
from dpo.cli import main as train_main, summary_text
from dpo.lora import LoraOptions
from dpo.config import TrainConfig
from dpo.recipe import run_train
from schemas.stamps import adapter_hash, merged_model_hash, model_hash, reference_model_hash

peft = pytest.importorskip("peft")

LN2 = math.log(2)
BASE = dict(use_cpu=True, logging_steps=1, seed=7, plot=False)
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected", "logratio/chosen", "logratio/rejected", "grad_norm", "learning_rate")


def train(model, data, out, lora: LoraOptions | None = None, **kwargs) -> dict:
    cfg = TrainConfig(model=str(model), data=str(data), output_dir=str(out), **{**BASE, **kwargs},
                      lora=lora or LoraOptions(use_peft=True))
    return run_train(cfg, log=lambda m: None)


def cli(args) -> Result:
    return CliRunner().invoke(train_main, [str(a) for a in args], catch_exceptions=False)


def precompute(model, data, out, split="train", adapter=None) -> Path:
    from precompute.job import PrecomputeConfig, run_precompute

    run_precompute(PrecomputeConfig(model=str(model), data=str(data), out=str(out), split=split, adapter=adapter,
                                    progress=False), log=lambda m: None)
    return out


# ---------------------------------------------------------------------------------------------------------------
# data/: one cached and one live LoRA run of 10 steps, with eval at the start and the end


@pytest.fixture(scope="module")
def data_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-data")
    model, prefs = DATA / "sft-model", DATA / "prefs"
    train_cache = precompute(model, prefs, root / "cache-train")
    eval_cache = precompute(model, prefs, root / "cache-eval", split="test")
    common = dict(eval_data=str(prefs), eval_split="test", eval_on_start=True, eval_steps=10, max_steps=10,
                  learning_rate=2e-3, per_device_train_batch_size=16, per_device_eval_batch_size=50)
    with count_models() as built_cached:
        cached = train(model, prefs, root / "cached", ref_cache=str(train_cache), eval_ref_cache=str(eval_cache),
                       **common)
    with count_models() as built_live:
        live = train(model, prefs, root / "live", ref_model=str(model), **common)
    return {"cached": (root / "cached", cached, built_cached), "live": (root / "live", live, built_live),
            "cache": train_cache}


def test_lora_cached_and_live_give_the_same_loss_and_metrics(data_runs):
    cached, live = records(data_runs["cached"][0]), records(data_runs["live"][0])
    assert [r["step"] for r in cached] == [r["step"] for r in live]
    assert sorted(step_records(data_runs["cached"][0])) == list(range(1, 11))
    compared = 0
    for a, b in zip(cached, live):
        for key, value in a.items():
            # While the policy is the reference (eval at step 0, train step 1) every margin is a tie, exactly 0 live
            # and +-1e-8 against the cache (the cache's batching differs in the last bits): the accuracy counts
            # the sign of that noise, so there the margins are compared instead.
            if key.endswith("rewards/accuracies") and a["step"] <= 1:
                continue
            if key.removeprefix("eval_") in COMPARED:
                assert_close(value, b[key], f"step {a['step']} {key}")
                compared += 1
    assert compared >= 10 * len(COMPARED)
    # it trained: the loss left ln 2, so this is not the agreement of two idle runs
    assert step_records(data_runs["cached"][0])[10]["loss"] < LN2 - 0.1


def test_lora_builds_exactly_one_model_cached_and_live(data_runs):
    assert sorted(data_runs["cached"][2]) == ["LlamaForCausalLM", "LlamaModel"]
    assert sorted(data_runs["live"][2]) == ["LlamaForCausalLM", "LlamaModel"]  # reference = adapter disabled


def test_lora_step0_loss_is_ln2_with_lora_dropout(data_runs):
    for mode in ("cached", "live"):
        first = step_records(data_runs[mode][0])[1]
        assert abs(first["loss"] - LN2) < 1e-6, (mode, first["loss"])
        assert abs(first["logratio/chosen"]) < 1e-6
    assert json.loads((data_runs["cached"][0] / "adapter_config.json").read_text())["lora_dropout"] == 0.05


def test_lora_eval_preference_accuracy_rises_from_chance(data_runs):
    out, summary, _ = data_runs["cached"]
    start = summary["eval_start"]
    assert 0.3 <= start["eval_logps/accuracies"] <= 0.7  # the SFT model prefers chosen on about half the pairs
    assert start["eval_loss"] == pytest.approx(LN2, abs=1e-6)
    assert summary["steps"] == 10
    assert summary["eval"]["eval_rewards/accuracies"] >= 0.9


def test_lora_outputs_an_adapter_and_a_peft_manifest(data_runs):
    out, summary, _ = data_runs["cached"]
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists() and not list(out.glob("*model*.bin"))  # adapter only, safetensors
    m = json.loads((out / "run-manifest.json").read_text())
    base = model_hash(DATA / "sft-model")
    assert m["peft"]["base_model_hash"] == base == m["peft"]["reference_model_hash"]
    assert m["reference"]["cache"]["stamps"]["model_hash"] == base
    assert m["peft"]["final_adapter_hash"] == adapter_hash(out)
    assert m["peft"]["adapter_config"]["r"] == 16 and m["peft"]["init_adapter"] is None
    assert m["final_model_hash"] is None  # no merged model written
    # the adapter moved: lora_B is no longer zero
    weights = load_file(out / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in weights.items())


# ---------------------------------------------------------------------------------------------------------------
# --init-adapter / precompute-ref --adapter, on the tiny test model


def merged_by_hand(model_dir: Path, adapter: Path):
    """W + (alpha / r) B A for every adapted weight, without peft."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(adapter / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    done = 0
    for key, a in tensors.items():
        if ".lora_A." in key:
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            with torch.no_grad():
                params[target] += scale * (b @ a)
            done += 1
    assert done > 0
    return model


@pytest.fixture(scope="module")
def adapter_world(tmp_path_factory, llama_dir, dpo_data):
    root = tmp_path_factory.mktemp("lora-init")
    adapter = make_lora_adapter(llama_dir, root / "sft-lora")
    cache = precompute(llama_dir, dpo_data, root / "cache-merged", adapter=str(adapter))
    return {"root": root, "adapter": adapter, "cache": cache}


def test_precompute_with_adapter_stamps_base_plus_adapter_and_matches_a_hand_merge(adapter_world, llama_dir):
    import polars as pl

    from runtime.logprobs import completion_logps, pad_sequences

    cache, adapter = adapter_world["cache"], adapter_world["adapter"]
    manifest = json.loads((cache / "manifest.json").read_text())
    stamp = manifest["stamps"]["model_hash"]
    assert stamp == merged_model_hash(model_hash(llama_dir), adapter_hash(adapter)) == reference_model_hash(
        llama_dir, adapter)
    assert stamp != model_hash(llama_dir)
    assert manifest["model"]["adapter"] == str(adapter)
    rows = pl.read_parquet(sorted(cache.glob("*.parquet"))[0]).head(6)
    model = merged_by_hand(llama_dir, adapter)
    prompts, chosen = rows["prompt_input_ids"].to_list(), rows["chosen_input_ids"].to_list()
    ids, mask = pad_sequences([p + c for p, c in zip(prompts, chosen)], 0)
    with torch.no_grad():  # the model's own forward, plain log_softmax, one row at a time, no padding
        want = []
        for p, c in zip(prompts, chosen):
            logits = model(torch.tensor([p + c])).logits[0].float().log_softmax(-1)
            want += [logits[len(p) - 1 + i, t].item() for i, t in enumerate(c)]
    got = [v for row in rows["chosen_logps"].to_list() for v in row]
    assert len(got) == len(want)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    # and the adapter matters: the plain base gives other numbers
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_vals = completion_logps(plain, ids, mask, torch.tensor([len(p) for p in prompts]),
                                     torch.tensor([len(c) for c in chosen]))
    assert max(abs(a - b) for a, b in zip(got, base_vals.tolist())) > 1e-3


def test_init_adapter_with_its_merged_cache_starts_at_ln2(adapter_world, llama_dir, dpo_data, dpo_cache):
    out = adapter_world["root"] / "run-init"
    lora = LoraOptions(use_peft=True, lora_r=4, lora_dropout=0.1, init_adapter=str(adapter_world["adapter"]))
    train(llama_dir, dpo_data, out, lora, ref_cache=str(adapter_world["cache"]), max_steps=3, learning_rate=1e-3,
          per_device_train_batch_size=4)
    first = step_records(out)[1]
    assert abs(first["loss"] - LN2) < 1e-6 and abs(first["logratio/chosen"]) < 1e-6
    m = json.loads((out / "run-manifest.json").read_text())
    assert m["peft"]["init_adapter"]["adapter_hash"] == adapter_hash(adapter_world["adapter"])
    assert m["peft"]["reference_model_hash"] == json.loads((adapter_world["cache"] / "manifest.json").read_text())[
        "stamps"]["model_hash"]


def test_init_adapter_against_a_base_cache_is_refused_naming_the_remedy(adapter_world, llama_dir, dpo_data, dpo_cache,
                                                                        tmp_path):
    adapter = adapter_world["adapter"]
    result = cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "o",
                  "--use-cpu", "--use-peft", "--init-adapter", adapter])
    assert result.exit_code == 2
    assert "holds the base without the adapter" in result.output
    assert f"precompute-ref --model {llama_dir} --adapter {adapter}" in result.output
    assert not (tmp_path / "o").exists()
    # the other way round: a merged cache without --init-adapter
    result = cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", adapter_world["cache"], "--output-dir",
                  tmp_path / "o", "--use-cpu", "--use-peft"])
    assert result.exit_code == 2
    assert "with --use-peft the reference is the base checkpoint" in result.output
    assert "pass --init-adapter" in result.output


def test_adapter_hash_rule(adapter_world, llama_dir, tmp_path):
    adapter = adapter_world["adapter"]
    h = adapter_hash(adapter)
    # module lists are sets: their order in adapter_config.json does not matter; the base path does not either
    copy = tmp_path / "copy"
    copy.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config["target_modules"], reverse=True)
    config["base_model_name_or_path"] = "/elsewhere"
    (copy / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file(tensors, copy / "adapter_model.safetensors")
    assert adapter_hash(copy) == h
    config["lora_alpha"] = 16  # behaviour: a different scale
    (copy / "adapter_config.json").write_text(json.dumps(config))
    assert adapter_hash(copy) != h
    config["lora_alpha"] = json.loads((adapter / "adapter_config.json").read_text())["lora_alpha"]
    (copy / "adapter_config.json").write_text(json.dumps(config))
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] += 1e-3
    save_file(tensors, copy / "adapter_model.safetensors")
    assert adapter_hash(copy) != h
    assert merged_model_hash(model_hash(llama_dir), h) != merged_model_hash(model_hash(llama_dir), adapter_hash(copy))


# ---------------------------------------------------------------------------------------------------------------
# resume, --merge-adapter, audit-ref --run


def test_resume_a_lora_run_reaches_the_same_adapter(tmp_path, llama_dir, dpo_data, dpo_cache):
    common = dict(ref_cache=str(dpo_cache), max_steps=6, save_steps=3, learning_rate=1e-3,
                  per_device_train_batch_size=4)
    full = tmp_path / "full"
    train(llama_dir, dpo_data, full, **common)
    assert (full / "checkpoint-3" / "adapter_model.safetensors").is_file()
    resumed = tmp_path / "resumed"  # a copy of the run (record and checkpoint-3): a resume continues in its own dir
    resumed.mkdir()
    shutil.copy(full / "refcache-run.json", resumed)
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    train(llama_dir, dpo_data, resumed, resume_from_checkpoint=str(resumed / "checkpoint-3"), **common)
    assert sorted(step_records(resumed)) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert_close(step_records(full)[step][key], step_records(resumed)[step][key], f"step {step} {key}")
    assert adapter_hash(resumed) == adapter_hash(full)
    assert json.loads((resumed / "run-manifest.json").read_text())["peft"]["final_adapter_hash"] == adapter_hash(full)


def test_merge_adapter_writes_the_merged_model_and_audit_checks_the_run(tmp_path, llama_dir, dpo_data, dpo_cache):
    from transformers import AutoModelForCausalLM

    from audit.cli import main as audit_main

    out = tmp_path / "run"
    lora = LoraOptions(use_peft=True, lora_r=4, merge_adapter=True)
    summary = train(llama_dir, dpo_data, out, lora, ref_cache=str(dpo_cache), max_steps=3, learning_rate=1e-2,
                    per_device_train_batch_size=4)
    assert f"merged:     {out / 'merged'}" in summary_text(summary)  # issue 25 item 11: listed in the summary
    m = json.loads((out / "run-manifest.json").read_text())
    assert m["final_model_hash"] == m["peft"]["merged_model_hash"] == model_hash(out / "merged")
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([[1, 5, 9, 17, 33, 2]])
    with torch.no_grad():
        a, b = merged(ids).logits, with_adapter(ids).logits
        assert (a - b).abs().max() < 1e-4
        with with_adapter.disable_adapter():
            assert (with_adapter(ids).logits - a).abs().max() > 1e-4  # the adapter did change the model

    def audit(run):
        report = tmp_path / "audit.json"
        result = CliRunner().invoke(audit_main, [str(dpo_cache), "--run", str(run), "--json", str(report)])
        return result.exit_code, {c["name"]: c for c in json.loads(report.read_text())["checks"]}

    code, checks = audit(out)
    assert code == 0, checks
    assert checks["run_cache"]["status"] == "PASS" and checks["run_final_hash"]["status"] == "PASS"
    assert "matches final_adapter_hash" in checks["run_final_hash"]["detail"] and "merged/" in checks[
        "run_final_hash"]["detail"]
    path = out / "run-manifest.json"
    original = path.read_text()
    forged = json.loads(original)
    forged["peft"]["reference_model_hash"] = "0" * 64  # a run that claims another reference than its base
    path.write_text(json.dumps(forged))
    code, checks = audit(out)
    assert code == 1 and "is not the base" in checks["run_final_hash"]["detail"]
    path.write_text(original)
    tensors = load_file(out / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = tensors[key] + 1e-3
    save_file(tensors, out / "adapter_model.safetensors")
    code, checks = audit(out)
    assert code == 1
    assert checks["run_final_hash"]["status"] == "FAIL" and "hashes to" in checks["run_final_hash"]["detail"]


# ---------------------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("flag", ["--load-in-4bit", "--load-in-8bit"])
def test_quantized_loading_is_refused_on_cpu_naming_the_reason(tmp_path, llama_dir, dpo_data, dpo_cache, flag):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "o",
                  "--use-peft", flag])
    assert result.exit_code == 2
    assert f"{flag} needs a CUDA GPU" in result.output
    assert not (tmp_path / "o").exists()


def test_lora_options_without_use_peft_are_refused(tmp_path, llama_dir, dpo_data, dpo_cache):
    result = cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "o",
                  "--merge-adapter"])
    assert result.exit_code == 2 and "--merge-adapter only apply to a LoRA policy; add --use-peft" in result.output


def test_missing_peft_names_the_extra(tmp_path, llama_dir, dpo_data, dpo_cache, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    result = cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "o",
                  "--use-peft"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "error: --use-peft needs the peft package, which is not installed: pip install 'refcache[peft]'")


def test_live_lora_with_another_reference_is_refused(tmp_path, llama_dir, gpt2_dir, dpo_data):
    result = cli(["--model", llama_dir, "--data", dpo_data, "--ref-model", gpt2_dir, "--output-dir", tmp_path / "o",
                  "--use-cpu", "--use-peft"])
    assert result.exit_code == 2 and "the live reference is --model with the adapter disabled" in result.output


def test_lora_options_come_from_the_command_line_and_config_files(tmp_path):
    from dpo.cli import resolve_config

    path = tmp_path / "run.yaml"
    path.write_text("use_peft: true\nlora-r: 4\nlora_dropout: 0.1\nlora_target_modules: q_proj,v_proj\n")
    cfg = resolve_config(str(path), {"model": "m", "data": "d", "output_dir": "o", "lora_r": 8, "lora_alpha": None})
    assert cfg.lora == LoraOptions(use_peft=True, lora_r=8, lora_dropout=0.1, lora_target_modules="q_proj,v_proj")
    assert not hasattr(cfg, "lora_r")


def test_lora_target_modules_all_linear_is_peft_s_special_value(tmp_path, llama_dir, dpo_data, dpo_cache):
    """`--lora-target-modules all-linear` (the default --help names, TRL's usual recipe value) adapts the same
    modules as the default; mixed with module names it is refused naming why."""
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--use-peft", "--use-cpu",
            "--max-steps", "1", "--per-device-train-batch-size", "4", "--no-plot"]
    given = cli([*args, "--output-dir", tmp_path / "given", "--lora-target-modules", "all-linear"])
    assert given.exit_code == 0, given.output
    default = cli([*args, "--output-dir", tmp_path / "default"])
    assert default.exit_code == 0, default.output
    modules = [sorted(json.loads((tmp_path / d / "adapter_config.json").read_text())["target_modules"])
               for d in ("given", "default")]
    assert modules[0] == modules[1]
    assert {m.rsplit(".", 1)[-1] for m in modules[0]} >= {"q_proj", "v_proj", "down_proj"}
    mixed = cli([*args, "--output-dir", tmp_path / "mixed", "--lora-target-modules", "all-linear,q_proj"])
    assert mixed.exit_code == 2 and "all-linear already names every linear layer" in mixed.output


def test_lora_with_gradient_checkpointing_shows_no_library_deprecation_notice(tmp_path, llama_dir, dpo_data,
                                                                             dpo_cache):
    """Found by the UX pass: `--use_peft --gradient_checkpointing True` printed transformers' FutureWarning about
    `is_gradient_checkpointing` (peft asks the deprecated property): nothing a user can act on. The run trains and
    that notice is not shown; warnings that are ours or a user's to act on are not silenced with it."""
    import warnings

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        result = CliRunner().invoke(train_main, [str(a) for a in (
            "--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "run",
            "--use-cpu", "--max-steps", 1, "--per-device-train-batch-size", 4, "--no-plot", "--use_peft",
            "--gradient_checkpointing", "True")])
        warnings.warn("a user's own notice", FutureWarning)
    assert result.exit_code == 0, result.output
    texts = [str(w.message) for w in shown]
    assert not any("is_gradient_checkpointing" in t for t in texts), texts
    assert "a user's own notice" in texts
