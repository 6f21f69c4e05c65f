"""precompute-ref --torch-compile auto decided on the job's own first batches (issue 39 item 1; precompute/compiled.py
AutoCompile): scoring starts eager; after the calibration batches the remaining eager scoring is estimated from their
measured rate in the cost model's work, and compile_choice decides. The clock is faked, never timed: a tiny job never
decides and never compiles; a long one compiles after the calibration batches and gives the eager cache; a compiled
forward that fails its proof leaves the job eager; the manifest notes where compiled scoring began, the shards' footers
are the same either side of the switch, and a rerun and audit-ref accept the cache."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import (DATA, assert_same_values, audit_ref, manifest_of, pref_rows, scored_now, shard_hashes,
                      write_jsonl)
from conftest import precompute_ok as ok
from precompute import compiled
from precompute.job import PrecomputeConfig, run_precompute
from runtime.tolerance import probe_tolerance
from schemas import format as fmt
from schemas.encoding import EncodedPair

ARGS = ("--rows-per-shard", 8, "--batching", "full_forward", "--token-budget", 64)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def slow_batches(monkeypatch, seconds: float):
    """AutoCompile's clock advanced `seconds` at each reading (a shard's start, each batch's end): every batch
    measures `seconds`, whatever this machine does. The CPU slowdown is fixed at 1 (an idle machine)."""
    ticks = itertools.count()
    monkeypatch.setattr(compiled.AutoCompile, "clock", staticmethod(lambda: next(ticks) * seconds))
    monkeypatch.setattr(compiled, "cpu_slowdown", lambda: 1.0)


def batches_scored(monkeypatch):
    """Each batch the job runs through the model (not the probe's, not the compiled forward's proof; the pairs the
    probe holds run no batch): (the shard's file, whether a compiled model scored it), as AutoCompile is told of it."""
    seen, original = [], compiled.AutoCompile.after_batch

    def after_batch(self, *a, **k):
        seen.append((self.shard, isinstance(self.current.model, compiled.CompiledDecoder)))
        return original(self, *a, **k)

    monkeypatch.setattr(compiled.AutoCompile, "after_batch", after_batch)
    return seen


def test_the_estimate_weighs_the_remaining_batches_by_the_cost_model(monkeypatch):
    """`single` (one sequence a batch): 4 short pairs (sequences of 3 tokens), then 2 long ones (150 tokens), each
    batch 5 s on the faked clock. After 4 batches (15 s measured on batches 2-4, the first left out) the remaining
    eager time is the remaining work at the measured work rate, the work of a sequence of L tokens being
    L + (L^2 / 2) / (6 h) token equivalents (computed here by hand): the long batches weigh more than their tokens."""
    slow_batches(monkeypatch, 5.0)
    asked = []
    monkeypatch.setattr(compiled, "compile_choice", lambda r, eager, **k: asked.append(eager) or (False, "auto: eager"))
    h = 32
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(hidden_size=h)))
    short, long = EncodedPair([1, 2], [3], [4]), EncodedPair(list(range(100)), list(range(50)), list(range(50)))
    notes, lines = {}, []
    auto = compiled.AutoCompile(model, [("a", [short] * 4), ("b", [long] * 2)], "single", 4096, 0, 0,
                                {"pairs": [], "truth": []}, notes, lines.append, "cpu")
    w = lambda n: n + n * n / 2 / (6 * h)
    auto.begin("a")
    for _ in range(4):
        assert not asked
        auto.after_batch()
    rate = 3 * w(3) / 15.0
    assert asked == [pytest.approx((4 * w(3) + 4 * w(150)) / rate)]
    assert notes == {"compile_choice": "auto: eager"} and any("the first 4 batches scored eager" in x for x in lines)
    for _ in range(4):
        auto.after_batch()  # decided once
    assert len(asked) == 1


def test_a_switch_at_a_shards_end_is_noted_at_the_next_shards_first_batch(monkeypatch):
    """Decided on shard a's last batch: compiled scoring begins at shard b's first, and the holder score_pairs reads
    now gives the compiled model (compile_choice and compiled_scorer stubbed: what they weigh and prove is tested
    above and in tests/precompute/test_compile.py)."""
    slow_batches(monkeypatch, 5.0)
    monkeypatch.setattr(compiled, "compile_choice", lambda r, eager, **k: (True, "auto: compiled"))
    monkeypatch.setattr(compiled, "compiled_scorer", lambda model, *a, **k: ("the compiled model", True))
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(hidden_size=32)))
    pair, notes = EncodedPair([1, 2], [3], [4]), {}
    auto = compiled.AutoCompile(model, [("a", [pair] * 2), ("b", [pair])], "single", 4096, 0, 0,
                                {"pairs": [], "truth": []}, notes, lambda m: None, "cpu")
    auto.begin("a")
    for _ in range(4):
        assert auto.current.model is model
        auto.after_batch()
    assert auto.current.model == "the compiled model"
    assert notes == {"compile_choice": "auto: compiled", "compiled": True,
                     "compiled_from": {"shard": "b", "batch": 1, "eager_batches": 4}}


