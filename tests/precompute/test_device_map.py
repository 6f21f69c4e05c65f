"""precompute-ref --device-map / --max-memory / --offload-folder: a reference split by accelerate's dispatch (CPU
memory, then disk) gives the cache of the whole model in memory, records where its modules went, and a resume
across layouts is the same cache; bad placement options are refused before any work."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import assert_same_values, audit_ref, manifest_of, pref_rows, read_cache, scored_now, shard_hashes, write_jsonl
from conftest import precompute_cli as cli, precompute_ok as ok
from runtime.placement import parse_max_memory
from schemas import format as fmt
from schemas.cache import open_cache

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("split-data") / "prefs.jsonl", pref_rows(20, seed=5,
                                                                                          fmt="conversational"))


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory, llama_dir, data):
    out = tmp_path_factory.mktemp("in-memory") / "cache"
    ok("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 8)
    return out


def weights_bytes(model_dir) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def test_disk_offload_gives_the_in_memory_cache(tmp_path, llama_dir, data, in_memory):
    budget = weights_bytes(llama_dir) * 2 // 3  # below the weights: part of the model must go to disk
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "mine.txt").write_text("the user's\n")  # a folder already in use: only our own subfolder is removed
    out = tmp_path / "cache"
    result = ok("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 8, "--device-map", "auto",
                "--max-memory", str(budget), "--offload-folder", offload)
    assert "device map: device map auto" in result.output and "disk:" in result.output
    assert_same_values(in_memory, out)

    comp, plain = manifest_of(out)["computation"], manifest_of(in_memory)["computation"]
    layout = comp.pop("layout")
    assert comp == plain  # what scored the rows is the in-memory run's: same dtype, device type, mode, head
    assert layout["device_map"] == "auto" and layout["max_memory"] == f"cpu={budget}"
    assert set(layout["modules"]) == {"cpu", "disk"} and layout["modules"]["disk"]  # split between memory and disk
    assert isinstance(layout["offload_folder_used"], bool)
    # the layout is a note of the manifest, not of the shards: their footers carry the in-memory run's computation
    for entry in manifest_of(out)["shards"]:
        meta = pq.read_schema(out / entry["file"]).metadata
        assert json.loads(meta[(fmt.META_PREFIX + "computation").encode()]) == plain
    open_cache(out)  # a valid cache by the reader's rules
    # on the CPU the split computes bit for bit what the whole model does: the very same shard files
    assert shard_hashes(out) == shard_hashes(in_memory)
    assert [p.name for p in offload.iterdir()] == ["mine.txt"]  # the job's own offload folder is gone, nothing else

    code, report, output = audit_ref(out)
    assert code == 0, output
    assert "split by device map auto" in output and "disk: " in output
    assert report["made"]["computation"]["layout"] == layout


def test_device_map_where_everything_fits(tmp_path, llama_dir, data, in_memory):
    out = tmp_path / "cache"
    ok("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 8, "--device-map", "auto",
       "--max-memory", "cpu=1GiB")
    assert_same_values(in_memory, out)
    layout = manifest_of(out)["computation"]["layout"]
    assert layout["modules"] == {"cpu": [""]} and layout["max_memory"] == f"cpu={2**30}"  # the whole model in memory
    assert layout["offload_folder_used"] is False


def test_a_resume_across_layouts_is_the_same_cache(tmp_path, llama_dir, data, in_memory):
    """The layout is not compared on a rerun: an in-memory cache cut short is finished by a split model."""
    import shutil

    out = tmp_path / "cache"
    shutil.copytree(in_memory, out)
    (out / fmt.MANIFEST).unlink()
    last = manifest_of(in_memory)["shards"][-1]["file"]
    (out / last).unlink()
    result = ok("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 8, "--device-map", "auto",
                "--max-memory", str(weights_bytes(llama_dir) // 2))
    assert scored_now(result) == (20, manifest_of(in_memory)["shards"][-1]["rows"])
    assert_same_values(in_memory, out)
    assert "layout" in manifest_of(out)["computation"]
    open_cache(out)
    # and back: the same command without a device map keeps every shard
    assert scored_now(ok("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 8))[1] == 0


@pytest.mark.parametrize("options, message", [
    (["--device-map", "auto", "--max-memory", "lots"], "'lots' is not a memory size"),
    (["--device-map", "auto", "--max-memory", "gpu=3GiB"], "use a GPU index (0, 1, ...) or cpu"),
    (["--device-map", "auto", "--max-memory", "cpu=1GiB,cpu=2GiB"], "device cpu is given twice"),
    (["--device-map", "auto", "--max-memory", "99=1GiB,cpu=1GiB"], "names GPU 99, and this machine has"),
    (["--max-memory", "1GiB"], "add --device-map auto"),
    (["--offload-folder", "{tmp}/off"], "add --device-map auto"),
    (["--device-map", "auto", "--device", "cpu"], "give one"),
    (["--device-map", "auto", "--offload-folder", "{out}/offload"], "--offload-folder {out}/offload is inside --out"),
    (["--device-map", "auto", "--offload-folder", "{tmp}/outs"], "contains --out"),
    (["--device-map", "auto", "--offload-folder", "{model}/offload"], "is inside --model"),
    (["--device-map", "auto", "--offload-folder", "{tmp}/data"], "contains --data"),
])
def test_bad_placement_is_refused(tmp_path, llama_dir, options, message):
    data = write_jsonl(tmp_path / "data" / "prefs.jsonl", pref_rows(4))
    out = tmp_path / "outs" / "cache"
    fill = lambda s: s.format(tmp=tmp_path, out=out, model=llama_dir, data=data)
    before = sorted(p.name for p in llama_dir.iterdir())
    result = cli("--model", llama_dir, "--data", data, "--out", out, *map(fill, options))
    assert result.exit_code == 2, result.output
    assert fill(message) in " ".join(result.output.split()), result.output
    assert not out.exists() and sorted(p.name for p in llama_dir.iterdir()) == before  # nothing written anywhere
    assert not (tmp_path / "off").exists()


def test_max_memory_reads_one_form():
    assert parse_max_memory("0=20GiB, cpu=60GiB") == f"0={20 * 2**30},cpu={60 * 2**30}"
    assert parse_max_memory("500MB") == parse_max_memory("cpu=500000000") == "cpu=500000000"
    with pytest.raises(ValueError, match="not a memory size"):
        parse_max_memory("0=-3GB")


def test_top_k_under_disk_offload(tmp_path, llama_dir, data):
    """The top-k columns too (ids, log-probs, tail) come out of the split model as out of the whole one."""
    plain, split = tmp_path / "plain", tmp_path / "split"
    ok("--model", llama_dir, "--data", data, "--out", plain, "--top-k", 4)
    ok("--model", llama_dir, "--data", data, "--out", split, "--top-k", 4, "--device-map", "auto",
       "--max-memory", str(weights_bytes(llama_dir) // 2))
    x, y = read_cache(plain), read_cache(split)
    for side in ("chosen", "rejected"):
        assert x[f"{side}_top_ids"].to_list() == y[f"{side}_top_ids"].to_list()
        for col in (f"{side}_top_logps", f"{side}_tail", f"{side}_logps"):
            a = np.concatenate([np.ravel(np.asarray(v, float)) for v in x[col].to_list()])
            b = np.concatenate([np.ravel(np.asarray(v, float)) for v in y[col].to_list()])
            assert np.abs(a - b).max() <= 1e-5, col
    assert manifest_of(split)["computation"]["top_k"] == 4 and "disk" in manifest_of(split)["computation"]["layout"][
        "modules"]


def test_the_layout_is_not_compared():
    from schemas import rules

    layout = {"device_map": "auto", "max_memory": "cpu=1", "offload_folder_used": False, "modules": {"disk": [""]}}
    assert rules.computation_findings({"dtype": "float32", "layout": layout}, {"dtype": "float32"}) == []
    found = rules.computation_findings({"dtype": "float32", "layout": layout}, {"dtype": "bfloat16"})
    assert [f.expected for f in found] == [{"dtype": "float32"}]
    assert fmt.scored_computation({"dtype": "float32", "layout": layout}) == {"dtype": "float32"}


def test_a_budget_naming_gpu_0_on_a_machine_without_one_is_refused(tmp_path, llama_dir, monkeypatch):
    """The case of issue 34: --max-memory 0=... where no CUDA device is visible (a CPU machine), named with the
    remedy, before anything is written (it once reached accelerate and the generic crash path)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(4))
    out = tmp_path / "cache"
    result = cli("--model", llama_dir, "--data", data, "--out", out, "--device-map", "auto", "--max-memory",
                 "0=1GiB,cpu=2GiB")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "names GPU 0, and this machine has none (no CUDA device is visible)" in text and "cpu=SIZE" in text
    assert "unexpected" not in text and not out.exists()
