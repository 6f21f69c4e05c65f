"""Issue 22, "silently wrong", items 7-9: what a cache, a model and a reference are, across the three commands.

7. A cache is its content (schemas.run_manifest.cache_id: stamps, encoding, shard files): a rerun that changes no
   shard (no-op, --overwrite, a rescored damaged shard, another cwd) leaves a run trained on it resumable and
   auditable; a no-op rerun leaves manifest.json as it was.
8. With --trust-remote-code the model hash covers the folder's Python files: edited modeling code (logits doubled)
   makes the cache stale for train-dpo, audit-ref and a precompute-ref rerun; code that cannot be hashed is refused.
9. --ref-model and --ref-model-hash that disagree are refused, naming both hashes, before any cache is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from faultkit import (TRAIN, assert_one_paragraph, audit, check_of, copy_tree, edit_manifest, file_hashes,
                      manifest_of, precompute, train)
from schemas.stamps import model_hash
from support import make_custom_code_model, make_lora_adapter

PER_SHARD = 16  # dpo_cache's shards: 16, 16 and 8 rows
S1 = "shard-00001.parquet"


def two_steps(*args) -> list:
    """TRAIN, but 2 steps saving checkpoint-1 and checkpoint-2."""
    i = TRAIN.index("--max-steps")
    return [*args, *TRAIN[:i], *TRAIN[i + 2:], "--max-steps", "2", "--save-steps", "1", "--seed", "3"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, llama_dir, dpo_data):
    """A cache of dpo_data and a 2-step run on it (train and eval cache alike), with its checkpoint-1."""
    base = tmp_path_factory.mktemp("identity")
    cache = base / "cache"
    made = precompute("--model", llama_dir, "--data", dpo_data, "--rows-per-shard", PER_SHARD, "--out", cache)
    assert made.exit_code == 0, made.output
    args = two_steps("--model", llama_dir, "--data", dpo_data, "--ref-cache", cache, "--eval-data", dpo_data,
                     "--eval-split", "train", "--no-eval-on-start", "--eval-strategy", "no")
    run = train(*args, "--output-dir", base / "run")
    assert run.exit_code == 0, run.output
    return {"base": base, "cache": cache, "run": base / "run", "model": llama_dir, "data": dpo_data, "args": args}


def resume(trained, cache: Path, out: Path):
    """train-dpo resumed from the run's checkpoint-1 against `cache` (its copy of the run's output dir)."""
    run = copy_tree(trained["run"], out)
    args = [cache if a == trained["cache"] else a for a in trained["args"]]
    return train(*args, "--output-dir", run, "--resume-from-checkpoint", run / "checkpoint-1"), run


def audit_run(cache: Path, run: Path):
    code, report, output = audit(cache, "--run", run)
    return code, check_of(report, "run_cache"), output


# ---------------------------------------------------------------------------------------------------------------
# 7: a cache's identity is its content


def test_7_a_no_op_rerun_keeps_the_manifest_and_the_run_resumes(trained, tmp_path):
    cache = copy_tree(trained["cache"], tmp_path / "cache")
    edit_manifest(cache, lambda m: m.update(created_at="2001-01-01T00:00:00+00:00"))  # an older cache, same content
    before = file_hashes(cache)
    rerun = precompute("--model", trained["model"], "--data", trained["data"], "--rows-per-shard", PER_SHARD,
                       "--out", cache)
    assert rerun.exit_code == 0, rerun.output
    after = file_hashes(cache)
    after.pop(".refcache.lock", None), before.pop(".refcache.lock", None)
    assert after == before and manifest_of(cache)["created_at"].startswith("2001")  # nothing rewritten
    resumed, run = resume(trained, cache, tmp_path / "run")
    assert resumed.exit_code == 0, resumed.output
    code, check, output = audit_run(cache, run)
    assert code == 0 and check["status"] == "PASS", output


def test_7_overwrite_with_the_same_content_is_the_same_cache(trained, tmp_path):
    """Neighbour: --overwrite rewrites manifest.json (a new created_at), the shards come out the same: the run
    resumes, audit-ref --run passes, for the train and the eval cache alike."""
    record = json.loads((trained["run"] / "checkpoint-1" / "refcache-reference.json").read_text())
    assert record["cache"]["cache_id"] and record["eval_cache"]["cache_id"] == record["cache"]["cache_id"]
    cache = copy_tree(trained["cache"], tmp_path / "cache")
    edit_manifest(cache, lambda m: m.update(created_at="2001-01-01T00:00:00+00:00", software={"refcache": "0.0"}))
    sha = file_hashes(cache)["manifest.json"]
    rerun = precompute("--model", trained["model"], "--data", trained["data"], "--rows-per-shard", PER_SHARD,
                       "--out", cache, "--overwrite")
    assert rerun.exit_code == 0, rerun.output
    assert file_hashes(cache)["manifest.json"] != sha and not manifest_of(cache)["created_at"].startswith("2001")
    resumed, run = resume(trained, cache, tmp_path / "run")
    assert resumed.exit_code == 0, resumed.output
    code, check, output = audit_run(cache, run)
    assert code == 0 and check["status"] == "PASS" and "cache_id" in check["detail"], output


def test_7_a_rescored_damaged_shard_with_equal_content_is_the_same_cache(trained, tmp_path):
    """Neighbour: a damaged shard scored again gives the same file (sha256): the same cache."""
    cache = copy_tree(trained["cache"], tmp_path / "cache")
    clean = file_hashes(cache, "*.parquet")
    (cache / S1).write_bytes(b"not a parquet file")
    rerun = precompute("--model", trained["model"], "--data", trained["data"], "--rows-per-shard", PER_SHARD,
                       "--out", cache)
    assert rerun.exit_code == 0 and "scoring it again" in rerun.output, rerun.output
    assert file_hashes(cache, "*.parquet") == clean
    resumed, _ = resume(trained, cache, tmp_path / "run")
    assert resumed.exit_code == 0, resumed.output


def test_7_a_rerun_after_a_crash_before_the_manifest_is_the_same_cache(trained, tmp_path):
    """Neighbour: the manifest absent (killed after the last shard), the rerun keeps every shard and writes a new
    manifest: the same content, so the same cache for the run."""
    cache = copy_tree(trained["cache"], tmp_path / "cache")
    (cache / "manifest.json").unlink()
    rerun = precompute("--model", trained["model"], "--data", trained["data"], "--rows-per-shard", PER_SHARD,
                       "--out", cache)
    assert rerun.exit_code == 0 and "(0 scored now)" in rerun.output, rerun.output
    code, check, output = audit_run(cache, trained["run"])
    assert code == 0 and check["status"] == "PASS", output


def test_7_a_rerun_from_another_directory_changes_nothing(trained, tmp_path, monkeypatch):
    """Neighbour: the same job named by relative paths from another cwd (model.path, source.data recorded otherwise)
    leaves the manifest as it was; a cache with other shards is another cache for the run."""
    cache = copy_tree(trained["cache"], tmp_path / "cache")
    before = file_hashes(cache)["manifest.json"]
    monkeypatch.chdir(tmp_path)
    rerun = precompute("--model", os.path.relpath(trained["model"]), "--data", os.path.relpath(trained["data"]),
                       "--rows-per-shard", PER_SHARD, "--out", "cache")
    assert rerun.exit_code == 0, rerun.output
    assert file_hashes(cache)["manifest.json"] == before
    other = tmp_path / "other"
    made = precompute("--model", trained["model"], "--data", trained["data"], "--rows-per-shard", 7, "--out", other)
    assert made.exit_code == 0, made.output
    code, check, output = audit_run(other, trained["run"])
    assert code == 1 and check["status"] == "FAIL" and "cache_id" in check["detail"], output


# ---------------------------------------------------------------------------------------------------------------
# 8: custom model code is part of the model hash


@pytest.fixture(scope="module")
def custom(tmp_path_factory, llama_dir, dpo_data):
    """A custom-code Llama (logits x FACTOR from scale.py) and its cache, made with --trust-remote-code."""
    base = tmp_path_factory.mktemp("custom-code")
    model = make_custom_code_model(llama_dir, base / "model", factor=1.0)
    made = precompute("--model", model, "--data", dpo_data, "--rows-per-shard", PER_SHARD, "--out", base / "cache",
                      "--trust-remote-code")
    assert made.exit_code == 0, made.output
    return {"base": base, "model": model, "cache": base / "cache", "data": dpo_data}


def doubled(custom, tmp_path) -> Path:
    """The custom model with its code edited: the logits doubled, config and tensors unchanged."""
    model = copy_tree(custom["model"], tmp_path / "doubled")
    (model / "scale.py").write_text("FACTOR = 2.0\n")
    return model


def test_8_edited_model_code_makes_the_cache_stale_for_train_dpo(custom, llama_dir, tmp_path):
    assert manifest_of(custom["cache"])["stamps"]["model_hash"] != model_hash(llama_dir)  # the code is in it
    model = doubled(custom, tmp_path)
    out = tmp_path / "run"
    refused = train("--model", model, "--data", custom["data"], "--ref-cache", custom["cache"], "--trust-remote-code",
                    "--output-dir", out, *TRAIN)
    assert refused.exit_code == 2, refused.output
    assert "model_hash mismatch" in refused.output and model_hash(model) in refused.output
    assert_one_paragraph(refused.output)
    assert not out.exists()


def test_8_edited_model_code_is_caught_by_audit_ref_and_a_rerun(custom, tmp_path):
    """Neighbours: audit-ref --model fails model_hash; precompute-ref into the cache refuses it as another cache."""
    model = doubled(custom, tmp_path)
    code, report, output = audit(custom["cache"], "--model", model, "--trust-remote-code", "--sample", 0,
                                 json_path=tmp_path / "audit.json")
    assert code == 1 and check_of(report, "model_hash")["status"] == "FAIL", output
    cache = copy_tree(custom["cache"], tmp_path / "cache")
    before = file_hashes(cache)
    rerun = precompute("--model", model, "--data", custom["data"], "--rows-per-shard", PER_SHARD, "--out", cache,
                       "--trust-remote-code")
    assert rerun.exit_code == 2 and "already holds a different cache" in rerun.output, rerun.output
    assert "model_hash" in rerun.output and file_hashes(cache) == before


def test_8_a_trained_custom_model_is_audited_with_its_code(custom, tmp_path):
    """Neighbour: train-dpo's output holds the code (save_pretrained copies it) and its final_model_hash covers it:
    audit-ref --run passes, and fails once the output's code is edited."""
    run = tmp_path / "run"
    trained = train("--model", custom["model"], "--data", custom["data"], "--ref-cache", custom["cache"],
                    "--trust-remote-code", "--output-dir", run, *TRAIN)
    assert trained.exit_code == 0, trained.output
    assert (run / "modeling_scaled.py").is_file() and (run / "scale.py").is_file()
    code, report, output = audit(custom["cache"], "--run", run, json_path=tmp_path / "audit.json")
    assert code == 0 and check_of(report, "run_final_hash")["status"] == "PASS", output
    (run / "scale.py").write_text("FACTOR = 2.0\n")
    code, report, output = audit(custom["cache"], "--run", run, json_path=tmp_path / "audit.json")
    assert code == 1 and check_of(report, "run_final_hash")["status"] == "FAIL", output


