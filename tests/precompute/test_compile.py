"""precompute-ref --torch-compile: the compiled scoring forward gives the eager cache (within the float32 probe
tolerance), is noted in the manifest only, and a compiled model that disagrees with the eager forward is not used."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from conftest import assert_same_values, manifest_of, pref_rows, scored_now, shard_hashes, write_jsonl
from conftest import precompute_ok as ok
from runtime.tolerance import probe_tolerance
from schemas import format as fmt

import precompute.compiled

ARGS = ("--rows-per-shard", 8, "--batching", "full_forward")



# inductor builds its CPU kernels with a C++ compiler (scripts/test.sh installs g++ as root)
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")
def test_compiled_cache_is_the_eager_cache(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(12, seed=7))
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    ok("--model", llama_dir, "--data", data, "--out", eager, *ARGS)
    result = ok("--model", llama_dir, "--data", data, "--out", compiled, *ARGS, "--torch-compile")
    assert "torch.compile: the full_forward forward compiled" in result.output
    # float32: the compiled kernels fuse and reorder the same sums; the probe's tolerance is the bound
    assert_same_values(eager, compiled, tol=probe_tolerance(torch.float32))
    comp = manifest_of(compiled)["computation"]
    assert comp.pop("compiled") is True and comp == manifest_of(eager)["computation"]
    footer = json.loads(fmt.read_footer(next(compiled.glob("shard-*.parquet"))).meta["computation"])
    assert "compiled" not in footer  # a note of the manifest, never of the shards
    # a rerun without compile keeps every shard of the compiled run: the same cache
    before = shard_hashes(compiled)
    again = ok("--model", llama_dir, "--data", data, "--out", compiled, *ARGS)
    assert scored_now(again) == (12, 0) and shard_hashes(compiled) == before


def test_compiled_model_that_disagrees_falls_back(tmp_path, llama_dir, monkeypatch):
    def wrong_compile(model, **_options):  # a "compiled" model whose output head is off by a little
        other = copy.deepcopy(model)
        with torch.no_grad():
            other.get_output_embeddings().weight.mul_(1.01)
        return other

    monkeypatch.setattr(precompute.compiled.torch, "compile", wrong_compile)
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(12, seed=7))
    eager, fell_back = tmp_path / "eager", tmp_path / "fell-back"
    ok("--model", llama_dir, "--data", data, "--out", eager, *ARGS)
    result = ok("--model", llama_dir, "--data", data, "--out", fell_back, *ARGS, "--torch-compile")
    assert "torch.compile: not used, scoring with the uncompiled model (differs from the reference forward by" in (
        result.output), result.output
    assert manifest_of(fell_back)["computation"]["compiled"] is False
    assert shard_hashes(fell_back) == shard_hashes(eager)  # the eager model scored it: the same bytes
