"""precompute/modes/: every batching mode gives the plain forward's numbers; auto takes the cheapest mode that
reproduces the reference on a probe, and falls back (once, saying why) where one does not."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import pref_rows, write_jsonl
from precompute import modes
from precompute.job import PrecomputeConfig, run_precompute
from precompute.modes import REGISTRY, choose_mode, kv_cache, score_pairs, shared_prompt, varlen
from runtime import packing
from runtime.data import encode_rows, load_rows
from schemas.encoding import EncodedPair, EncodingConfig


def plain_logps(model, pair) -> tuple[np.ndarray, np.ndarray]:
    """Independent reference: one unpadded [prompt | completion] forward per completion."""
    out = []
    for completion in (pair.chosen_ids, pair.rejected_ids):
        ids = torch.tensor([pair.prompt_ids + completion])
        with torch.no_grad():
            logp = model(ids).logits.float().log_softmax(-1)[0]
        start = len(pair.prompt_ids)
        out.append(np.array([logp[t - 1, ids[0, t]].item() for t in range(start, ids.shape[1])]))
    return tuple(out)


@pytest.fixture(scope="module", params=["llama_dir", "gpt2_dir"])
def scored(request, tmp_path_factory):
    path = request.getfixturevalue(request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    data = write_jsonl(tmp_path_factory.mktemp("pack") / "d.jsonl", pref_rows(30, seed=3))
    pairs = encode_rows(load_rows(data), tok, EncodingConfig(chat_template="auto")).pairs
    return model, pairs, tok.pad_token_id


# ---------------------------------------------------------------------------------------------------------------
# each mode: the plain forward's numbers


def logps_of(scored):
    """score_pairs' (chosen, rejected, stats) with each TokenScores' log-probs."""
    chosen, rejected, stats = scored
    return [c.logps for c in chosen], [r.logps for r in rejected], stats


@pytest.mark.parametrize("mode", list(REGISTRY))
def test_modes_equal_plain_forward(scored, mode):
    model, pairs, pad = scored
    chosen, rejected, stats = logps_of(score_pairs(model, pairs, pad, token_budget=256, mode=mode))
    assert len(chosen) == len(rejected) == len(pairs)  # every pair scored (zip would stop at the shorter)
    worst = 0.0
    for pair, c, r in zip(pairs, chosen, rejected):
        pc, pr = plain_logps(model, pair)
        assert c.shape == pc.shape and r.shape == pr.shape
        worst = max(worst, np.abs(c - pc).max(), np.abs(r - pr).max())
    assert worst < 1e-5
    prompts = sum(len(p.prompt_ids) for p in pairs)
    completions = sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    assert stats["tokens"] == 2 * prompts + completions  # the plain sequences' tokens, whatever the mode
    if mode in ("full_forward", "varlen", "single"):
        assert stats["processed"] == stats["tokens"]
    elif mode == "kv_cache":  # each prompt once; a completion's last token is never an input
        assert stats["processed"] == prompts + completions - 2 * len(pairs)
    else:
        assert stats["processed"] == prompts + completions  # the tree runs each prompt once
    if mode in ("varlen", "single"):
        assert stats["slots"] == stats["processed"]  # no padding at all
    if mode == "packed":
        assert stats["slots"] - stats["processed"] < 0.2 * stats["slots"]


@pytest.mark.parametrize("mode", ["kv_cache", "packed", "varlen", "single"])
def test_one_token_completions(scored, mode):
    model, pairs, pad = scored
    one = lambda ids: ids[:1]
    mixed = [EncodedPair(p.prompt_ids, one(p.chosen_ids), p.rejected_ids) for p in pairs[:6]]
    only = [EncodedPair(p.prompt_ids, one(p.chosen_ids), one(p.rejected_ids)) for p in pairs[6:9]]
    for group in (mixed + only, only):  # one-token completions beside longer ones, and alone in a batch
        chosen, rejected, _ = logps_of(score_pairs(model, group, pad, token_budget=4096, mode=mode))
        assert len(chosen) == len(rejected) == len(group)
        for pair, c, r in zip(group, chosen, rejected):
            pc, pr = plain_logps(model, pair)
            assert c.shape == pc.shape and r.shape == pr.shape
            assert max(np.abs(c - pc).max(), np.abs(r - pr).max()) < 1e-5


@pytest.mark.parametrize("mode", ["kv_cache", "packed"])
def test_bfloat16_within_the_recorded_dtype_tolerance(scored, mode):
    model, pairs, pad = scored
    half = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.bfloat16).eval()
    want_c, want_r, _ = logps_of(score_pairs(half, pairs, pad, 256, "full_forward"))
    got_c, got_r, _ = logps_of(score_pairs(half, pairs, pad, 256, mode))
    assert len(got_c) == len(got_r) == len(want_c) == len(pairs)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(want_c + want_r, got_c + got_r))
    assert diff <= 5e-2  # well inside the probe's bf16 tolerance (runtime/tolerance.py: 0.25)


def test_kv_and_varlen_batches_fit_the_budget():
    rng = np.random.default_rng(0)
    pairs = [EncodedPair([1] * int(rng.integers(1, 60)), [2] * int(rng.integers(1, 30)), [3] * int(rng.integers(1, 30)))
             for _ in range(200)]
    batches = kv_cache.kv_batches(pairs, 600)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        p = max(len(pairs[i].prompt_ids) for i in b)
        c = max(max(len(pairs[i].chosen_ids), len(pairs[i].rejected_ids)) for i in b)
        assert len(b) == 1 or len(b) * (p + 2 * c) <= 600
    lengths = [int(x) for x in rng.integers(1, 100, size=300)]
    batches = varlen.varlen_batches(lengths, 500)
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert all(len(b) == 1 or sum(lengths[i] for i in b) <= 500 for b in batches)


def test_estimated_cost_by_hand():
    pairs = [EncodedPair([1, 2, 3, 4], [5, 6, 2], [7, 2])] * 2  # P 4, C 3, R 2; sequences 7, 6, 7, 6
    h = 10
    assert modes.estimated_cost(pairs, "full_forward", 1000, h) == 4 * 7 + 4 * 49 / 60
    assert modes.estimated_cost(pairs, "varlen", 1000, h) == 26 + (49 + 36 + 49 + 36) / 2 / 60
    assert modes.estimated_cost(pairs, "single", 1000, h) == 26 + (49 + 36 + 49 + 36) / 2 / 60  # varlen, row by row
    # kv_cache: 2 prompts of 4, then 2 x 2 continuations of 2 inputs attending to 4 + 2 keys.
    # Prompts of equal length need no padding mask, so the kernel skips the upper triangle.
    assert modes.estimated_cost(pairs, "kv_cache", 1000, h) == 2 * (4 + 2 * 2) + 2 * (16 / 2 + 2 * 2 * 6) / 60
    same = [EncodedPair([1, 2, 3, 4], [5, 2], [7, 2])] * 2  # four sequences of 6: causal without a mask
    assert modes.estimated_cost(same, "full_forward", 1000, h) == 4 * 6 + 4 * 36 / 2 / 60
    assert modes.estimated_cost(pairs, "shared_prompt", 1000, h) == 2 * 9 + 2 * 81 / 60
    assert modes.estimated_cost(pairs, "packed", 1000, h) == 2 * 9 + 2 * 81 / 60  # two 9-token pairs never fit in 9


# ---------------------------------------------------------------------------------------------------------------
# choosing: auto, the probe, the fall-backs


def _broken_tree(real):
    def ignores_branches(*args, **kwargs):  # as if the attention ignored the custom mask
        inputs, *rest = real(*args, **kwargs)
        width = inputs["input_ids"].shape[1]
        causal = torch.full((width, width), torch.finfo(torch.float32).min).triu(1)
        return {**inputs, "attention_mask": causal.expand_as(inputs["attention_mask"])}, *rest
    return ignores_branches


def _raises(*args, **kwargs):
    raise TypeError("forward() got an unexpected keyword argument 'cache'")


def test_unsupported_mask_falls_back_once(scored, monkeypatch):
    model, pairs, pad = scored
    monkeypatch.setattr(shared_prompt, "tree_batch", _broken_tree(packing.tree_batch))
    messages = []
    assert choose_mode(model, "packed", pairs, 99, pad, 4096, messages.append) == "full_forward"
    assert len(messages) == 1 and "packed: differs from the reference forward" in messages[0]
    monkeypatch.setattr(kv_cache, "kv_cache_batch", _raises)
    messages.clear()
    assert choose_mode(model, "auto", pairs, 99, pad, 4096, messages.append) == "full_forward"
    assert len(messages) == 1
    assert "packed: differs" in messages[0] and "kv_cache: not supported by this model (TypeError" in messages[0]
    monkeypatch.undo()
    messages.clear()
    assert choose_mode(model, "auto", pairs, 99, pad, 4096, messages.append) in ("packed", "kv_cache")
    assert len(messages) == 1 and "matches the reference forward" in messages[0]


def test_auto_takes_the_cheapest_mode(scored):
    model, _pairs, pad = scored
    long_prompts = [EncodedPair([1] + [7] * 299, [8] * 20 + [2], [9] * 15 + [2]) for _ in range(4)]
    hidden = model.config.get_text_config().hidden_size
    cost = {m: modes.estimated_cost(long_prompts, m, 4096, hidden) for m in REGISTRY}
    assert min(cost, key=cost.get) == "kv_cache" and cost["full_forward"] > 1.6 * cost["kv_cache"]
    assert choose_mode(model, "auto", long_prompts, 321, pad, 4096, lambda m: None) == "kv_cache"
    # Short prompts, long completions of mixed lengths: packing removes more work than sharing the prompt.
    short = [EncodedPair([1, 5], [8] * n + [2], [9] * (60 - n) + [2]) for n in range(5, 55, 3)]
    cost = {m: modes.estimated_cost(short, m, 4096, hidden) for m in modes.candidates("sdpa")}
    assert min(cost, key=cost.get) == "packed"
    assert choose_mode(model, "auto", short, 63, pad, 4096, lambda m: None) == "packed"
    # The candidates per attention implementation: the tree mask needs sdpa or eager, varlen flash attention.
    assert modes.candidates("sdpa") == modes.candidates("eager") == ("packed", "kv_cache", "full_forward")
    assert modes.candidates("flash_attention_2") == ("kv_cache", "varlen", "full_forward")
    assert modes.candidates("flex_attention") == ("kv_cache", "full_forward")


def test_a_mode_asked_for_by_name(scored):
    model, pairs, pad = scored
    messages = []
    assert choose_mode(model, "varlen", pairs, 99, pad, 4096, messages.append) == "varlen"
    assert messages[0].startswith("warning: varlen with sdpa attention builds a dense mask")
    assert messages[1] == "batching: varlen (sdpa attention; matches the reference forward on a probe)"
    with pytest.raises(ValueError, match="unknown batching mode 'nope'; one of full_forward, varlen, kv_cache"):
        choose_mode(model, "nope", pairs, 99, pad, 4096, messages.append)


def test_sliding_window_models_keep_the_plain_forward(scored, monkeypatch):
    model, pairs, pad = scored
    monkeypatch.setattr(model.config, "sliding_window", 16, raising=False)
    monkeypatch.setattr(model.config, "layer_types", ["sliding_attention"] * 2, raising=False)
    assert modes.unsupported("kv_cache", model, 40).startswith("sliding-window attention (window 16")
    assert modes.unsupported("packed", model, 40) is not None
    assert modes.unsupported("kv_cache", model, 16) is None  # every sequence fits the window
    messages = []
    assert choose_mode(model, "auto", pairs, 40, pad, 4096, messages.append) == "full_forward"
    assert "sliding-window" in messages[0]


def test_length_dependent_rope_keeps_the_plain_forward(llama_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    monkeypatch.setattr(model.config, "rope_parameters",
                        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, raising=False)
    monkeypatch.setattr(model.config, "max_position_embeddings", 64, raising=False)
    assert modes.unsupported("kv_cache", model, 65).startswith("dynamic RoPE picks its frequencies")
    assert "changes past 64" in modes.unsupported("full_forward", model, 65)
    assert modes.unsupported("packed", model, 65) is not None
    assert modes.unsupported("kv_cache", model, 64) is None
    assert modes.unsupported("single", model, 65) is None


def test_probe_includes_a_padded_prompt_and_recurrent_layers_refuse_the_cache(scored, monkeypatch):
    model, _pairs, _pad = scored
    sample = [EncodedPair([1] * n, [2] * 3, [3] * 2) for n in (9, 4, 4, 5, 30)]
    assert [len(p.prompt_ids) for p in modes.probe_pairs(sample)] == [4, 5, 30]  # and the longest, whole
    assert [len(p.prompt_ids) for p in modes.probe_pairs(sample[1:3])] == [4, 3]  # cut to differ
    long = [EncodedPair(list(range(1, 400)), [5] * 90, [6] * 70), EncodedPair(list(range(1, 300)), [5] * 99, [6] * 9)]
    probe = modes.probe_pairs(long)  # a few tokens of the short pairs, prompts still padded; the longest whole
    assert [(len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)) for p in probe] == [(24, 8, 7), (23, 8, 7),
                                                                                             (399, 90, 70)]
    assert probe[0].prompt_ids == long[1].prompt_ids[:24]
    # the job's longest pair (`long_pairs`) joins the probe unless one of its lengths is already there
    twin = EncodedPair(list(range(2, 401)), [7] * 90, [8] * 70)  # other tokens, the same lengths as long[0]
    other = EncodedPair(list(range(2, 401)), [7] * 91, [8] * 70)
    assert modes.probe_pairs(long, long_pairs=[twin])[-1] is long[0]
    assert len(modes.probe_pairs(long, long_pairs=[twin])) == 3
    assert modes.probe_pairs(long, long_pairs=[other])[-2:] == [long[0], other]
    monkeypatch.setattr(model.config, "layer_types", ["full_attention", "linear_attention"], raising=False)
    assert "linear_attention" in modes.unsupported("kv_cache", model, 10)
    assert "carry state across a packed row" in modes.unsupported("varlen", model, 10)
    assert modes.unsupported("full_forward", model, 10) is None


def test_probe_batches_pad_short_pairs_apart_from_the_long_one(scored):
    """The padded layouts probe the long pair alone and the short ones as a padded batch of their own; packed still
    packs the short pairs into one row beside the long one. Every layout's probe values are the plain forward's."""
    model, pairs, pad = scored
    long = max(pairs, key=lambda p: len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids))
    probe = modes.probe_pairs(pairs, prompt_cap=3, completion_cap=3, long_pairs=[long])
    short = [i for i, p in enumerate(probe) if p is not long]
    assert len(short) == 2 and probe[-1] is long
    kv = REGISTRY["kv_cache"].plan(probe, REGISTRY["kv_cache"].probe_budget(probe))
    assert kv == [[len(probe) - 1], short]
    full = REGISTRY["full_forward"].plan(probe, REGISTRY["full_forward"].probe_budget(probe))
    long_seqs = {2 * (len(probe) - 1), 2 * len(probe) - 1}  # [prompt | chosen], [prompt | rejected] of the long pair
    assert sorted(b for b in full if long_seqs & set(b)) == [[s] for s in sorted(long_seqs)]
    assert sorted(i for b in full if not long_seqs & set(b) for i in b) == list(range(2 * len(short)))
    assert any(len(b) > 1 for b in full)  # the short sequences padded together
    packed = REGISTRY["packed"].plan(probe, REGISTRY["packed"].probe_budget(probe))
    assert len(packed) == 1 and sorted(i for row in packed[0] for i in row) == list(range(len(probe)))
    assert any(len(row) > 1 for row in packed[0])  # the short pairs share a row
    for mode in ("kv_cache", "full_forward", "packed"):
        got = modes.choose.mode_values(model, mode, probe, pad)
        want = [v for p in probe for v in plain_logps(model, p)]
        np.testing.assert_allclose(np.concatenate([v.logps for v in got]), np.concatenate(want), atol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# the job: the mode is recorded, the numbers and stamps do not depend on it


def test_mode_recorded_and_stamps_unchanged(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(20, seed=4, fmt="conversational"))
    manifests, values = {}, {}
    for mode in ("full_forward", "packed", "kv_cache"):
        out = tmp_path / mode
        run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(data), out=str(out), batching=mode,
                                        progress=False), log=lambda m: None)
        manifests[mode] = json.loads((out / "manifest.json").read_text())
        values[mode] = pl.read_parquet(out / "shard-00000.parquet")
    a = values["full_forward"]
    for mode in ("packed", "kv_cache"):
        assert manifests[mode]["computation"]["mode"] == mode
        assert manifests[mode]["computation"]["batching"] == REGISTRY[mode].description
        assert manifests[mode]["stamps"] == manifests["full_forward"]["stamps"]
        b = values[mode]
        assert a["id"].to_list() == b["id"].to_list()
        assert a["mask_checksum"].to_list() == b["mask_checksum"].to_list()
        for col in ("chosen_logps", "rejected_logps"):
            diff = np.abs(np.concatenate(a[col].to_list()) - np.concatenate(b[col].to_list()))
            assert diff.max() < 1e-5


def test_cli_logs_and_records_the_choice(llama_dir, tmp_path):
    from click.testing import CliRunner

    from precompute.cli import main

    rows = pref_rows(12, seed=5)
    for r in rows:  # a long shared context, short answers: sharing the prompt is the cheapest
        r["prompt"] = " ".join([r["prompt"]] * 12)
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    runs = {}
    for batching in ("auto", "full_forward"):
        out = tmp_path / batching
        result = CliRunner().invoke(main, ["--model", str(llama_dir), "--data", str(data), "--out", str(out),
                                           "--batching", batching, "--no-progress"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        choice = [line for line in result.output.splitlines() if line.startswith("batching: ")]
        assert len(choice) == 1  # said once
        runs[batching] = (choice[0], json.loads((out / "manifest.json").read_text()))
    line, manifest = runs["auto"]
    mode = line.split()[1]
    assert mode in ("packed", "kv_cache")  # both share the prompt; which is cheaper depends on the model's width
    assert line.startswith(f"batching: {mode} (sdpa attention; estimated ") and "matches the reference forward" in line
    assert manifest["computation"]["mode"] == mode
    assert runs["full_forward"][0] == "batching: full_forward (sdpa attention; matches the reference forward on a probe)"
    assert runs["full_forward"][1]["computation"]["mode"] == "full_forward"
    assert manifest["stamps"] == runs["full_forward"][1]["stamps"]
