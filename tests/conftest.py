"""Shared fixtures: tiny models and BPE tokenizers built on the spot (nothing comes from a hub)."""

from __future__ import annotations

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="refcache-hf-"))
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(os.environ["HF_HOME"], "datasets"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import random
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WORDS = "the a cat dog sky blue green red sun moon is are was be yes no sure hmm answer question what why how " \
        "one two three four five six seven eight nine ten add and plus minus colour fly swim run jump".split()


def corpus(n=400, seed=0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + rng.choice([".", "?", "!"]) for _ in range(n)]


def build_tokenizer(vocab_size=300, extra_special=(), chat_template=CHAT_TEMPLATE, seed=0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", *extra_special]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    return fast


def build_llama(vocab_size, seed=0, hidden=32, layers=2, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, **overrides,
    )
    return LlamaForCausalLM(cfg).eval()


def build_gpt2(vocab_size, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def save_checkpoint(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tokenizer) -> Path:
    return save_checkpoint(build_llama(len(tokenizer)), tokenizer, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    # A different tokenizer (other seed and size, no chat template) and tied embeddings.
    tok = build_tokenizer(vocab_size=260, chat_template=None, seed=1)
    return save_checkpoint(build_gpt2(len(tok)), tok, tmp_path_factory.mktemp("gpt2"))


def pref_rows(n=24, seed=0, fmt="standard") -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) + "?"
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        b = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        if fmt == "standard":
            row = {"prompt": q, "chosen": "sure " + a, "rejected": "hmm " + b}
        elif fmt == "conversational":
            row = {"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": "sure " + a}],
                   "rejected": [{"role": "assistant", "content": "hmm " + b}]}
        else:  # implicit prompt
            row = {"chosen": q + " sure " + a, "rejected": q + " hmm " + b}
        rows.append({"id": f"r{i:04d}", **row})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------------------------
# train-dpo (tests/test_train*.py): one small conversational data set and its reference cache, shared by the session

DPO_PAIRS = 40


@pytest.fixture(scope="session")
def dpo_data(tmp_path_factory) -> Path:
    """40 conversational preference pairs (ids r0000..r0039), so the chat template shapes the token ids."""
    return write_jsonl(tmp_path_factory.mktemp("dpo-data") / "prefs.jsonl", pref_rows(DPO_PAIRS, fmt="conversational"))


@pytest.fixture(scope="session")
def dpo_cache(tmp_path_factory, llama_dir, dpo_data) -> Path:
    """The reference cache of `dpo_data` under `llama_dir`, in three shards. Tests that damage it copy it first."""
    from precompute.job import PrecomputeConfig, run_precompute

    out = tmp_path_factory.mktemp("dpo-cache") / "cache"
    run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(dpo_data), out=str(out), rows_per_shard=16,
                                    progress=False), log=lambda m: None)
    return out
