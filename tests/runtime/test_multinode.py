"""Two nodes on one machine, launched the way a cluster launches them: two torchrun agents (`--nnodes 2`, one process
each: the machine has 2 cores) meeting at a c10d rendezvous on 127.0.0.1 (a free port per test), each node in its own
working directory (its logs), both writing one --out or --output-dir (a shared filesystem). Gloo on CPU.

The c10d rendezvous deals the global ranks itself (torchrun ignores --node-rank with it), so the tests find a
process's rank from what it wrote, never from the node it was started on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import HELPERS, REPO, pref_rows, run_in_session, shard_hashes, step_records, write_jsonl
from schemas.cache import read_cache

BIN = Path(sys.executable).parent  # the console scripts beside this Python, as --no-python runs them
NOT_COMPARED = ("runtime", "per_second", "total_flos", "epoch")  # wall clock and the Trainer's bookkeeping


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(node: int, port: int, command: list[str]) -> list[str]:
    """What each node of a cluster runs, the node's own rank aside."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"refcache-test-{port}", *command]


class Nodes:
    """Two torchrun agents, each in its own session (a timeout kills its workers too) and working directory
    (work/node0, work/node1, holding its stdout and stderr)."""

    def __init__(self, work: Path, command: list[str], env: dict | None = None, late: float = 0.0):
        port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.dirs, self.procs = [work / f"node{n}" for n in (0, 1)], []
        for node, cwd in enumerate(self.dirs):
            if node and late:
                time.sleep(late)  # node 1 joins late, within the rendezvous' join timeout
            cwd.mkdir(parents=True, exist_ok=True)
            with open(cwd / "stdout", "w") as out, open(cwd / "stderr", "w") as err:
                self.procs.append(subprocess.Popen(node_command(node, port, command), cwd=cwd, env=env, stdout=out,
                                                   stderr=err, start_new_session=True))

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
        finally:
            self.stop()

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def log(self, node: int, stream: str = "stderr") -> str:
        return (self.dirs[node] / stream).read_text()

    def logs(self, stream: str = "stderr") -> str:
        return "".join(self.log(n, stream) for n in (0, 1))


def two_nodes(work: Path, command: list[str], **kwargs) -> Nodes:
    """Run both nodes to the end; both must succeed."""
    nodes = Nodes(work, command, **kwargs)
    codes = nodes.wait()
    assert codes == [0, 0], f"exit codes {codes}\n--- node 0\n{nodes.log(0)[-3000:]}\n--- node 1\n{nodes.log(1)[-3000:]}"
    return nodes


def precompute_args(data: Path, llama_dir: Path, out: Path, rows_per_shard: int = 4) -> list[str]:
    return ["--model", str(llama_dir), "--data", str(data), "--out", str(out), "--rows-per-shard", str(rows_per_shard),
            "--no-progress"]


def one_process_cache(work: Path, data: Path, llama_dir: Path, rows_per_shard: int = 4) -> Path:
    out = work / "cache-1proc"
    run_in_session([str(BIN / "precompute-ref"), *precompute_args(data, llama_dir, out, rows_per_shard)], work)
    return out


def assert_same_cache(out: Path, single: Path):
    """Same shard files (bitwise), rows, ids, stamps and values, and a manifest that differs only in its date."""
    assert shard_hashes(out) == shard_hashes(single) and shard_hashes(out)
    assert read_cache(out).collect().equals(read_cache(single).collect())  # verified against the manifest first
    one, two = (json.loads((d / "manifest.json").read_text()) for d in (single, out))
    assert {**one, "created_at": None} == {**two, "created_at": None}
    assert not list(out.glob(".*.tmp-*"))


@pytest.fixture(scope="module")
def single_cache(tmp_path_factory, llama_dir, dpo_data):
    """The one-process cache of the 40 pairs, in 10 shards."""
    return one_process_cache(tmp_path_factory.mktemp("one-process"), dpo_data, llama_dir)


def test_precompute_on_two_nodes_equals_one_process(tmp_path, llama_dir, dpo_data, single_cache):
    out = tmp_path / "shared" / "cache"
    nodes = two_nodes(tmp_path, ["--no-python", str(BIN / "precompute-ref"), *precompute_args(dpo_data, llama_dir, out)])
    assert_same_cache(out, single_cache)
    assert "on 2 x cpu" in nodes.logs()  # one job of two ranks, not two jobs of one
    assert nodes.logs("stdout").count("wrote 40 pairs (40 scored now) in 10 shards") == 1  # rank 0's summary only


