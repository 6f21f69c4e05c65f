"""Checkpoint.start_hashing (runtime/checkpoint.py): the model hash computed in a thread while the job does other
work is the hash computed in line, and a failure reaches whoever asks for the hash, as it would in line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from runtime.checkpoint import Checkpoint
from schemas.stamps import model_hash


def folder_with_weights(root, n: int = 4):
    root.mkdir()
    save_file({f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(n)}, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    return root


def test_the_hash_from_the_thread_is_the_hash_in_line(tmp_path):
    folder = folder_with_weights(tmp_path / "m")
    in_line = Checkpoint.open(str(folder)).base_hash
    checkpoint = Checkpoint.open(str(folder))
    checkpoint.start_hashing()
    pending = checkpoint.__dict__["_hashing"]
    checkpoint.start_hashing()  # a second call starts nothing more
    assert checkpoint.__dict__["_hashing"] is pending
    assert checkpoint.base_hash == in_line == model_hash(folder) == checkpoint.model_hash
    checkpoint.start_hashing()  # known already: nothing to do
    assert "_hashing" not in checkpoint.__dict__


def test_a_failure_in_the_thread_is_raised_where_the_hash_is_asked_for(tmp_path):
    folder = folder_with_weights(tmp_path / "m")
    checkpoint = Checkpoint.open(str(folder))
    (folder / "model.safetensors").write_bytes(b"\0" * 16)  # damaged after open: the header cannot be read
    with pytest.raises(Exception) as in_line:
        model_hash(folder, config=checkpoint.config, files=list(checkpoint.files))
    checkpoint.start_hashing()
    with pytest.raises(type(in_line.value)) as threaded:
        checkpoint.base_hash
    assert str(threaded.value) == str(in_line.value)
