"""audit-ref --show of a row that is not there (issue 36 item 2): the closest ids are suggested, and a row an update
of the cache removed is named with the version that removed it and the --cache-version that still shows it."""

from __future__ import annotations

import pytest

from support import audit_streams as audit
from conftest import precompute_ok, pref_rows, write_jsonl


@pytest.fixture(scope="module")
def updated(tmp_path_factory, llama_dir):
    """(a cache of 12 rows updated to data without row 4, the 12 rows): version 2 removed rows[4]."""
    base = tmp_path_factory.mktemp("show-rows")
    rows = [r | {"id": f"pair-{i:05d}"} for i, r in enumerate(pref_rows(12, seed=7))]
    cache = base / "cache"
    precompute_ok("--model", llama_dir, "--data", write_jsonl(base / "v1.jsonl", rows), "--out", cache,
                  "--rows-per-shard", 6)
    precompute_ok("--model", llama_dir, "--data", write_jsonl(base / "v2.jsonl", rows[:4] + rows[5:]), "--out", cache,
                  "--update")
    return cache, rows


def test_a_mistyped_row_id_is_refused_with_the_closest_ids(updated):
    cache, _ = updated
    code, out, err = audit(cache, "--show", "pair-0005")
    assert code == 2 and out == ""
    assert "no row 'pair-0005'" in err and "did you mean 'pair-00005' or 'pair-00000' or 'pair-00001'?" in err, err
    code, _, err = audit(cache, "--show", "zzz")  # nothing close: how to find an id, as before
    assert code == 2 and "did you mean" not in err and "'pair-00000', 'pair-00001', 'pair-00002', …" in err, err


def test_a_row_a_later_version_removed_names_that_version_and_the_one_that_shows_it(updated):
    cache, rows = updated
    code, out, err = audit(cache, "--show", "pair-00004")
    assert code == 2 and out == ""
    assert ("no row 'pair-00004' (neither an id nor an index of its 11 rows); version 2 of the cache removed it "
            "(precompute-ref --update, the data no longer had it): pass --cache-version 1 to see it") in err, err
    code, out, err = audit(cache, "--show", "pair-00004", "--cache-version", "1")  # the remedy, as given
    assert code == 0, err
    assert "id 'pair-00004'" in out and "margin: reference chosen - rejected" in out


@pytest.mark.parametrize("path", [{"a": 1}, 1e40, None])
def test_a_recorded_model_path_that_is_not_text_asks_for_model(updated, tmp_path, path):
    """Hostile pass: a manifest whose model.path is {"a": 1} or 1e40 crashed `--show` (unexpected TypeError)."""
    import json
    import shutil

    cache = shutil.copytree(updated[0], tmp_path / "c")
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["model"] = {**manifest["model"], "path": path}
    manifest["model"].pop("hub_id", None)
    (cache / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = audit(cache, "--show", "pair-00000")
    assert code == 2 and "pass --model (or --tokenizer)" in err, err