def test_a_tiny_job_stays_eager_and_never_compiles(tmp_path, monkeypatch):
    """12 rows of data/ on the real clock: the job ends before the calibration, so nothing is measured or compiled,
    and its manifest records no compile note (as a default job's did before); inductor's caches go under refcache's
    home."""
    monkeypatch.setenv("REFCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    data = write_jsonl(tmp_path / "pairs.jsonl",
                       [json.loads(x) for x in (DATA / "prefs" / "train.jsonl").read_text().splitlines()[:12]])
    called = []
    monkeypatch.setattr(compiled, "compile_scoring", lambda m: called.append("compile") or m)
    monkeypatch.setattr(compiled, "cpu_slowdown", lambda: called.append("slowdown") or 1.0)
    lines = []
    run_precompute(PrecomputeConfig(model=str(DATA / "sft-model"), data=str(data), out=str(tmp_path / "c"),
                                    progress=False), log=lines.append)
    computation = manifest_of(tmp_path / "c")["computation"]
    assert not called and not {"compile_choice", "compiled", "compiled_from"} & set(computation)
    assert any(x.startswith("torch.compile auto: eager first; decides after 4 batches") for x in lines), lines
    assert any(x.startswith("torch.compile auto: stayed eager (the job's scoring was done after ") and
               "before the calibration" in x for x in lines), lines  # what it chose, said (ux44b)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "home" / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")  # what the job set, not left to later tests


def test_a_job_measured_fast_stays_eager_after_the_calibration(tmp_path, llama_dir, monkeypatch):
    """Batches of a millisecond on the faked clock: the remaining eager scoring is far under the break-even, so
    the job goes on eager; the choice and its figures are noted and logged."""
    slow_batches(monkeypatch, 0.001)
    monkeypatch.setattr(compiled, "CALIBRATION_SECONDS", 0.002)
    monkeypatch.setattr(compiled, "compile_scoring", lambda m: pytest.fail("compiled"))
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(24, seed=7))
    result = ok("--model", llama_dir, "--data", data, "--out", tmp_path / "c", *ARGS)
    computation = manifest_of(tmp_path / "c")["computation"]
    assert computation["compile_choice"].startswith("auto: eager, the job's estimated eager scoring is under")
    assert "compiled" not in computation and "compiled_from" not in computation
    assert "torch.compile auto: eager, the job's estimated eager scoring is under the break-even (the first 4 " \
           "batches scored eager" in " ".join(result.output.split()), result.output


@needs_gxx
def test_a_long_job_compiles_after_the_calibration_and_gives_the_eager_cache(tmp_path, llama_dir, monkeypatch):
    """Batches of 1000 s on the faked clock: after the 4 calibration batches the job compiles (proven on the probe)
    and every later batch scores compiled; the cache equals the eager one within the float32 probe tolerance (as
    --torch-compile's, tests/precompute/test_compile.py), the manifest notes the shard and batch compiled scoring
    began at, the footers are the same either side of the switch, and a rerun and audit-ref accept the cache."""
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(24, seed=7))
    eager, auto = tmp_path / "eager", tmp_path / "auto"
    ok("--model", llama_dir, "--data", data, "--out", eager, *ARGS, "--no-torch-compile")
    slow_batches(monkeypatch, 1000.0)
    seen = batches_scored(monkeypatch)
    result = ok("--model", llama_dir, "--data", data, "--out", auto, *ARGS)
    text = " ".join(result.output.split())
    assert "torch.compile auto: compiled, the job's estimated eager scoring is past the break-even (the first 4 " \
           "batches scored eager" in text, result.output
    assert "torch.compile: the full_forward forward compiled (its decoder, dynamic shapes)" in text
    assert_same_values(eager, auto, tol=probe_tolerance(torch.float32))

    flags = [c for _, c in seen]
    assert flags[:4] == [False] * 4 and all(flags[4:]) and len(flags) > 4, flags
    first, shard_of = seen[4][0], [s for s, _ in seen]
    computation = manifest_of(auto)["computation"]
    assert computation["compiled"] is True and computation["compile_choice"].startswith("auto: compiled")
    files = [s["file"] for s in manifest_of(auto)["shards"]]
    assert computation["compiled_from"] == {"shard": first, "batch": shard_of[:5].count(first), "eager_batches": 4}
    footers = {json.dumps(json.loads(fmt.read_footer(auto / f).meta["computation"]), sort_keys=True) for f in files}
    assert len(footers) == 1 and "compiled" not in next(iter(footers))
    plain = manifest_of(eager)["computation"]
    assert fmt.scored_computation(computation) == fmt.scored_computation(plain)

    before = shard_hashes(auto)
    assert scored_now(ok("--model", llama_dir, "--data", data, "--out", auto, *ARGS)) == (24, 0)
    assert shard_hashes(auto) == before
    code, report, output = audit_ref(auto, "--model", llama_dir, "--data", data)
    assert code == 0, output


def test_a_compiled_forward_that_fails_its_proof_goes_on_eager(tmp_path, llama_dir, monkeypatch):
    """The "compiled" decoder is off by 1%: the proof on the probe fails, the job goes on eager (logged with the
    reason, noted compiled false, no compiled_from) and writes the eager cache's very bytes."""
    def wrong_compile(forward, **_options):
        def wrong(*args, **kwargs):
            out = forward(*args, **kwargs)
            out.last_hidden_state.mul_(1.01)
            return out
        return wrong

    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(24, seed=7))
    eager, fell_back = tmp_path / "eager", tmp_path / "fell-back"
    ok("--model", llama_dir, "--data", data, "--out", eager, *ARGS, "--no-torch-compile")
    slow_batches(monkeypatch, 1000.0)
    monkeypatch.setattr(compiled.torch, "compile", wrong_compile)
    result = ok("--model", llama_dir, "--data", data, "--out", fell_back, *ARGS)
    assert "torch.compile: not used, scoring with the uncompiled model (differs from the reference forward by" in (
        result.output), result.output
    computation = manifest_of(fell_back)["computation"]
    assert computation["compiled"] is False and computation["compile_choice"].startswith("auto: compiled")
    assert "compiled_from" not in computation
    assert shard_hashes(fell_back) == shard_hashes(eager)
