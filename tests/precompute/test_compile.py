"""precompute-ref --torch-compile: the compiled scoring forward gives the eager cache (within the float32 probe
tolerance), is noted in the manifest only, and a compiled model that disagrees with the eager forward is not used."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import assert_same_values, manifest_of, pref_rows, scored_now, shard_hashes, write_jsonl
from conftest import precompute_ok as ok
from precompute.modes.scoring import score_pairs
from runtime.tolerance import probe_tolerance
from schemas import format as fmt
from schemas.encoding import EncodedPair
from support import build_llama

import precompute.compiled
from precompute.compiled import CompiledDecoder, compile_scoring, compiled_scorer

ARGS = ("--rows-per-shard", 8, "--batching", "full_forward")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on CPU needs g++")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing: dynamo keeps compiled code on the forward's code object across model
    instances, so a graph an earlier test built (a model of the same shapes) would be reused and not counted."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# inductor builds its CPU kernels with a C++ compiler (scripts/test.sh installs g++ as root)
@needs_gxx
def test_compiled_cache_is_the_eager_cache(tmp_path, llama_dir):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(12, seed=7))
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    ok("--model", llama_dir, "--data", data, "--out", eager, *ARGS)
    result = ok("--model", llama_dir, "--data", data, "--out", compiled, *ARGS, "--torch-compile")
    assert "torch.compile: the full_forward forward compiled (its decoder, dynamic shapes)" in result.output
    # float32: the compiled kernels fuse and reorder the same sums; the probe's tolerance is the bound
    assert_same_values(eager, compiled, tol=probe_tolerance(torch.float32))
    comp, plain = manifest_of(compiled)["computation"], manifest_of(eager)["computation"]
    assert comp.pop("compiled") is True and fmt.scored_computation(comp) == fmt.scored_computation(plain)
    assert comp["compile_choice"] == "--torch-compile" and "compile_choice" not in plain  # auto stayed eager
    footer = json.loads(fmt.read_footer(next(compiled.glob("shard-*.parquet"))).meta["computation"])
    assert "compiled" not in footer  # a note of the manifest, never of the shards
    # a rerun without compile keeps every shard of the compiled run: the same cache
    before = shard_hashes(compiled)
    again = ok("--model", llama_dir, "--data", data, "--out", compiled, *ARGS)
    assert scored_now(again) == (12, 0) and shard_hashes(compiled) == before


def test_compiled_model_that_disagrees_falls_back(tmp_path, llama_dir, monkeypatch):
    def wrong_compile(forward, **_options):  # a "compiled" decoder whose hidden states are off by a little
        def wrong(*args, **kwargs):
            out = forward(*args, **kwargs)
            out.last_hidden_state.mul_(1.01)
            return out
        return wrong

    monkeypatch.setattr(precompute.compiled.torch, "compile", wrong_compile)
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(12, seed=7))
    eager, fell_back = tmp_path / "eager", tmp_path / "fell-back"
    ok("--model", llama_dir, "--data", data, "--out", eager, *ARGS)
    result = ok("--model", llama_dir, "--data", data, "--out", fell_back, *ARGS, "--torch-compile")
    assert "torch.compile: not used, scoring with the uncompiled model (differs from the reference forward by" in (
        result.output), result.output
    assert manifest_of(fell_back)["computation"]["compiled"] is False
    assert shard_hashes(fell_back) == shard_hashes(eager)  # the eager model scored it: the same bytes


def test_the_probe_truth_is_computed_once_for_mode_and_compile(tmp_path, llama_dir, monkeypatch):
    """A --torch-compile job checks the compiled forward against the truth the batching-mode probe already computed
    on the same pairs (the eager model's whole forward): each probe pair goes through the reference once, not once
    more for the compile check. torch.compile is stubbed by the identity (no inductor here); that the handed-over
    truth still judges is test_compiled_model_that_disagrees_falls_back's."""
    import precompute.modes.choose
    import runtime.probe

    monkeypatch.setattr(precompute.compiled.torch, "compile", lambda forward, **_options: forward)
    seen = []
    for module in (precompute.modes.choose, precompute.compiled, runtime.probe):
        original = module.reference_values

        def counted(model, pairs, *a, _original=original, **k):
            seen.append(len(pairs))
            return _original(model, pairs, *a, **k)

        monkeypatch.setattr(module, "reference_values", counted)
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(12, seed=7))
    result = ok("--model", llama_dir, "--data", data, "--out", tmp_path / "c", *ARGS, "--torch-compile")
    assert manifest_of(tmp_path / "c")["computation"]["compiled"] is True, result.output
    assert len(seen) == 1 and seen[0] >= 3, seen  # one reference pass over the probe: short pairs and the longest


