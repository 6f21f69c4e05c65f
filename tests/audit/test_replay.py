"""audit/replay.py: audit-ref --model replays cached rows through the plain forward of the shipped data/ model: all 40
rows pass in float32 and a 1e-3 change in one token is found and located; the sample is seeded; the tolerance
(runtime/tolerance.py, tests/runtime/test_tolerance.py) follows the recorded dtype and device; the replay runs padded
batches of a layout other than the cache's, trusted only after a probe against reference_logps (issue 25, item 13)."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest

from conftest import DATA, audit_ref as audit, check_of as check, float32_sum
from conftest import precompute_in_process as precompute, rewrite_shard


# ---------------------------------------------------------------------------------------------------------------
# replay on the shipped data/ model


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("audit-data")
    lines = (DATA / "prefs" / "train.jsonl").read_text().splitlines(keepends=True)[:40]
    (base / "train.jsonl").write_text("".join(lines))
    return precompute(DATA / "sft-model", base / "train.jsonl", base / "cache", rows_per_shard=2048)


def nudge_token(cache, *, row: int, side: str, token: int, by: float = 1e-3) -> None:
    """Move one cached log-prob of shard-00000 by `by`, its sequence sum kept consistent: a change the replay must
    find and locate."""
    def edit(rows):
        values = rows[row][f"{side}_logps"]
        values[token] -= by
        rows[row][f"{side}_logp"] = float32_sum(values)

    rewrite_shard(cache, "shard-00000.parquet", edit)


def test_replay_on_data_passes_in_float32_and_finds_a_1e_3_change(data_cache, tmp_path):
    cache = Path(shutil.copytree(data_cache, tmp_path / "cache"))
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all")
    assert code == 0, output
    info = check(report, "replay")["info"]
    assert (info["rows"], info["dtype"], info["tolerance"]) == (40, "float32", 1e-4)
    assert info["token_max_abs_diff"] <= 1e-5

    nudge_token(cache, row=17, side="chosen", token=2)
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all")
    assert code == 1, output
    assert report["failed"] == ["replay"]
    replay = check(report, "replay")
    assert (replay["shard"], replay["row"]) == ("shard-00000.parquet", 17)
    assert "chosen token 2" in replay["detail"] and replay["info"]["tokens_beyond_tolerance"] == 1
    assert 0.9e-3 < replay["info"]["token_max_abs_diff"] < 1.1e-3


def test_replay_sample_is_seeded(data_cache):
    runs = [audit(data_cache, "--model", DATA / "sft-model", "--sample", 5, "--seed", s,
                  json_path=data_cache.parent / f"a{i}.json")[1] for i, s in enumerate((7, 7, 8))]
    infos = [check(r, "replay")["info"] for r in runs]
    assert infos[0]["rows"] == 5 and len(set(infos[0]["sampled"])) == 5
    assert infos[0]["sampled"] == infos[1]["sampled"] and infos[0]["sampled"] != infos[2]["sampled"]
    cached = {r["id"]: r for r in pl.read_parquet(sorted(data_cache.glob("*.parquet"))).to_dicts()}
    for info in infos:  # the rows named are the rows replayed: their completion tokens add up to the replayed count
        assert info["tokens"] == sum(len(cached[i]["chosen_input_ids"]) + len(cached[i]["rejected_input_ids"])
                                     for i in info["sampled"])


# ---------------------------------------------------------------------------------------------------------------
# the batched replay (issue 25, item 13): padded batches of a layout other than the cache's, trusted only once they
# reproduce reference_logps on probe rows, else one sequence at a time


@pytest.fixture(scope="module")
def full_forward_cache(data_cache) -> Path:
    base = data_cache.parent
    return precompute(DATA / "sft-model", base / "train.jsonl", base / "full-forward", rows_per_shard=2048,
                      batching="full_forward")


def cached_rows(cache: Path) -> list[dict]:
    return pl.read_parquet(sorted(cache.glob("*.parquet"))).to_dicts()


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_batched_replay_gives_the_values_of_the_sequence_at_a_time_replay(data_cache, left):
    """Every completion token of the 40 rows, in length-sorted padded batches, against reference_logps of each
    sequence alone (the definition, and the replay's fall-back)."""
    import numpy as np
    import torch

    from audit.replay import _Way
    from runtime.checkpoint import Checkpoint
    from runtime.logprobs import reference_logps

    checkpoint = Checkpoint.open(str(DATA / "sft-model"), False)
    model = checkpoint.load_model(torch.float32, torch.device("cpu"), "sdpa")
    seqs = [(r["prompt_input_ids"], r[f"{side}_input_ids"]) for r in cached_rows(data_cache)
            for side in ("chosen", "rejected")]
    assert len({len(p) + len(c) for p, c in seqs}) > 3  # one batch of 80 sequences, of several lengths: padded
    got = _Way(model, checkpoint.pad_id, 0, 16384, left, "", None).score(seqs)
    truth = [reference_logps(model, p, c).numpy() for p, c in seqs]
    assert [len(g.logps) for g in got] == [len(t) for t in truth]
    assert max(float(np.abs(g.logps - t).max()) for g, t in zip(got, truth)) <= 1e-5
    shifted = _Way(model, checkpoint.pad_id, 0, 16384, left, "", None).score(seqs[1:] + seqs[:1])
    assert float(np.abs(shifted[0].logps - truth[1]).max()) <= 1e-5  # each value is its own sequence's


@pytest.mark.parametrize("cache_name, layout", [("data_cache", "right-padded batches (the cache was written with "),
                                                ("full_forward_cache", "left-padded batches (the cache was written "
                                                 "from right-padded ones, full_forward)")])
def test_the_replay_runs_batched_in_another_layout_counts_rows_per_second_and_finds_a_change(
        request, tmp_path, cache_name, layout):
    cache = Path(shutil.copytree(request.getfixturevalue(cache_name), tmp_path / "cache"))
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all")
    assert code == 0, output
    replay = check(report, "replay")
    info = replay["info"]
    assert info["layout"].startswith(layout) and "matching reference_logps on 4 probe rows" in info["layout"]
    assert info["fallback"] is None and info["token_max_abs_diff"] <= 1e-5
    assert info["rows_per_s"] == pytest.approx(40 / info["scoring_seconds"], rel=0.02)
    assert f"{info['rows_per_s']:,.1f} rows/s through {layout}" in replay["detail"]
    assert f"{info['rows_per_s']:,.1f} rows/s" in output

    def edit(rows):
        values = rows[23]["rejected_logps"]
        values[-1] -= 1e-3
        rows[23]["rejected_logp"] = float32_sum(values)

    rewrite_shard(cache, "shard-00000.parquet", edit)
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all")
    assert code == 1 and report["failed"] == ["replay"], output
    replay = check(report, "replay")
    last = len(cached_rows(cache)[23]["rejected_logps"]) - 1
    assert (replay["shard"], replay["row"]) == ("shard-00000.parquet", 23)
    assert f"rejected token {last}:" in replay["detail"] and replay["info"]["tokens_beyond_tolerance"] == 1
    assert replay["info"]["fallback"] is None


def test_a_batched_layout_that_differs_from_the_reference_is_not_trusted(data_cache, tmp_path, monkeypatch):
    """Padded batches made to disagree by 1e-2 (as a model whose numbers depend on padding would): the probe, which
    holds the longest row, finds it; the replay runs one sequence at a time, says why, and still passes the clean
    cache and locates a changed value."""
    import runtime.logprobs
    import runtime.probe

    padded, disagreement = runtime.logprobs.padded_scores, runtime.probe.disagreement
    probed = []

    def off(*args, **kwargs):
        scores, counts = padded(*args, **kwargs)
        return [s.map(lambda v: v + 1e-2 if v.dtype.kind == "f" else v) for s in scores], counts

    def spy(model, fast, pairs, **kwargs):
        probed.extend(pairs)
        return disagreement(model, fast, pairs, **kwargs)

    monkeypatch.setattr(runtime.logprobs, "padded_scores", off)
    monkeypatch.setattr(runtime.probe, "disagreement", spy)
    cache = Path(shutil.copytree(data_cache, tmp_path / "cache"))
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all")
    assert code == 0, output
    info = check(report, "replay")["info"]
    assert info["fallback"] == "differs from the reference forward by 1.00e-02 on this model"
    assert info["layout"].startswith("one sequence at a time (reference_logps): right-padded batches not used, "
                                     "differs from the reference forward by 1.00e-02")
    assert info["token_max_abs_diff"] <= 1e-5 and info["rows_per_s"] > 0
    assert "rows/s through one sequence at a time" in check(report, "replay")["detail"]
    size = lambda p: len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))
    longest = max(size(r) for r in (type(probed[0])(r["prompt_input_ids"], r["chosen_input_ids"],
                                                   r["rejected_input_ids"]) for r in cached_rows(cache)))
    assert len(probed) == 4 and max(size(p) for p in probed) == longest

    nudge_token(cache, row=17, side="chosen", token=2)
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all")
    replay = check(report, "replay")
    assert code == 1 and (replay["shard"], replay["row"]) == ("shard-00000.parquet", 17), output
    assert "chosen token 2:" in replay["detail"] and replay["info"]["fallback"].startswith("differs")


