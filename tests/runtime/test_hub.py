"""runtime/hub.py: a model or data set named by hub id resolves to its snapshot in the local Hugging Face cache; a
missing one names the `hf download` command (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import hub_snapshot, pref_rows, write_jsonl
from runtime.data import load_rows
from runtime.errors import JobError


# issue 16 (what a TRL user expects), item 6: models and data by hub id, through the local Hugging Face cache


def test_model_and_data_by_hub_id(llama_dir, tmp_path):
    from runtime.hub import resolve_model
    from schemas.stamps import model_hash

    hub_snapshot("model", "acme/tiny-sft", {p.name: p for p in llama_dir.iterdir() if p.is_file()})
    write_jsonl(tmp_path / "train.jsonl", pref_rows(4))
    hub_snapshot("dataset", "acme/prefs", {"train.jsonl": tmp_path / "train.jsonl"})
    resolved = resolve_model("acme/tiny-sft")
    assert Path(resolved).is_dir() and model_hash(resolved) == model_hash(llama_dir)
    assert len(load_rows("acme/prefs", "train").rows) == 4
    with pytest.raises(JobError, match=r"not found locally.*hf download acme/missing"):
        resolve_model("acme/missing")
    with pytest.raises(JobError, match=r"hf download acme/nodata --repo-type dataset"):
        load_rows("acme/nodata")
