"""Shared-prompt and packed scoring: each prompt once, same numbers as the plain full-sequence forward."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import pref_rows, write_jsonl
from precompute import job, packing
from precompute.data import encode_rows, load_rows
from precompute.job import PrecomputeConfig, choose_mode, run_precompute, score_pairs
from schemas.encoding import EncodingConfig


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


@pytest.mark.parametrize("mode", ["shared_prompt", "packed", "full_forward"])
def test_modes_equal_plain_forward(scored, mode):
    model, pairs, pad = scored
    chosen, rejected, stats = score_pairs(model, pairs, pad, token_budget=256, mode=mode)
    worst = 0.0
    for pair, c, r in zip(pairs, chosen, rejected):
        pc, pr = plain_logps(model, pair)
        assert c.shape == pc.shape and r.shape == pr.shape
        worst = max(worst, np.abs(c - pc).max(), np.abs(r - pr).max())
    assert worst < 1e-5
    prompts = sum(len(p.prompt_ids) for p in pairs)
    completions = sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    assert stats["tokens"] == 2 * prompts + completions  # the plain sequences' tokens, whatever the mode
    expected_processed = stats["tokens"] if mode == "full_forward" else prompts + completions
    assert stats["processed"] == expected_processed  # shared modes run each prompt once
    if mode == "packed":
        assert stats["slots"] - stats["processed"] < 0.2 * stats["slots"]


def test_pack_rows_fits_and_covers():
    lengths = [50, 7, 30, 30, 12, 90, 5, 5]
    rows = packing.pack_rows(lengths, True)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 90 for r in rows)  # never longer than the longest pair
    assert len(rows) < len(lengths)
    assert packing.pack_rows(lengths, False) == [[i] for i in sorted(range(8), key=lambda i: (-lengths[i], i))]
    batches = packing.row_batches(rows, lengths, token_budget=200)
    assert sorted(i for b in batches for r in b for i in r) == list(range(len(lengths)))
    for batch in batches:
        width = max(sum(lengths[i] for i in r) for r in batch)
        assert len(batch) == 1 or len(batch) * width <= 200


def test_tree_mask_sees_prompt_and_own_branch_only(scored):
    model, pairs, pad = scored
    pair = pairs[0]
    inputs, rows, sources, targets = packing.tree_batch(pairs, [[0, 1]], pad, torch.float32, "cpu")
    visible = inputs["attention_mask"][0, 0] == 0
    P, C, R = len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)
    first_rejected = P + C
    assert visible[first_rejected, :P].all()  # the prompt
    assert not visible[first_rejected, P : P + C].any()  # never the chosen branch
    assert not visible[P, P + C :].any()  # chosen never sees rejected or the next pair
    assert not visible[P + C + R :, : P + C + R].any()  # the second pair never sees the first
    assert inputs["position_ids"][0, first_rejected] == P  # rejected positions restart after the prompt
    assert sources[C] == P - 1  # first rejected token scored from the prompt's last position
    assert len(targets) == C + R + len(pairs[1].chosen_ids) + len(pairs[1].rejected_ids)


def test_unsupported_mask_falls_back_once(scored, monkeypatch):
    model, pairs, pad = scored
    real = packing.tree_batch

    def ignores_branches(*args, **kwargs):  # as if the attention ignored the custom mask
        inputs, *rest = real(*args, **kwargs)
        width = inputs["input_ids"].shape[1]
        causal = torch.full((width, width), torch.finfo(torch.float32).min).triu(1)
        return {**inputs, "attention_mask": causal.expand_as(inputs["attention_mask"])}, *rest

    monkeypatch.setattr(job, "tree_batch", ignores_branches)
    messages = []
    assert choose_mode(model, "auto", pairs[:4], pad, messages.append) == "full_forward"
    assert len(messages) == 1 and "using full_forward" in messages[0]
    monkeypatch.setattr(job, "tree_batch", real)
    messages.clear()
    assert choose_mode(model, "auto", pairs[:4], pad, messages.append) == "packed"


def test_mode_recorded_and_stamps_unchanged(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(20, seed=4, fmt="conversational"))
    manifests, values = {}, {}
    for mode in ("full_forward", "packed"):
        out = tmp_path / mode
        run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(data), out=str(out), batching=mode,
                                        progress=False), log=lambda m: None)
        manifests[mode] = json.loads((out / "manifest.json").read_text())
        values[mode] = pl.read_parquet(out / "shard-00000.parquet")
    assert manifests["packed"]["computation"]["mode"] == "packed"
    assert manifests["full_forward"]["computation"]["mode"] == "full_forward"
    assert manifests["packed"]["stamps"] == manifests["full_forward"]["stamps"]
    a, b = values["full_forward"], values["packed"]
    assert a["id"].to_list() == b["id"].to_list()
    assert a["mask_checksum"].to_list() == b["mask_checksum"].to_list()
    for col in ("chosen_logps", "rejected_logps"):
        diff = np.abs(np.concatenate(a[col].to_list()) - np.concatenate(b[col].to_list()))
        assert diff.max() < 1e-5