# ---------------------------------------------------------------------------------------------------------------
# the replay through a reference split by --device-map (issue 27): CPU memory below the weights, the rest on disk


def test_the_replay_through_a_split_model_agrees_with_the_cache_and_finds_a_change(data_cache, tmp_path):
    cache = Path(shutil.copytree(data_cache, tmp_path / "cache"))
    weights = (DATA / "sft-model" / "model.safetensors").stat().st_size
    offload = tmp_path / "offload"
    split = ["--device-map", "auto", "--max-memory", str(weights // 2), "--offload-folder", offload]
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all", *split)
    assert code == 0, output
    info = check(report, "replay")["info"]
    assert info["rows"] == 40 and info["token_max_abs_diff"] <= 1e-5 and info["tokens_beyond_tolerance"] == 0
    layout = info["split"]
    assert layout["device_map"] == "auto" and layout["max_memory"] == f"cpu={weights // 2}"
    assert set(layout["modules"]) == {"cpu", "disk"} and layout["modules"]["disk"]  # part of it on disk
    assert "the model split by device map auto" in " ".join(output.split())
    assert list(offload.iterdir()) == []  # the replay's own offload folder is gone

    nudge_token(cache, row=5, side="rejected", token=1)  # the split replay is no rubber stamp: 1e-3 is found
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all", *split)
    assert code == 1 and report["failed"] == ["replay"], output
    replay = check(report, "replay")
    assert (replay["shard"], replay["row"]) == ("shard-00000.parquet", 5) and "rejected token 1" in replay["detail"]
    assert replay["info"]["tokens_beyond_tolerance"] == 1


@pytest.mark.parametrize("options, message", [
    (["--device-map", "auto"], "--device-map auto splits the reference the replay runs: add --model"),
    (["--model", "{model}", "--max-memory", "1GiB"], "--max-memory place a model split by --device-map; add "
                                                      "--device-map auto"),
    (["--model", "{model}", "--device-map", "auto", "--offload-folder", "{cache}/offload"],
     "--offload-folder {cache}/offload is inside CACHE"),
    (["--show", "0", "--device-map", "auto"], "--show/--html are views of the cache, not the audit: run the audit "
                                              "(--device-map)"),
    (["--model", "{model}", "--device-map", "auto", "--max-memory", "99=1GiB,cpu=1GiB"], "names GPU 99, and this "
                                                                                         "machine has"),
])
def test_a_split_replay_is_refused_where_it_does_not_apply(data_cache, options, message):
    from click.testing import CliRunner

    from audit.cli import main

    fill = lambda s: s.format(model=DATA / "sft-model", cache=data_cache)
    result = CliRunner().invoke(main, [str(data_cache), *map(fill, options)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert fill(message) in " ".join(result.output.split()), result.output
    assert not (data_cache / "offload").exists()
