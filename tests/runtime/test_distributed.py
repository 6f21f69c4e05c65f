"""torchrun with the gloo backend on CPU: 2 processes must give what 1 process gives, for both jobs."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO, TORCHRUN, pref_rows, run_in_session, write_jsonl

NOISE = ("runtime", "per_second", "total_flos", "epoch")


def run(cmd, cwd, env=None, check=True):
    return run_in_session(cmd, cwd, env, check)


def shard_hashes(cache: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(cache.glob("*.parquet"))}


@pytest.fixture(scope="module")
def work(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("dist")
    write_jsonl(root / "prefs.jsonl", pref_rows(40, fmt="conversational"))
    return root


def precompute_args(work, llama_dir, out):
    return ["--model", str(llama_dir), "--data", str(work / "prefs.jsonl"), "--out", str(out), "--rows-per-shard", "4",
            "--no-progress"]


@pytest.fixture(scope="module")
def single_cache(work, llama_dir):
    out = work / "cache-1proc"
    run([sys.executable, "-m", "precompute.cli", *precompute_args(work, llama_dir, out)], work)
    return out


def test_precompute_two_ranks_equals_one(work, llama_dir, single_cache):
    out = work / "cache-2proc"
    run([*TORCHRUN, "-m", "precompute.cli", *precompute_args(work, llama_dir, out)], work)
    assert shard_hashes(out) == shard_hashes(single_cache)  # same shards, bitwise
    one, two = (json.loads((d / "manifest.json").read_text()) for d in (single_cache, out))
    assert one["stamps"] == two["stamps"] and one["shards"] == two["shards"]
    assert not list(out.glob(".*.tmp-*"))


def test_killed_rank_fails_the_job_and_rerun_completes(work, llama_dir, single_cache):
    out = work / "cache-killed"
    helper = REPO / "tests" / "helpers" / "precompute_kill_rank.py"
    p = run([*TORCHRUN, str(helper), *precompute_args(work, llama_dir, out)], work,
            env={"KILL_RANK": "1", "KILL_AFTER": "1", "PYTHONPATH": str(REPO)}, check=False)
    assert p.returncode != 0
    assert "SIGKILL" in p.stderr or "Signal 9" in p.stderr or "exitcode" in p.stderr
    assert not (out / "manifest.json").exists()  # never a manifest over missing shards
    finished = set(shard_hashes(out))
    assert finished and len(finished) < 10
    # Resume with a different number of processes: finished shards are kept, the rest are scored.
    before = {n: (out / n).stat().st_mtime_ns for n in finished}
    p = run([sys.executable, "-m", "precompute.cli", *precompute_args(work, llama_dir, out)], work)
    assert f"({len(finished)} already done)" in p.stderr
    assert {n: (out / n).stat().st_mtime_ns for n in finished} == before
    assert shard_hashes(out) == shard_hashes(single_cache)


def train_args(work, llama_dir, cache, out, batch):
    return ["--model", str(llama_dir), "--data", str(work / "prefs.jsonl"), "--ref-cache", str(cache),
            "--output-dir", str(out), "--max-steps", "4", "--per-device-train-batch-size", str(batch),
            "--logging-steps", "1", "--learning-rate", "1e-3", "--use-cpu", "--save-strategy", "no", "--no-plot"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_two_ranks_batch_b_matches_one_rank_batch_2b(work, llama_dir, single_cache):
    run([sys.executable, "-m", "dpo.cli", *train_args(work, llama_dir, single_cache, work / "run-1", 4)], work)
    run([*TORCHRUN, "-m", "dpo.cli", *train_args(work, llama_dir, single_cache, work / "run-2", 2)], work)
    one, two = metrics(work / "run-1"), metrics(work / "run-2")
    steps = [r for r in one if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert len(two) == len(one)  # zip below would stop at the shorter
    for a, b in zip(one, two):
        assert a["step"] == b["step"]
        for key, value in a.items():
            if isinstance(value, float) and not any(n in key for n in NOISE):
                assert b[key] == pytest.approx(value, abs=1e-5, rel=1e-6), (a["step"], key)


def test_every_rank_refuses_a_damaged_cache(work, llama_dir, single_cache):
    bad = work / "cache-damaged"
    shutil.copytree(single_cache, bad)
    shard = bad / "shard-00003.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    p = run([*TORCHRUN, "-m", "dpo.cli", *train_args(work, llama_dir, bad, work / "run-bad", 2)], work, check=False)
    assert p.returncode != 0
    assert "shard-00003.parquet content differs from the manifest" in p.stderr  # rank 0 hashes the files
    assert p.stderr.count("error: ") == 2  # and both ranks refuse (rank 1 by itself or because rank 0 did)
    assert not (work / "run-bad" / "metrics.jsonl").exists()


def test_share_rank_zero_decides_and_every_rank_refuses(work):
    """runtime.distributed.Dist.share on 2 gloo ranks: by default rank 0 alone runs and every rank gets its result
    or its refusal; with every_rank each rank runs, keeps its own result, and all fail when one does."""
    helper = REPO / "tests" / "helpers" / "share_ranks.py"
    out = work / "share"
    out.mkdir()
    run([*TORCHRUN, str(helper), str(out)], work, env={"PYTHONPATH": str(REPO)})
    ranks = sorted((json.loads(f.read_text()) for f in out.glob("share-rank*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    zero, one = ranks
    assert zero["rank0_ok"] == one["rank0_ok"] == {"result": 0}  # rank 0's result, on both
    assert zero["rank0_ran"] == [0] and one["rank0_ran"] == []  # and only rank 0 ran it
    for r in ranks:
        assert r["rank0_fails"] == {"raised": "JobError", "message": "rank 0: bad on rank 0"}
        assert r["rank0_refuses"] == {"raised": "JobError", "message": "bad on rank 0"}
        assert r["each_ok"] == {"result": r["rank"]}  # each its own
    assert one["each_rank1_fails"] == {"raised": "ValueError", "message": "bad on rank 1"}  # its own error
    assert zero["each_rank1_fails"] == {"raised": "JobError",
                                        "message": "rank 1 refused the cache: ValueError: bad on rank 1"}


def test_share_in_one_process():
    from runtime.distributed import Dist
    from runtime.errors import JobError

    def fails():
        raise ValueError("nope")

    dist = Dist(0, 1)
    assert dist.share(lambda: 5) == 5 and dist.share(lambda: 6, every_rank=True) == 6
    with pytest.raises(JobError, match="^rank 0: nope$"):  # rank 0's failure, as every rank would get it
        dist.share(fails)
    with pytest.raises(ValueError, match="^nope$"):  # every_rank: the rank's own error (a CacheError stays one)
        dist.share(fails, every_rank=True)
