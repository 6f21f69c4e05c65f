"""Issue 34 family 7: the data read is what `datasets` itself resolves. A data folder (or hub data set) whose dataset
card (README.md) has `configs` is read from the files of the chosen config and no other, split by the card; the
config and files are recorded in the cache's manifest, and train-dpo and audit-ref read the data as the cache did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import audit_ref, check_of, manifest_of, pref_rows, write_jsonl
from support import hub_snapshot
from conftest import precompute_cli as cli, precompute_ok as ok
from runtime.data import DataError, load_rows, recorded_config

ONE_CONFIG = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: chosen/*.jsonl
---
# a data set whose card reads only chosen/
"""

TWO_CONFIGS = """---
configs:
- config_name: small
  data_files:
  - split: train
    path: small.jsonl
- config_name: large
  data_files:
  - split: train
    path: large-train.jsonl
  - split: test
    path: large-test.jsonl
---
"""


@pytest.fixture()
def isolated_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return tmp_path / "datasets-cache"


def loaded_by_datasets(path, split="train", name=None, cache_dir=None) -> list[dict]:
    import datasets

    return datasets.load_dataset(str(path), name, split=split, cache_dir=str(cache_dir)).to_list()


def card_folder(base: Path) -> Path:
    """8 rows the card chooses (chosen/a.jsonl) and 8 it does not (other.jsonl, beside it)."""
    write_jsonl(base / "chosen" / "a.jsonl", pref_rows(8, seed=1))
    write_jsonl(base / "other.jsonl", pref_rows(8, seed=2))
    (base / "README.md").write_text(ONE_CONFIG)
    return base


def test_a_cards_config_chooses_the_files_as_load_dataset_does(tmp_path, isolated_hf):
    data = card_folder(tmp_path / "d")
    source = load_rows(data)
    want = loaded_by_datasets(data, cache_dir=isolated_hf)
    assert len(want) == 8 and source.rows == want  # 16 before: every file of the folder
    assert source.files == [str(data / "chosen" / "a.jsonl")] and source.config == "default"
    with pytest.raises(DataError, match=r"no split 'test'; available: train \(as config 'default' of its dataset card"):
        load_rows(data, "test")
    with pytest.raises(DataError, match=r"no config 'other' in its dataset card \(README.md\); configs: default"):
        load_rows(data, "train", "other")
    plain = tmp_path / "plain"  # no card: the names choose, as before (both files as train)
    write_jsonl(plain / "a.jsonl", pref_rows(2, seed=1))
    write_jsonl(plain / "b.jsonl", pref_rows(2, seed=2))
    assert len(load_rows(plain).rows) == 4 and load_rows(plain).config is None
    with pytest.raises(DataError, match=r"--data-config 'x': it has no dataset card \(README.md\) with configs"):
        load_rows(plain, "train", "x")
    (plain / "README.md").write_text("# notes, no metadata\n")  # a README without configs is no selection
    assert len(load_rows(plain).rows) == 4


def test_two_configs_without_a_default_are_named_and_chosen_by_name(tmp_path, isolated_hf):
    data = tmp_path / "d"
    write_jsonl(data / "small.jsonl", pref_rows(3, seed=1))
    write_jsonl(data / "large-train.jsonl", pref_rows(6, seed=2))
    write_jsonl(data / "large-test.jsonl", pref_rows(2, seed=3))
    (data / "README.md").write_text(TWO_CONFIGS)
    with pytest.raises(DataError, match=r"has 2 configs and none is the default: choose one with --data-config "
                                        r"\(configs: small, large\)"):
        load_rows(data)
    for name, split in (("small", "train"), ("large", "train"), ("large", "test")):
        source = load_rows(data, split, name)
        assert source.rows == loaded_by_datasets(data, split, name, isolated_hf) and source.config == name
    with pytest.raises(DataError, match=r"no split 'test'; available: train \(as config 'small'"):
        load_rows(data, "test", "small")
    # `default: true` marks the default, as datasets reads it
    (data / "README.md").write_text(TWO_CONFIGS.replace("- config_name: large\n", "- config_name: large\n  default: true\n"))
    assert load_rows(data).rows == pref_rows(6, seed=2) and load_rows(data).config == "large"


