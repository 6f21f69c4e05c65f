"""precompute-ref --tp-size N under torchrun (gloo, CPU): transformers' tensor-parallel plan splits the tiny Llama
across each group of N ranks, groups share the shards out, and the cache is the one-process cache within 1e-5 (the
layout a note of the manifest only); what cannot be split that way is refused before any weight is read."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from transformers import GPT2Config, LlamaConfig

from conftest import (TORCHRUN, assert_same_values, audit_ref, manifest_of, pref_rows, run_in_session, scored_now,
                      write_jsonl)
from conftest import precompute_cli as cli, precompute_ok as ok
from audit.cli import main as audit_main
from precompute.cli import summary_text
from runtime.distributed import Dist
from runtime.errors import JobError
from runtime.placement import check_tensor_parallel, describe, tensor_parallel_refusal
from schemas import format as fmt


def torchrun(ranks: int) -> list[str]:
    return [*TORCHRUN[:-1], str(ranks)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("tp-data") / "prefs.jsonl", pref_rows(24, seed=7, fmt="conversational"))


def args(model, data, out) -> list[str]:
    return ["--model", str(model), "--data", str(data), "--out", str(out), "--rows-per-shard", "4", "--no-progress"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, llama_dir, data):
    out = tmp_path_factory.mktemp("tp-one-process") / "cache"
    ok(*args(llama_dir, data, out)[:-1])
    return out


def tensor_parallel_run(tmp_path, llama_dir, data, ranks: int):
    out = tmp_path / "cache"
    p = run_in_session([*torchrun(ranks), "-m", "precompute.cli", *args(llama_dir, data, out), "--tp-size", "2"],
                       tmp_path)
    return out, p


def assert_same_cache_but_the_layout(out, single, groups: int):
    """The one-process cache within 1e-5: same shards, rows, ids, stamps and computation; the layout a note of the
    manifest, never in a shard's footer."""
    assert_same_values(single, out)
    one, split = manifest_of(single), manifest_of(out)
    layout = split["computation"].pop("layout")
    assert layout == {"kind": "tensor_parallel", "tp_size": 2, "groups": groups}
    assert split["computation"] == one["computation"]  # same dtype, device type, mode, head as one process
    assert split["stamps"] == one["stamps"] and split["rows"] == one["rows"]
    entry = lambda m: [{k: s[k] for k in ("file", "rows", "mask_checksum", "ids_checksum")} for s in m["shards"]]
    assert entry(split) == entry(one)
    for s in split["shards"]:
        meta = pq.read_schema(out / s["file"]).metadata
        assert json.loads(meta[(fmt.META_PREFIX + "computation").encode()]) == one["computation"]
    assert not list(out.glob(".*.tmp-*"))


def test_two_ranks_split_one_model_and_give_the_one_process_cache(tmp_path, llama_dir, data, single):
    out, p = tensor_parallel_run(tmp_path, llama_dir, data, 2)
    assert "on 2 x cpu (tensor parallel: 1 group of 2 ranks)" in p.stderr
    assert "split by tensor parallelism over 2 ranks per copy of the model, 1 group" in p.stderr
    assert "group 0/1 (ranks 0-1): shard 6/6" in p.stderr  # the group's first rank writes and says so, once
    assert p.stderr.count("shard-00005.parquet) done") == 1
    assert p.stdout.count("wrote 24 pairs (24 scored now) in 6 shards") == 1
    assert_same_cache_but_the_layout(out, single, groups=1)

    # audit-ref shows the split and replays the rows on the whole model in one process: an independent forward
    code, report, output = audit_ref(out, "--model", llama_dir, "--all")
    assert code == 0, output
    assert "split by tensor parallelism over 2 ranks per copy of the model, 1 group" in output
    assert report["made"]["computation"]["layout"]["kind"] == "tensor_parallel"
    page = tmp_path / "view.html"
    assert CliRunner().invoke(audit_main, [str(out), "--html", str(page), "--sample", "2"]).exit_code == 0
    assert "<th>split</th><td><code>tensor parallelism over 2 ranks per copy of the model" in page.read_text()

    # a note is never compared: one process keeps every shard of the split run as its own
    assert scored_now(ok(*args(llama_dir, data, out)[:-1])) == (24, 0)


