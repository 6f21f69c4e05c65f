"""runtime/budget.py: `--token-budget auto` sized from free memory figures and a model's shapes (pure functions, fed
made-up memory figures; no GPU needed)."""

from __future__ import annotations

import pytest

from runtime import budget as B
from runtime.budget import Shapes, bytes_per_token, parse_token_budget, size_budget

GIB = 2**30
# a 7B Llama in bfloat16: hidden 4096, MLP 11008, 32 layers of 32 heads (no grouped keys/values), 32000 words
LLAMA_7B = Shapes(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, head_dim=128, vocab=32000,
                  dtype_bytes=2)


def test_parse_token_budget():
    assert parse_token_budget("auto") == "auto" and parse_token_budget("AUTO") == "auto"
    assert parse_token_budget("4096") == 4096 and parse_token_budget(512) == 512
    for bad in ("0", "-3", "lots", "1.5"):
        with pytest.raises(ValueError):
            parse_token_budget(bad)


def test_bytes_per_token_counts_what_the_mode_holds():
    # activations 2 x (4 x 4096 + 3 x 11008) = 98,816; two float32 hidden copies 32,768; padding mask 1024 x 3
    plain = 2 * (4 * 4096 + 3 * 11008) + 8 * 4096 + 1024 * 3
    assert plain == 134_656
    assert bytes_per_token(LLAMA_7B, "full_forward", "sdpa", "hook", 1024) == plain
    # kv_cache: keys and values of 32 layers x 32 heads x 128 x 2 bytes = 524,288 per token, twice (both completions)
    assert bytes_per_token(LLAMA_7B, "kv_cache", "sdpa", "hook", 1024) == plain + 2 * 524_288
    # tree-masked rows are up to twice a sequence wide: the mask doubles
    assert bytes_per_token(LLAMA_7B, "shared_prompt", "sdpa", "hook", 1024) == plain + 1024 * 3
    # flash attention takes no mask; eager holds every head's scores (bf16 + float32 softmax)
    assert bytes_per_token(LLAMA_7B, "varlen", "flash_attention_2", "hook", 1024) == plain - 1024 * 3
    assert bytes_per_token(LLAMA_7B, "full_forward", "eager", "hook", 1024) == plain + 32 * 1024 * 6
    # the model's own head makes a vocabulary of logits per token
    assert bytes_per_token(LLAMA_7B, "full_forward", "sdpa", "logits", 1024) == plain + 32000 * 2


def test_cuda_budget_from_free_memory():
    per_token = bytes_per_token(LLAMA_7B, "full_forward", "sdpa", "hook", 1024)
    got = size_budget(60 * GIB, per_token, 1024, device_type="cuda")
    # 70% of 60 GiB less the head's chunks (3 x 2^25 float32), over 134,656 bytes: 331,916 -> 331,776 (x 1024)
    usable = int(0.7 * 60 * GIB) - 3 * 2**25 * 4
    assert usable // per_token == 331_916
    assert got.tokens == 331_776 and got.free_bytes == 60 * GIB and got.per_token_bytes == per_token
    assert "60.0 GiB free" in got.why and "331,916 tokens" in got.why
    kv = size_budget(60 * GIB, bytes_per_token(LLAMA_7B, "kv_cache", "sdpa", "hook", 1024), 1024, device_type="cuda")
    assert kv.tokens == 36_864  # 37,773 tokens of 1,183,232 bytes, rounded down
    assert size_budget(30 * GIB, per_token, 1024, device_type="cuda").tokens < got.tokens


def test_cuda_budget_bounds():
    huge = size_budget(10_000 * GIB, 1000, 1024, device_type="cuda")
    assert huge.tokens == B.MAX_AUTO and "capped" in huge.why
    short = size_budget(1 * GIB, 10**7, 3000, device_type="cuda")  # not even one sequence fits
    assert short.tokens == 3000 and "memory may run short" in short.why


def test_cpu_keeps_the_default_unless_memory_is_short():
    unknown = size_budget(None, 100_000, 512, device_type="cpu")
    assert unknown.tokens == B.DEFAULT_TOKEN_BUDGET and "unknown" in unknown.why
    plenty = size_budget(64 * GIB, 100_000, 512, device_type="cpu")
    assert plenty.tokens == B.DEFAULT_TOKEN_BUDGET and "the default 16384" in plenty.why
    # a quarter of 4 GiB less the head's chunks, at 100,000 bytes a token: 6,710 -> 6,144
    short = size_budget(4 * GIB, 100_000, 512, device_type="cpu")
    assert (int(0.25 * 4 * GIB) - 3 * 2**25 * 4) // 100_000 == 6_710
    assert short.tokens == 6_144 and "lowered to 6144" in short.why


def test_shapes_and_auto_budget_of_a_model(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2))
    shapes = Shapes.of(model)
    assert shapes == Shapes(hidden=64, intermediate=96, layers=3, heads=4, kv_heads=2, head_dim=16, vocab=300,
                            dtype_bytes=4)
    monkeypatch.setattr(B, "free_memory", lambda model, device_type: 2 * GIB if device_type == "cpu" else None)
    sized = B.auto_budget(model, "kv_cache", "hook", 40)
    assert sized.tokens == B.DEFAULT_TOKEN_BUDGET and sized.free_bytes == 2 * GIB
    assert sized.per_token_bytes == bytes_per_token(shapes, "kv_cache", model.config._attn_implementation or "eager",
                                                    "hook", 40)
    assert sized.note()["tokens"] == B.DEFAULT_TOKEN_BUDGET
