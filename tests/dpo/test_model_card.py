"""What a train-dpo output says about itself (issue 25, items 6 to 8): the LoRA adapter names its base so that it
loads from any folder (absolute path, or the hub id it was given as), the run manifest records hub ids beside the
snapshots they resolved to, and every output dir (and merged/) holds a model card that huggingface_hub reads:
metadata, the data's fingerprint, the reference's identity (cache_id, manifest sha256, stamps, or a live model),
the options and the final metrics with the plot."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import records, step_records
from support import hub_snapshot, pref_rows, write_jsonl
from dpo.lora import LoraOptions
from dpo.config import TrainConfig
from dpo.recipe import run_train
from schemas import run_manifest as rm
from schemas.stamps import adapter_hash, model_hash
from storage.reads import file_sha256

peft = pytest.importorskip("peft")

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # support.hub_snapshot's
BASE = dict(use_cpu=True, logging_steps=1, seed=7, max_steps=3, learning_rate=1e-2, per_device_train_batch_size=4,
            per_device_eval_batch_size=20, eval_steps=3)


def train(model, data, out, lora: LoraOptions | None, **kwargs) -> dict:
    cfg = TrainConfig(model=str(model), data=str(data), output_dir=str(out), **{**BASE, **kwargs},
                      lora=lora or LoraOptions())
    return run_train(cfg, log=lambda m: None)


def load_card(path: Path):
    from huggingface_hub import ModelCard

    return ModelCard.load(path)  # huggingface_hub's own parser: the metadata must be valid card YAML


@pytest.fixture(scope="module")
def runs(tmp_path_factory, llama_dir, dpo_data, dpo_cache):
    """Two LoRA runs: one given --model as a path relative to the working directory, with a cache, eval rows, the
    plot and --merge-adapter; one given hub ids (model, reference and data) with a live reference."""
    root = tmp_path_factory.mktemp("card-runs")
    lora = LoraOptions(use_peft=True, lora_r=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        relative = os.path.relpath(llama_dir, root)
        assert not Path(relative).is_absolute()
        # the data and the cache typed as relative paths too: the records make them absolute
        cached = train(relative, os.path.relpath(dpo_data, root), "cached",
                       LoraOptions(use_peft=True, lora_r=4, merge_adapter=True),
                       ref_cache=os.path.relpath(dpo_cache, root), eval_data=str(dpo_data), eval_split="train",
                       eval_ref_cache=str(dpo_cache), plot=True)
    license_card = root / "README.md"  # the base model's own card, declaring its license
    license_card.write_text("---\nlicense: apache-2.0\n---\n# the base model\n")
    hub_snapshot("model", "acme/card-base", {p.name: p for p in llama_dir.iterdir() if p.is_file()}
                 | {"README.md": license_card})
    test_rows = write_jsonl(root / "test.jsonl", pref_rows(8, seed=5, fmt="conversational"))
    hub_snapshot("dataset", "acme/card-prefs", {"train.jsonl": dpo_data, "test.jsonl": test_rows})
    live = train("acme/card-base", "acme/card-prefs", root / "live", lora, ref_model="acme/card-base",
                 eval_data="acme/card-prefs", eval_split="test", plot=False)
    return {"cached": (root / "cached", cached), "live": (root / "live", live), "root": root}


# ---------------------------------------------------------------------------------------------------------------
# item 6: the adapter names its base


def test_an_adapter_trained_from_a_relative_path_names_its_base_absolutely_and_loads_anywhere(runs, llama_dir,
                                                                                             tmp_path, monkeypatch):
    out = runs["cached"][0]
    for folder in [out] + sorted(out.glob("checkpoint-*")):  # every saved adapter, checkpoints included
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(llama_dir.resolve()), folder
    monkeypatch.chdir(tmp_path)  # another working directory: a relative name would not load from here
    model = peft.AutoPeftModelForCausalLM.from_pretrained(out).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    ids = torch.tensor([[1, 5, 9, 17, 33, 2]])
    with torch.no_grad():
        assert (model(ids).logits - merged(ids).logits).abs().max() < 1e-4  # the base it named, with the adapter
    manifest = json.loads((out / "run-manifest.json").read_text())
    assert manifest["peft"]["base_model_hash"] == model_hash(llama_dir)
    assert adapter_hash(out) == manifest["peft"]["final_adapter_hash"]  # naming the base changes no adapter hash


def test_an_adapter_trained_from_a_hub_id_names_it_at_its_revision(runs, llama_dir, tmp_path, monkeypatch):
    out = runs["live"][0]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("acme/card-base", COMMIT)
    monkeypatch.chdir(tmp_path)
    model = peft.AutoPeftModelForCausalLM.from_pretrained(out)  # the base from the local Hugging Face cache
    assert model.peft_config["default"].base_model_name_or_path == "acme/card-base"
    card = load_card(out / "README.md")
    assert f"`{model_hash(llama_dir)}`" in card.text  # the base's hash beside its name


# ---------------------------------------------------------------------------------------------------------------
# item 7: hub ids in the run manifest


def test_the_run_manifest_records_hub_ids_beside_the_snapshots(runs, llama_dir, dpo_data):
    out = runs["live"][0]
    m = json.loads((out / "run-manifest.json").read_text())
    base = {"hub_id": "acme/card-base", "revision": COMMIT}
    prefs = {"hub_id": "acme/card-prefs", "revision": COMMIT}
    assert {k: m["initial_model"][k] for k in base} == base
    assert model_hash(m["initial_model"]["path"]) == model_hash(llama_dir) == m["initial_model"]["model_hash"]
    assert Path(m["initial_model"]["path"]).name == COMMIT  # the snapshot folder, not the id
    for section, split in (("data", "train"), ("eval_data", "test")):
        assert {k: m[section][k] for k in prefs} == prefs and m[section]["split"] == split
        assert (Path(m[section]["path"]) / f"{split}.jsonl").is_file()
    assert {k: m["reference"]["live_model"][k] for k in base} == base
    # the checkpoints' record, which a resume compares, is as before: no hub ids (a resume by path still matches)
    record = rm.read_checkpoint_record(sorted(out.glob("checkpoint-*"))[-1])
    assert set(record["live_model"]) == {"path", "model_hash"}
    local = json.loads((runs["cached"][0] / "run-manifest.json").read_text())
    assert "hub_id" not in local["initial_model"] and "hub_id" not in local["data"]
    assert local["data"]["path"] == str(dpo_data)


# ---------------------------------------------------------------------------------------------------------------
# item 8: the model card


def test_the_adapter_and_merged_cards_say_what_was_trained_on_what_against_which_reference(runs, llama_dir,
                                                                                           dpo_cache):
    out = runs["cached"][0]
    manifest = json.loads((out / "run-manifest.json").read_text())
    cards = {"adapter": load_card(out / "README.md"), "merged": load_card(out / "merged" / "README.md")}
    assert cards["adapter"].data.library_name == "peft" and cards["merged"].data.library_name == "transformers"
    cache = json.loads((dpo_cache / "manifest.json").read_text())
    last = step_records(out)[3]
    final_eval = [r for r in records(out) if "eval_loss" in r][-1]
    for kind, card in cards.items():
        meta = card.data.to_dict()
        assert {"dpo", "refcache", "lora"} <= set(meta["tags"]) and meta["pipeline_tag"] == "text-generation"
        assert "base_model" not in meta and "datasets" not in meta and "license" not in meta  # a local base and data
        text = card.text
        for value in (manifest["reference"]["cache"]["cache_id"], file_sha256(dpo_cache / "manifest.json"),
                      *cache["stamps"].values(), manifest["data"]["fingerprint"], manifest["initial_model"]["model_hash"],
                      manifest["final_model_hash"], llama_dir.resolve()):  # the base by absolute path
            assert f"`{value}`" in text, (kind, value)
        assert f"| loss | {last['loss']:.4g} | {final_eval['eval_loss']:.4g} |" in text
        assert f"| rewards/accuracies | {last['rewards/accuracies']:.4g} |" in text
        assert "| `beta` | `0.1` |" in text and "| `lora_r` | `4` |" in text and "| `max_steps` | `3` |" in text
        folder, plot = (out, "metrics.png") if kind == "adapter" else (out / "merged", "../metrics.png")
        assert f"]({plot})" in text and (folder / plot).is_file()  # the plot, as a link from the card's folder
        assert "reference cache" in text and "live reference" not in text
    assert "AutoPeftModelForCausalLM" in cards["adapter"].text
    assert "merged in" in cards["merged"].text
    assert f"`{manifest['peft']['merged_model_hash']}`" in cards["merged"].text


def test_cards_and_the_run_manifest_record_absolute_paths_and_the_reference_in_the_yaml_header(runs, dpo_data,
                                                                                                dpo_cache):
    """A run given its data and cache as relative paths records them absolutely (meaningful once shared); the card's
    YAML header names the reference machine-readably: model, model hash, cache id, version, path."""
    out = runs["cached"][0]
    manifest = json.loads((out / "run-manifest.json").read_text())
    assert manifest["data"]["path"] == str(dpo_data.absolute())
    assert manifest["reference"]["cache"]["path"] == str(dpo_cache.absolute())
    # the options as given, in the config block too (found by the UX pass: relative there beside absolute records)
    config = manifest["config"]
    assert (config["data"], config["ref_cache"], config["output_dir"]) == (str(dpo_data.absolute()),
                                                                          str(dpo_cache.absolute()), str(out))
    live_config = json.loads((runs["live"][0] / "run-manifest.json").read_text())["config"]
    assert live_config["data"] == "acme/card-prefs"  # a hub id stays as given (its snapshot: the data record)
    cache = json.loads((dpo_cache / "manifest.json").read_text())
    for card in (load_card(out / "README.md"), load_card(out / "merged" / "README.md")):
        assert f"`{dpo_data.absolute()}`" in card.text and f"`{dpo_cache.absolute()}`" in card.text
        reference = card.data.to_dict()["refcache_reference"]
        entry = {"cache_id": manifest["reference"]["cache"]["cache_id"], "version": 1, "path": str(dpo_cache.absolute())}
        assert reference == {"model": cache["model"].get("hub_id") or cache["model"]["path"],
                             "model_hash": cache["stamps"]["model_hash"], "train_cache": entry, "eval_cache": entry}
    live = load_card(runs["live"][0] / "README.md").data.to_dict()["refcache_reference"]
    live_record = json.loads((runs["live"][0] / "run-manifest.json").read_text())["reference"]["live_model"]
    assert live == {"model": "acme/card-base", "model_hash": live_record["model_hash"], "cache": None}


def test_the_card_of_a_hub_run_carries_the_hub_metadata_and_says_the_reference_was_live(runs):
    out = runs["live"][0]
    card = load_card(out / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "acme/card-base" and meta["datasets"] == ["acme/card-prefs"]
    assert meta["license"] == "apache-2.0"  # from the base model's own card
    assert meta["library_name"] == "peft"
    assert "live reference model, no cache" in card.text and "adapter disabled" in card.text
    assert "cache_id" not in card.text and "metrics.png" not in card.text  # plot=False: no plot to show
    assert "| metric | train (step 3) | eval (step 3) |" in card.text


def test_an_overwrite_retires_the_runs_card_and_refuses_a_foreign_one(runs, tmp_path):
    """The card is the run's own file like metrics.png (dpo/resume.py): --overwrite-output-dir replaces it; a README.md
    that is not a train-dpo card is in the new run's way and refused."""
    from dpo.card import is_card
    from dpo.resume import overwrite_plan
    from runtime.errors import JobError

    out = tmp_path / "run"
    shutil.copytree(runs["cached"][0], out, symlinks=True)
    assert is_card(out / "README.md") and is_card(out / "merged" / "README.md")
    retire, left = overwrite_plan(out)
    assert out / "README.md" in retire and out / "merged" in left
    (out / "README.md").write_text("---\nlicense: mit\n---\n# notes\n")
    with pytest.raises(JobError, match=r"README.md is not an earlier train-dpo run's own"):
        overwrite_plan(out)


def test_the_card_names_the_reference_model_wherever_the_cache_lives(runs, llama_dir, dpo_cache):
    """The reference model comes from the run manifest's cache record (issue 34: a run on an s3:// cache left it
    out, reading the cache's manifest as a local file); a record written before it did is read from the cache's
    manifest.json through the storage layer."""
    from dpo.card import model_card

    manifest = json.loads((runs["cached"][0] / "run-manifest.json").read_text())
    recorded = manifest["reference"]["cache"]
    assert recorded["model"]["path"] == str(llama_dir)  # the cache's own manifest names it so
    row = f"| reference model | `{llama_dir}` |"
    assert row in model_card(manifest, [], kind="model").text
    elsewhere = {**manifest, "reference": {**manifest["reference"], "cache": {
        **recorded, "path": "s3://bucket/no/such/prefix"}, "eval_cache": None}}
    assert row in model_card(elsewhere, [], kind="model").text  # never read there: the record says it
    legacy = {**manifest, "reference": {**manifest["reference"], "cache": {
        k: v for k, v in recorded.items() if k != "model"} | {"path": str(dpo_cache)}, "eval_cache": None}}
    assert row in model_card(legacy, [], kind="model").text