def test_killed_node_stops_the_job_and_the_same_command_again_completes(tmp_path, llama_dir, dpo_data, single_cache):
    """kill -9 of global rank 1's process while it writes its second shard: the job fails on both nodes, rank 1's
    node names the signal, no manifest is written over the missing shards; the same two-node launch again keeps
    the finished shards and ends with the one-process cache."""
    out, marker = tmp_path / "shared" / "cache", tmp_path / "paused"
    pause = {"REFCACHE_PAUSE_AT_SHARD": "1", "REFCACHE_PAUSE_RANK": "1", "REFCACHE_PAUSE_MARKER": str(marker),
             "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    nodes = Nodes(tmp_path / "killed", [str(HELPERS / "precompute_pause.py"), *precompute_args(dpo_data, llama_dir, out)],
                  env=pause)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert all(p.poll() is None for p in nodes.procs), (nodes.log(0), nodes.log(1))
            assert time.monotonic() < deadline, "rank 1 never reached its second shard"
            time.sleep(0.05)
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGKILL)
        codes = nodes.wait()
    finally:
        nodes.stop()
    assert codes[0] != 0 and codes[1] != 0, codes  # the job stops on both nodes
    killed = [n for n in (0, 1) if f"Signal 9 (SIGKILL) received by PID {pid}" in nodes.log(n)]
    assert len(killed) == 1 and "rank      : 1 (local_rank: 0)" in nodes.log(killed[0])  # that node's error
    survivor = nodes.log(1 - killed[0])  # the rank left waiting says what happened, not an unexpected crash
    assert "another rank of this job stopped" in survivor and "unexpected RuntimeError" not in survivor, survivor
    assert not (out / "manifest.json").exists()  # never a manifest over missing shards
    finished = shard_hashes(out)
    assert 0 < len(finished) < 10
    assert {n: h for n, h in shard_hashes(single_cache).items() if n in finished} == finished
    before = {n: (out / n).stat().st_mtime_ns for n in finished}

    again = two_nodes(tmp_path / "again", ["--no-python", str(BIN / "precompute-ref"),
                                           *precompute_args(dpo_data, llama_dir, out)])
    assert f"({len(finished)} already done)" in again.logs()
    assert {n: (out / n).stat().st_mtime_ns for n in finished} == before  # kept, not scored again
    assert_same_cache(out, single_cache)


def test_more_ranks_than_shards(tmp_path, llama_dir):
    """One shard for two ranks: the rank without a shard loads no model, waits for the other and ends with it."""
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(3, seed=7, fmt="conversational"))
    single = one_process_cache(tmp_path, data, llama_dir)
    out = tmp_path / "shared" / "cache"
    two_nodes(tmp_path, ["--no-python", str(BIN / "precompute-ref"), *precompute_args(data, llama_dir, out)])
    assert_same_cache(out, single)
    assert len(shard_hashes(out)) == 1


def test_a_node_that_joins_late(tmp_path, llama_dir):
    """Node 1 starts 5 s after node 0 (torchrun's default join timeout is 600 s); both score a shard."""
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(8, seed=11, fmt="conversational"))
    single = one_process_cache(tmp_path, data, llama_dir)
    out = tmp_path / "shared" / "cache"
    two_nodes(tmp_path, ["--no-python", str(BIN / "precompute-ref"), *precompute_args(data, llama_dir, out)], late=5.0)
    assert_same_cache(out, single)
    assert len(shard_hashes(out)) == 2


def train_args(data: Path, llama_dir: Path, cache: Path, out: Path, batch: int) -> list[str]:
    return ["--model", str(llama_dir), "--data", str(data), "--ref-cache", str(cache), "--output-dir", str(out),
            "--max-steps", "4", "--per-device-train-batch-size", str(batch), "--logging-steps", "1",
            "--learning-rate", "1e-3", "--use-cpu", "--save-strategy", "no", "--no-plot"]


def test_train_on_two_nodes_equals_one_process_with_the_global_batch(tmp_path, llama_dir, dpo_data, dpo_cache):
    """2 nodes x per-device batch 2 against one process of batch 4: the same logged metrics and final weights."""
    one, two = tmp_path / "one" / "run", tmp_path / "shared" / "run"
    run_in_session([str(BIN / "train-dpo"), *train_args(dpo_data, llama_dir, dpo_cache, one, 4)], tmp_path)
    two_nodes(tmp_path, ["--no-python", str(BIN / "train-dpo"), *train_args(dpo_data, llama_dir, dpo_cache, two, 2)])
    a, b = step_records(one), step_records(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step, x in a.items():
        assert x.keys() == b[step].keys()
        for key, value in x.items():
            if isinstance(value, float) and not any(n in key for n in NOT_COMPARED):
                assert abs(b[step][key] - value) <= 1e-5 * max(1.0, abs(value)), (step, key, value, b[step][key])
    wa, wb = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    start = load_file(llama_dir / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert max((wa[k] - start[k]).abs().max().item() for k in wa if k in start) > 1e-3  # training moved them
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-5, rtol=0, msg=k)