def test_8_code_from_another_repository_is_refused(custom, tmp_path):
    model = copy_tree(custom["model"], tmp_path / "remote")
    config = json.loads((model / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "org/repo--modeling_scaled.ScaledLlamaForCausalLM"
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "cache"
    refused = precompute("--model", model, "--data", custom["data"], "--out", out, "--trust-remote-code")
    assert refused.exit_code == 2 and "runs code from another repository" in refused.output, refused.output
    assert not any(out.glob("*.parquet"))


# ---------------------------------------------------------------------------------------------------------------
# 9: two declarations of the reference must agree


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, llama_dir):
    """Another checkpoint (one weight changed), whose hash is not the cache's."""
    import torch
    from safetensors.torch import load_file, save_file

    model = copy_tree(llama_dir, tmp_path_factory.mktemp("other-model") / "model")
    tensors = load_file(model / "model.safetensors")
    name = max(tensors)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += torch.tensor(1e-2)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


def refused_declarations(result, ref_model, hashed: str, declared: str):
    assert result.exit_code == 2, result.output
    assert f"--ref-model {ref_model} and --ref-model-hash disagree on the reference" in result.output
    assert hashed in result.output and declared in result.output
    assert_one_paragraph(result.output)


def test_9_ref_model_and_ref_model_hash_that_disagree_are_refused(llama_dir, dpo_data, dpo_cache, other_model,
                                                                   tmp_path):
    cached = manifest_of(dpo_cache)["stamps"]["model_hash"]
    out = tmp_path / "run"
    result = train("--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--ref-model", other_model,
                   "--ref-model-hash", cached, "--output-dir", out, *TRAIN)
    refused_declarations(result, other_model, model_hash(other_model), cached)
    assert not out.exists()
    agreed = train("--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--ref-model", other_model,
                   "--ref-model-hash", model_hash(other_model), "--output-dir", out, *TRAIN)
    assert agreed.exit_code == 2 and "model_hash mismatch" in agreed.output, agreed.output  # agreed, not the cache's


def test_9_ref_model_naming_the_policy_folder_with_another_hash_is_refused(llama_dir, dpo_data, dpo_cache, tmp_path):
    """Neighbours: --ref-model the --model folder itself, with an eval cache too; and with --init-adapter, where
    --ref-model-hash names base + adapter but --ref-model names the base folder."""
    declared = "0" * 64
    result = train("--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--ref-model", llama_dir,
                   "--ref-model-hash", declared, "--eval-data", dpo_data, "--eval-split", "train",
                   "--eval-ref-cache", dpo_cache, "--output-dir", tmp_path / "run", *TRAIN)
    refused_declarations(result, llama_dir, model_hash(llama_dir), declared)
    from schemas.stamps import adapter_hash, merged_model_hash

    adapter = make_lora_adapter(llama_dir, tmp_path / "adapter")
    merged = merged_model_hash(model_hash(llama_dir), adapter_hash(adapter))
    result = train("--model", llama_dir, "--init-adapter", adapter, "--use-peft", "--data", dpo_data, "--ref-cache",
                   dpo_cache, "--ref-model", llama_dir, "--ref-model-hash", merged, "--output-dir", tmp_path / "lora",
                   *TRAIN)
    refused_declarations(result, llama_dir, model_hash(llama_dir), merged)
