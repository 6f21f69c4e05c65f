"""runtime/architecture.py: the architecture rules both jobs' fast paths follow (precompute-ref's tree-mask modes,
train-dpo's prefix_shared layout), each written once."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import build_llama

from dpo.layout import choose_layout
from precompute.modes import REGISTRY
from runtime.architecture import shape_dependent, state_layers, tree_mask_unsupported

VOCAB = 64


def bloom():
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)).eval()


def with_state_layers():
    model = build_llama(VOCAB)
    model.config.layer_types = ["full_attention", "linear_attention"]  # as hybrid models list their layers
    return model


def dynamic_rope():
    return build_llama(VOCAB, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 32})


CASES = {  # model, the words the reason must contain (None: the tree mask is allowed)
    "plain llama": (lambda: build_llama(VOCAB), None),
    "window shorter than the data": (lambda: build_llama(VOCAB, sliding_window=16,
                                                         layer_types=["sliding_attention"] * 2), "window 16"),
    "window longer than the data": (lambda: build_llama(VOCAB, sliding_window=512,
                                                        layer_types=["sliding_attention"] * 2), None),
    "dynamic RoPE past its threshold": (dynamic_rope, "dynamic RoPE"),
    "ALiBi": (bloom, "ALiBi"),
    "recurrent layers": (with_state_layers, "linear_attention"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_rule_fires_where_it_should_and_only_there(case):
    make, words = CASES[case]
    reason = tree_mask_unsupported(make(), longest=64)
    if words is None:
        assert reason is None
    else:
        assert reason is not None and words in reason, reason


def test_attention_implementations_without_a_custom_mask_are_refused():
    model = build_llama(VOCAB)
    assert tree_mask_unsupported(model, 64, "sdpa") is None and tree_mask_unsupported(model, 64, "eager") is None
    for attn in ("flash_attention_2", "flex_attention"):
        assert tree_mask_unsupported(model, 64, attn) == f"{attn} attention cannot take the tree mask"


def test_facts_read_from_the_config():
    assert state_layers(with_state_layers()) == ["linear_attention"] and state_layers(build_llama(VOCAB)) == []
    assert shape_dependent(dynamic_rope(), longest=16) is None  # within the original context nothing changes
    assert "dynamic RoPE" in shape_dependent(dynamic_rope(), longest=64)


def _table(n=6, prompt=40, completion=6, seed=0):
    rng = np.random.default_rng(seed)
    ids = lambda k: rng.integers(3, VOCAB, size=k).tolist()
    return pa.Table.from_pylist([{"prompt_ids": ids(prompt), "chosen_ids": ids(completion),
                                  "rejected_ids": ids(completion)} for _ in range(n)])


@pytest.mark.parametrize("case", ["ALiBi", "recurrent layers", "window shorter than the data"])
def test_both_jobs_refuse_the_tree_mask_for_the_same_reason(case):
    """train-dpo's layout and precompute's shared_prompt/packed modes turn a model down with one and the same
    reason (before, train-dpo knew only the window and RoPE rules and left ALiBi and recurrent layers to its probe)."""
    model = CASES[case][0]()
    attn = model.config._attn_implementation
    reasons = {REGISTRY[name].unsupported(model, 46, attn) for name in ("shared_prompt", "packed")}
    logs: list[str] = []
    assert choose_layout("prefix_shared", [model], _table(), 4, 0, logs.append) == "padded"
    assert len(reasons) == 1 and None not in reasons
    assert logs == [f"batch layout: padded, although prefix_shared was requested ({reasons.pop()})"]