def test_a_cards_loader_settings_reach_the_loader(tmp_path, isolated_hf):
    """A config's other keys are the loader's settings (here a CSV separator), as load_dataset passes them."""
    data = tmp_path / "d"
    data.mkdir()
    rows = pref_rows(3, seed=4)
    (data / "prefs.csv").write_text("prompt;chosen;rejected\n" + "".join(
        f"{r['prompt']};{r['chosen']};{r['rejected']}\n" for r in rows))
    (data / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: prefs.csv\n  sep: ';'\n---\n")
    got = load_rows(data).rows
    assert [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in got] == \
           [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]
    assert got == loaded_by_datasets(data, cache_dir=isolated_hf)


def test_a_hub_data_set_with_a_card_is_read_as_its_card_chooses(tmp_path, isolated_hf):
    """The hub-id path: the snapshot in the local Hugging Face cache, read through its card."""
    src = card_folder(tmp_path / "src")
    (src / "README.md").write_text(ONE_CONFIG.replace("chosen/*.jsonl", "a.jsonl"))
    snapshot = hub_snapshot("dataset", "acme/carded", {"README.md": src / "README.md",
                                                       "a.jsonl": src / "chosen" / "a.jsonl",
                                                       "other.jsonl": src / "other.jsonl"})
    source = load_rows("acme/carded")
    # (datasets itself reads a hub id offline only from its own cache: its reading of the snapshot is the reference)
    assert source.rows == pref_rows(8, seed=1) == loaded_by_datasets(snapshot, cache_dir=isolated_hf)
    assert source.config == "default"
    assert [Path(f).name for f in source.files] == ["a.jsonl"]


def test_precompute_records_the_config_and_train_and_audit_read_the_data_as_the_cache_did(llama_dir, tmp_path):
    data = tmp_path / "d"
    write_jsonl(data / "small.jsonl", pref_rows(3, seed=1))
    write_jsonl(data / "large-train.jsonl", pref_rows(6, seed=2))
    write_jsonl(data / "large-test.jsonl", pref_rows(2, seed=3))
    (data / "README.md").write_text(TWO_CONFIGS)
    out = tmp_path / "cache"
    refused = cli("--model", llama_dir, "--data", data, "--out", out)
    assert refused.exit_code == 2 and "choose one with --data-config (configs: small, large)" in refused.output
    assert not (out / "manifest.json").exists()
    ok("--model", llama_dir, "--data", data, "--data-config", "large", "--out", out)
    source = manifest_of(out)["source"]
    assert source["config"] == "large" and source["files"] == [str(data / "large-train.jsonl")]
    assert manifest_of(out)["rows"] == 6
    assert recorded_config(data, manifest_of(out)) == "large"
    # audit-ref --data reads the data with the cache's config: every row matches
    code, report, output = audit_ref(out, "--model", llama_dir, "--data", data, json_path=tmp_path / "audit.json")
    assert code == 0, output
    assert check_of(report, "data_rows")["status"] == "PASS", json.dumps(check_of(report, "data_rows"))
    # train-dpo's reader (the same for --eval-data) reads --data with the cache's config: the 6 rows join
    from transformers import AutoTokenizer

    from dpo.verify import verify_and_join

    verified = verify_and_join(tokenizer=AutoTokenizer.from_pretrained(llama_dir), model_dir=str(llama_dir),
                               data=str(data), split="train", cache_dir=out, log=lambda m: None)
    assert verified.report["rows"] == 6
    # --update without --data-config reads the data with the cache's config too (here grown by one row)
    write_jsonl(data / "large-train.jsonl", pref_rows(7, seed=2))
    ok("--model", llama_dir, "--data", data, "--out", out, "--update")
    assert manifest_of(out)["rows"] == 7 and manifest_of(out)["source"]["config"] == "large"
    # a cache of data without a card records no config (and its manifest is as it was before configs)
    plain = write_jsonl(tmp_path / "plain.jsonl", pref_rows(3, seed=1))
    ok("--model", llama_dir, "--data", plain, "--out", tmp_path / "plain-cache")
    assert "config" not in manifest_of(tmp_path / "plain-cache")["source"]
