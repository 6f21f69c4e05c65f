"""runtime/packing.py: first-fit rows of pairs, their batches, the tree mask of a [prompt | chosen | rejected] row."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from conftest import pref_rows, write_jsonl
from runtime import packing
from runtime.data import encode_rows, load_rows
from schemas.encoding import EncodingConfig


@pytest.fixture(scope="module")
def pairs(llama_dir, tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    data = write_jsonl(tmp_path_factory.mktemp("pack") / "d.jsonl", pref_rows(4, seed=3))
    return encode_rows(load_rows(data), tok, EncodingConfig(chat_template="auto")).pairs


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


def test_tree_mask_sees_prompt_and_own_branch_only(pairs):
    pair = pairs[0]
    inputs, rows, sources, targets = packing.tree_batch(pairs, [[0, 1]], 0, torch.float32, "cpu")
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
