"""runtime/checkpoint.py: a checkpoint folder opened once (Checkpoint), its refusals, hash, tokenizer and model."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_llama, build_tokenizer, make_lora_adapter, save_checkpoint
from runtime.checkpoint import Checkpoint
from runtime.errors import JobError
from schemas import stamps
from schemas.stamps import WeightsError, adapter_hash, merged_model_hash, model_hash

_OPENED: list[str] | None = None  # paths opened while a test records them (audit hooks cannot be removed)


def _record_opens(event, args):
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_record_opens)


@pytest.fixture
def opened():
    """Every file path the process opens during the test (builtins.open, io.open, Path.read_text, ...)."""
    global _OPENED
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


@pytest.fixture
def folder(tmp_path, llama_dir) -> Path:
    """A copy of the tiny Llama checkpoint that a test may damage."""
    return Path(shutil.copytree(llama_dir, tmp_path / "model"))


def test_open_reads_config_once_and_hashes_once(llama_dir, opened, monkeypatch):
    hashed = []
    real = stamps._hash_tensors
    monkeypatch.setattr(stamps, "_hash_tensors", lambda h, tensors: (hashed.append(len(tensors)), real(h, tensors)))
    checkpoint = Checkpoint.open(str(llama_dir))
    first, again = checkpoint.model_hash, checkpoint.model_hash
    assert checkpoint.base_hash == first == again
    config_reads = [p for p in opened if Path(p).name == "config.json"]
    assert config_reads == [str(llama_dir / "config.json")]  # open parsed it; the hash used what open read
    assert len(hashed) == 1
    # Control: the plain stamps function reads config.json again (twice: weight files and fingerprint) and hashes.
    assert model_hash(llama_dir) == first
    assert len([p for p in opened if Path(p).name == "config.json"]) > 1 and len(hashed) == 2


def test_hash_is_schemas_model_hash(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = Checkpoint.open(str(llama_dir))
    assert checkpoint.model_hash == model_hash(llama_dir)
    assert checkpoint.config == json.loads((llama_dir / "config.json").read_text())
    assert checkpoint.files == ((llama_dir / "model.safetensors").resolve(),)
    # A sharded copy: the files are the shards the index names, and the hash does not depend on the split.
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(sharded, max_shard_size="20KB")
    AutoTokenizer.from_pretrained(llama_dir).save_pretrained(sharded)
    split = Checkpoint.open(str(sharded))
    assert len(split.files) > 1 and all(f.name.startswith("model-") for f in split.files)
    assert split.model_hash == model_hash(sharded) == checkpoint.model_hash
    # Another model hashes differently (the check above could fail).
    tok = build_tokenizer()
    other = save_checkpoint(build_llama(len(tok), seed=1), tok, tmp_path / "other")
    assert Checkpoint.open(str(other)).model_hash != checkpoint.model_hash


def test_tokenizer_loaded_once_and_pad_id(llama_dir, monkeypatch):
    import transformers

    calls = []
    real = transformers.AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: (calls.append(a[0]), real(cls, *a, **k))[1]))
    checkpoint = Checkpoint.open(str(llama_dir))
    assert calls == []  # nothing loaded until asked for
    tokenizer = checkpoint.tokenizer
    assert checkpoint.tokenizer is tokenizer and calls == [str(llama_dir)]
    assert checkpoint.pad_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<pad>")
    tokenizer.pad_token = None
    assert checkpoint.pad_id == tokenizer.eos_token_id  # no pad token: EOS


def test_load_model_gives_the_plain_transformers_model(llama_dir):
    from transformers import AutoModelForCausalLM

    checkpoint = Checkpoint.open(str(llama_dir))
    model = checkpoint.load_model(torch.float32, torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    trainable = checkpoint.load_model(torch.float32, trainable=True)
    assert all(p.requires_grad for p in trainable.parameters())
    assert checkpoint.load_model(torch.bfloat16, attn="eager").config._attn_implementation == "eager"
    assert checkpoint.load_model(torch.bfloat16).dtype == torch.bfloat16
    assert checkpoint.attention_choices()[:2] == ["eager", "sdpa"]


def test_adapter_is_checked_at_open_hashed_with_the_base_and_merged_on_load(llama_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    adapter = make_lora_adapter(llama_dir, tmp_path / "lora", seed=7)
    checkpoint = Checkpoint.open(str(llama_dir), adapter=str(adapter))
    assert checkpoint.adapter_hash == adapter_hash(adapter)
    assert checkpoint.base_hash == model_hash(llama_dir)
    assert checkpoint.model_hash == merged_model_hash(model_hash(llama_dir), adapter_hash(adapter))
    assert checkpoint.model_hash != checkpoint.base_hash
    merged = checkpoint.load_model(torch.float32, torch.device("cpu"))
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    unmerged = peft.PeftModel.from_pretrained(base, adapter).eval()  # the adapter applied beside the weights
    ids = torch.tensor([[5, 17, 42, 9, 3, 8]])
    with torch.no_grad():
        want = unmerged(ids).logits
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
        plain = Checkpoint.open(str(llama_dir)).load_model(torch.float32)(ids).logits
    assert (plain - want).abs().max() > 1e-3  # the adapter changes the model, so the check above can fail
    assert type(merged).__name__ == "LlamaForCausalLM"  # a plain transformers model again

    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match=r"the adapter .*empty: .*empty: no adapter_model\.safetensors"):
        Checkpoint.open(str(llama_dir), adapter=str(tmp_path / "empty"))
    no_config = Path(shutil.copytree(adapter, tmp_path / "no-config"))
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(JobError, match=r"the adapter .*no-config: .*not a peft adapter folder \(no adapter_config"):
        Checkpoint.open(str(llama_dir), adapter=str(no_config))
    pickled = Path(shutil.copytree(adapter, tmp_path / "pickled"))
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(JobError, match=r"only pickle weights adapter_model\.bin"):
        Checkpoint.open(str(llama_dir), adapter=str(pickled))


def _damage(folder: Path, how: str) -> None:
    config = folder / "config.json"
    if how == "no_config":
        config.unlink()
    elif how == "config_not_json":
        config.write_text('{"model_type": "llama",')
    elif how == "config_not_object":
        config.write_text("[1, 2]")
    elif how == "pickle_only":
        (folder / "model.safetensors").unlink()
        (folder / "pytorch_model.bin").write_bytes(b"not really")
    elif how == "no_weights":
        (folder / "model.safetensors").unlink()
    elif how == "remote_code":
        data = json.loads(config.read_text())
        config.write_text(json.dumps({**data, "auto_map": {"AutoModelForCausalLM": "custom.Model"}}))
    elif how in ("hub_kernel", "hub_kernel_in_a_sub_config"):  # hostile pass: reached at --attn-implementation auto
        data = json.loads(config.read_text())
        asked = {"_attn_implementation": "kernels-community/flash-attn"}
        config.write_text(json.dumps({**data, **(asked if how == "hub_kernel" else {"text_config": asked})}))


REFUSALS = {  # damage -> (error type, message with {m} for the folder)
    "no_config": (JobError, "{m}: not a Hugging Face checkpoint folder (no config.json)"),
    "config_not_json": (JobError, "{m}/config.json: not valid JSON"),
    "config_not_object": (JobError, "{m}/config.json: not a JSON object"),
    "pickle_only": (WeightsError, "{m}: only pickle weights (pytorch_model.bin); refcache loads safetensors only"),
    "no_weights": (WeightsError, "{m}: no model.safetensors or model.safetensors.index.json, which is what "
                                 "transformers loads"),
    "remote_code": (JobError, "{m}: this model needs custom code from its folder (auto_map in config.json); refcache "
                              "does not run it unless you pass --trust-remote-code"),
    "hub_kernel": (JobError, "{m}: its config.json asks for the attention kernel 'kernels-community/flash-attn', code "
                             "downloaded from the hub and run; refcache does not run it unless you pass "
                             "--trust-remote-code"),
    "hub_kernel_in_a_sub_config": (JobError, "{m}: its config.json asks for the attention kernel"),
}


@pytest.mark.parametrize("how", sorted(REFUSALS))
def test_refusals_keep_their_messages(folder, how):
    _damage(folder, how)
    kind, message = REFUSALS[how]
    with pytest.raises(kind) as caught:
        Checkpoint.open(str(folder))
    assert message.format(m=folder) in str(caught.value)


def test_custom_code_is_opened_only_when_allowed(folder):
    _damage(folder, "remote_code")
    checkpoint = Checkpoint.open(str(folder), trust_remote_code=True)  # opening runs no code
    assert checkpoint.trust_remote_code and checkpoint.config["auto_map"]


def test_a_missing_tokenizer_is_refused_when_first_asked_for(folder):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    checkpoint = Checkpoint.open(str(folder))  # the weights and config are fine
    with pytest.raises(JobError, match=f"{folder}: its tokenizer cannot be loaded"):
        checkpoint.tokenizer