def plain_logps(model, pair: EncodedPair, completion: list[int]) -> torch.Tensor:
    """A plain transformers forward over prompt + completion, log_softmax at each completion token (the test's own
    computation, not runtime.logprobs)."""
    ids = torch.tensor([pair.prompt_ids + completion])
    logits = model(input_ids=ids).logits[0, len(pair.prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@needs_gxx
@pytest.mark.parametrize("mode", ["kv_cache", "full_forward"])
def test_compiled_decoder_scores_equal_a_plain_forward(mode):
    """The decoder compiled apart from its hooks (the head's hook stays eager: no graph break) scores a padded batch
    (prompts and completions of unequal lengths) as a plain forward does; outside its own forward the model stays
    eager (what the truth runs on)."""
    from torch._dynamo.utils import counters

    model = build_llama(64, seed=3).eval()
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(3, 64, (n,), generator=g).tolist()
    pairs = [EncodedPair(ids(p), ids(c), ids(r)) for p, c, r in ((7, 5, 3), (12, 2, 6), (4, 1, 4))]
    compiled = compile_scoring(model)
    assert isinstance(compiled, CompiledDecoder) and compiled.config is model.config
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    chosen, rejected, _ = score_pairs(compiled, pairs, 0, 10_000, mode)
    assert counters["stats"]["unique_graphs"] > graphs  # it did compile
    assert sum(counters["graph_break"].values()) == breaks  # in one piece: the hook ran outside the graph
    assert "forward" not in vars(model.model)  # the model is eager again
    tol = probe_tolerance(torch.float32)
    with torch.no_grad():
        for pair, c, r in zip(pairs, chosen, rejected):
            for got, completion in ((c, pair.chosen_ids), (r, pair.rejected_ids)):
                want = plain_logps(model, pair, completion).numpy()
                assert got.logps.shape == want.shape and abs(got.logps - want).max() <= tol
        calls = []
        compiled.__dict__["_fast"] = lambda *a, **k: calls.append(1) or model.model.__class__.forward(model.model, *a, **k)
        model(input_ids=torch.tensor([ids(9)]))
        assert not calls  # the plain forward does not go through the compiled decoder
        compiled(input_ids=torch.tensor([ids(9)]))
        assert calls == [1]


@needs_gxx
def test_a_batch_no_probed_graph_admits_scores_eager():
    """After the probe (its pairs in the batches the job's budget makes: one padded kv_cache batch here), a batch of
    one pair, whose prompt (one row) and cache torch.compile would build new graphs for, never checked, runs eager:
    nothing compiles after the probe; without that rule it would. Both give a plain forward's values."""
    from torch._dynamo.utils import counters

    model = build_llama(64, seed=4).eval()
    g = torch.Generator().manual_seed(6)
    ids = lambda n: torch.randint(3, 64, (n,), generator=g).tolist()
    probe = [EncodedPair(ids(p), ids(c), ids(r)) for p, c, r in ((5, 4, 3), (9, 3, 5), (16, 6, 6))]
    logs = []
    compiled, used = compiled_scorer(model, "kv_cache", probe, 0, 0, logs.append, token_budget=10_000)
    assert used and isinstance(compiled, CompiledDecoder) and compiled.proven, logs
    tol = probe_tolerance(torch.float32)

    def check(pairs):
        chosen, rejected, _ = score_pairs(compiled, pairs, 0, 10_000, "kv_cache")
        with torch.no_grad():
            for pair, c, r in zip(pairs, chosen, rejected):
                for got, completion in ((c, pair.chosen_ids), (r, pair.rejected_ids)):
                    assert abs(got.logps - plain_logps(model, pair, completion).numpy()).max() <= tol

    graphs = counters["stats"]["unique_graphs"]
    one = [EncodedPair(ids(11), ids(4), ids(2))]
    check(probe[:2])
    check(one)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after the probe
    compiled.__dict__["proven"] = False
    check(one)
    assert counters["stats"]["unique_graphs"] > graphs  # the graph the rule kept from being built unchecked
