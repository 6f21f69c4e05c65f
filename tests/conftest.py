"""Shared fixtures (a tokenizer, tiny Llama and GPT-2 checkpoints, the train-dpo data set and its cache). The helper
functions and constants live in tests/support.py and are re-exported here."""

from __future__ import annotations

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="refcache-hf-"))
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(os.environ["HF_HOME"], "datasets"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("REFCACHE_HOME", os.path.join(os.environ["HF_HOME"], "refcache"))  # train-dpo's option table

from pathlib import Path

import pytest

from support import (  # noqa: F401  re-exported: test files import these by name from conftest
    CHAT_TEMPLATE, DATA, DPO_PAIRS, HELPERS, LLAMA_TEMPLATE, REPO, TORCHRUN, WORDS, assert_close, assert_not_valid,
    assert_same_values, audit_ref, build_gpt2, paused_in_shard, build_llama, build_tokenizer, check_of, corpus, count_models,
    dir_state, edit_manifest, fake_run, float32_sum, gpt2_style, llama_style, make_lora_adapter, manifest_of,
    precompute_cli, precompute_in_process, precompute_ok, pref_rows, read_cache, records, rewrite_shard,
    rewrite_top_k_shard, run_in_session, save_checkpoint, scored_now, shard_hashes, statuses, step_records,
    write_jsonl,
)


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


# ---------------------------------------------------------------------------------------------------------------
# KL-governed train-dpo (tests/dpo/test_kl_*.py): 16 pairs of data/ and their top-k cache (K = 8) under data/'s model


@pytest.fixture(scope="session")
def kl_pairs(tmp_path_factory) -> tuple[Path, Path]:
    """(the 16 pairs' jsonl, their top-k cache); read only: a test that damages the cache copies it first."""
    base = tmp_path_factory.mktemp("kl-pairs")
    data = base / "pairs.jsonl"
    data.write_text("".join((DATA / "prefs" / "train.jsonl").read_text().splitlines(keepends=True)[:KL_PAIRS]))
    return data, precompute_in_process(DATA / "sft-model", data, base / "cache", rows_per_shard=KL_PAIRS, top_k=8)


KL_PAIRS = 16


# ---------------------------------------------------------------------------------------------------------------
# train-dpo (tests/dpo/, tests/faults/): one small conversational data set and its reference cache, shared by the session


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


@pytest.fixture()
def victim(tmp_path):
    """A file of the user's, outside every folder a command is given (what no write may reach)."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text("precious\n")
    return path
