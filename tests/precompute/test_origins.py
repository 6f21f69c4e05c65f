"""precompute-ref records the hub id a model or data set was given as (and its snapshot's commit) beside the resolved
snapshot path in the cache manifest; those fields are not part of the cache's identity (stamps, cache_id), and a
manifest without them (every cache made before) still verifies (issue 25, item 7)."""

from __future__ import annotations

import json
from pathlib import Path

from support import edit_manifest, hub_snapshot, manifest_of, precompute_in_process, pref_rows, write_jsonl
from schemas.cache import open_cache
from schemas.run_manifest import cache_id, cache_record

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # support.hub_snapshot's


def test_the_cache_manifest_records_hub_ids_beside_the_snapshot_and_keeps_its_identity(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "src" / "train.jsonl", pref_rows(12))
    model_snap = hub_snapshot("model", "acme/origin-base", {p.name: p for p in llama_dir.iterdir() if p.is_file()})
    data_snap = hub_snapshot("dataset", "acme/origin-prefs", {"train.jsonl": data})

    by_hub = precompute_in_process("acme/origin-base", "acme/origin-prefs", tmp_path / "by-hub")
    m = manifest_of(by_hub)
    assert {k: v for k, v in m["model"].items() if k != "path"} == {"name": "acme/origin-base",
                                                                    "hub_id": "acme/origin-base", "revision": COMMIT}
    assert Path(m["model"]["path"]) == model_snap
    assert Path(m["source"]["data"]) == data_snap
    assert (m["source"]["hub_id"], m["source"]["revision"]) == ("acme/origin-prefs", COMMIT)

    by_path = precompute_in_process(llama_dir, data, tmp_path / "by-path")
    local = manifest_of(by_path)
    assert "hub_id" not in local["model"] and "hub_id" not in local["source"]
    assert local["model"]["path"] == str(llama_dir) and local["source"]["data"] == str(data)  # paths as given
    # the same cache: stamps, encoding, shard bytes and cache_id do not see where the inputs came from
    assert m["stamps"] == local["stamps"]
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in local["shards"]]
    assert cache_id(m) == cache_id(local)
    before = cache_record(by_hub, m["stamps"])

    # a manifest written before these fields existed still verifies, and is still the same cache
    edit_manifest(by_hub, lambda mf: (mf["model"].pop("hub_id"), mf["model"].pop("revision"),
                                      mf["source"].pop("hub_id"), mf["source"].pop("revision")))
    assert open_cache(by_hub).stamps == m["stamps"]
    assert cache_record(by_hub, m["stamps"])["cache_id"] == before["cache_id"]

    # a rerun given the local paths finds nothing to do and leaves the manifest as it was (paths and hub ids are not
    # the cache's content)
    text = (by_hub / "manifest.json").read_text()
    precompute_in_process(llama_dir, data, by_hub)
    assert (by_hub / "manifest.json").read_text() == text
    assert json.loads(text)["source"]["data"] == str(data_snap)