def test_four_ranks_make_two_groups_that_share_the_shards(tmp_path, llama_dir, data, single):
    out, p = tensor_parallel_run(tmp_path, llama_dir, data, 4)
    assert "on 4 x cpu (tensor parallel: 2 groups of 2 ranks)" in p.stderr and "tokens per group: " in p.stderr
    written = [line for line in p.stderr.splitlines() if ": shard " in line and ") done" in line]
    assert {line.split(":")[0] for line in written} == {"group 0/2 (ranks 0-1)", "group 1/2 (ranks 2-3)"}
    assert len(written) == 6  # every shard scored by one group and written once
    assert "tensor-parallel groups: 2, scoring wall per tensor-parallel group" in p.stdout
    assert_same_cache_but_the_layout(out, single, groups=2)


def test_an_architecture_without_a_plan_is_refused_before_loading(tmp_path, gpt2_dir, data):
    out = tmp_path / "cache"
    p = run_in_session([*TORCHRUN, "-m", "precompute.cli", *args(gpt2_dir, data, out), "--tp-size", "2"], tmp_path,
                       check=False)
    assert p.returncode != 0
    assert ("--tp-size 2: transformers has no tensor-parallel plan for GPT2LMHeadModel (model type gpt2: its "
            "GPT2Config declares no base_model_tp_plan)") in p.stderr
    assert "use --device-map auto" in p.stderr and "leave --tp-size out" in p.stderr
    assert "unexpected" not in p.stderr and not out.exists()  # refused before the cache folder, let alone the weights


def test_tp_size_without_torchrun_is_refused(tmp_path, llama_dir, data):
    out = tmp_path / "cache"
    result = cli(*args(llama_dir, data, out)[:-1], "--tp-size", "2")
    assert result.exit_code == 2
    assert "--tp-size 2 splits the model across 2 processes, and this job runs one; launch it with torchrun" in (
        result.output)
    assert not out.exists()
    assert scored_now(ok(*args(llama_dir, data, out)[:-1], "--tp-size", "1"))[1] == 24  # 1: no split


def test_what_groups_cannot_run_is_refused():
    with pytest.raises(JobError, match="this job runs 3 .*not a multiple of 2"):
        check_tensor_parallel(2, 3, "auto", None, None, False)
    for extra, match in ((("cpu", None, None, False), "--device cpu: .*leave --device at auto"),
                         (("auto", "auto", None, False), "--device-map: another way to split the model"),
                         (("auto", None, "lora", False), "--adapter: .*merge the adapter first"),
                         (("auto", None, None, True), "--torch-compile: .*leave --torch-compile out")):
        with pytest.raises(JobError, match=match):
            check_tensor_parallel(2, 4, *extra)
    check_tensor_parallel(2, 4, "auto", None, None, False)
    check_tensor_parallel(1, 1, "cpu", "auto", "lora", True)  # no tensor parallelism: nothing of this applies


def test_the_plan_and_the_heads_decide_what_splits():
    assert "no tensor-parallel plan for GPT2LMHeadModel" in tensor_parallel_refusal(
        GPT2Config(architectures=["GPT2LMHeadModel"]), 2)
    llama = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    assert tensor_parallel_refusal(llama, 2) is None
    assert "has 2 key/value heads, which 4 ranks cannot share evenly" in tensor_parallel_refusal(llama, 4)
    assert "has 8 attention heads, which 3 ranks" in tensor_parallel_refusal(llama, 3)


def test_groups_are_consecutive_ranks_led_by_the_first():
    dists = [Dist(rank, 6, tp_size=2) for rank in range(6)]
    assert [d.group for d in dists] == [0, 0, 1, 1, 2, 2] and {d.groups for d in dists} == {3}
    assert [d.leads for d in dists] == [True, False] * 3
    assert dists[3].name() == "group 1/3 (ranks 2-3)" and Dist(3, 6).name() == "rank 3/6"
    assert all(d.leads and d.group == d.rank for d in (Dist(r, 4) for r in range(4)))  # no TP: a group per rank


def test_the_layout_line_and_the_summary_name_groups():
    assert describe({"kind": "tensor_parallel", "tp_size": 4, "groups": 2}) == (
        "tensor parallelism over 4 ranks per copy of the model, 2 groups (transformers' tensor-parallel plan)")
    s = {"rows": 8, "rows_scored": 8, "shards": 2, "out": "c", "skipped": 0, "skipped_by_reason": {},
         "identical_pairs": 0, "tokens": 10, "mode": "single", "padding_fraction": 0.0, "wall_s": 2.0,
         "tokens_per_s": 5.0, "rank_wall_s": [1.0, 2.0], "bytes": 1, "bytes_per_completion_token": 1.0}
    assert "ranks: 2, scoring wall per rank 1.0-2.0 s" in summary_text(s)
    assert "tensor-parallel groups: 2, scoring wall per tensor-parallel group 1.0-2.0 s" in summary_text(
        {**s, "tp_size": 2})
