"""Issue 34, families 1 and 2, through the commands: a URL is not a path (one location type, runtime.locations.Location over
storage.places.location), and every file a command writes is an output (runtime.paths: check_apart,
check_output_file; runtime.locks.exclusive takes back what a refused job made; schemas.format.no_manifest names a
folder holding no cache as such). Each example of the issue, and its neighbours."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import pref_rows, write_jsonl
from faultkit import TRAIN, assert_one_paragraph, copy_tree, file_hashes, invoke, precompute, train
from schemas import format as fmt
from schemas.cache import open_cache
from schemas.findings import CacheError

ROWS = 8


@pytest.fixture(scope="module")
def world(tmp_path_factory, llama_dir):
    """Data, a model folder of this module's own, and its cache (which records that folder as its model)."""
    base = tmp_path_factory.mktemp("places")
    data = write_jsonl(base / "data" / "prefs.jsonl", pref_rows(ROWS, seed=34))
    model = copy_tree(llama_dir, base / "model")
    args = ["--model", model, "--data", data]
    made = precompute(*args, "--out", base / "cache")
    assert made.exit_code == 0, made.output
    return {"base": base, "data": data, "model": model, "args": args, "cache": base / "cache"}


@pytest.fixture()
def memory():
    import fsspec

    fs = fsspec.filesystem("memory")
    yield fs
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]


def refused(result, *parts):
    assert result.exit_code == 2, result.output
    for part in parts:
        assert part in result.output, result.output
    return result


def audit_ref(*args):
    from audit.cli import main

    return invoke(main, args)


# ---------------------------------------------------------------------------------------------------------------
# family 1: a URL is not a path


@pytest.mark.parametrize("form", ["file://localhost{}", "file://{}"])
def test_out_as_a_file_url_writes_the_cache_at_that_path(world, tmp_path, monkeypatch, form):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "made" / "cache"
    r = precompute(*world["args"], "--out", form.format(out))
    assert r.exit_code == 0, r.output
    assert (out / fmt.MANIFEST).is_file() and open_cache(out).manifest["rows"] == ROWS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made"]  # no ./localhost, no ./file:


@pytest.mark.parametrize("url, named", [("simplecache::s3://bucket/x", "simplecache::s3"),
                                        ("filecache::memory://bucket/x", "filecache::memory"),
                                        ("file://otherhost/srv/cache", "'otherhost'"), ("s3:/bucket/x", "no '//'"),
                                        ("ftp://host/cache", "ftp://")])
def test_out_a_url_it_cannot_write_is_refused_at_parse_time_naming_it(world, tmp_path, monkeypatch, url, named):
    monkeypatch.chdir(tmp_path)
    r = refused(precompute(*world["args"], "--out", url), "Invalid value for '--out'", named)
    assert "wrote" not in r.output and list(tmp_path.iterdir()) == []  # no local folder named after the URL


def test_output_dir_inside_a_ref_cache_given_as_a_file_url_is_refused(world, llama_dir):
    before = file_hashes(world["cache"], ".*") | file_hashes(world["cache"])
    for given in (f"file://{world['cache']}", f"file://localhost{world['cache']}"):
        r = train("--model", world["model"], "--data", world["data"], "--ref-cache", given,
                  "--output-dir", world["cache"] / "run", *TRAIN)
        refused(r, f"--output-dir {world['cache'] / 'run'} is inside --ref-cache {world['cache']}")
        assert_one_paragraph(r.output)
    assert file_hashes(world["cache"], ".*") | file_hashes(world["cache"]) == before


@pytest.mark.parametrize("offload", ["same", "inside", "url_of_same"])
def test_offload_folder_and_the_out_it_writes_are_one_place_whatever_the_spelling(world, tmp_path, offload):
    out = tmp_path / "cache"
    where = {"same": out, "inside": out / "offload", "url_of_same": f"file://localhost{out}"}[offload]
    r = precompute(*world["args"], "--out", f"file://{out}", "--device-map", "auto", "--max-memory", "1GiB",
                   "--offload-folder", where)
    refused(r, "--offload-folder", "--out", "writing there could overwrite or delete an input")
    assert not out.exists()


def test_audit_html_of_a_store_cache_names_its_url(world, tmp_path, memory):
    url = "memory://places/cache"
    assert precompute(*world["args"], "--out", url).exit_code == 0
    page = tmp_path / "page.html"
    r = audit_ref(url, "--html", page, "--model", world["model"], "--sample", 2)
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "memory:///places/cache" in text and str(Path.cwd() / "memory:") not in text
    assert "<title>refcache audit-ref: cache</title>" in text


@pytest.mark.parametrize("option", ["--html", "--json"])
@pytest.mark.parametrize("url", ["s3://bucket/page.out", "memory://bucket/page.out", "simplecache::s3://b/p"])
def test_a_report_or_page_to_a_url_is_refused_as_a_url_not_a_missing_folder(world, tmp_path, option, url):
    r = refused(audit_ref(world["cache"], option, url), f"Invalid value for '{option}'")
    assert "does not exist" not in r.output


# ---------------------------------------------------------------------------------------------------------------
# family 2: every file written is an output


@pytest.mark.parametrize("option, given", [("--html", "none"), ("--html", "--model"), ("--html", "--tokenizer"),
                                           ("--json", "--model")])
def test_a_page_or_report_never_writes_over_the_model_folders_tokenizer(world, tmp_path, option, given):
    """The model folder is an input: the one the cache recorded (where --html takes the tokenizer from by default),
    --model, --tokenizer."""
    model = copy_tree(world["model"], tmp_path / "model")
    cache = copy_tree(world["cache"], tmp_path / "cache")
    fmt_manifest = json.loads((cache / fmt.MANIFEST).read_text())
    if given == "none":  # the cache records this copy as its model (a cache made from it)
        made = precompute("--model", model, "--data", world["data"], "--out", tmp_path / "own")
        assert made.exit_code == 0, made.output
        cache = tmp_path / "own"
        label = "the model folder the cache recorded"
    else:
        label = given
    assert fmt_manifest["stamps"]
    target = model / "tokenizer.json"
    before = target.read_bytes()
    extra = {"none": [], "--model": ["--model", model], "--tokenizer": ["--tokenizer", model]}[given]
    r = refused(audit_ref(cache, option, target, *extra, *(["--sample", 0] if option == "--json" else [])),
                f"{option} {target} is inside {label} {model}")
    assert target.read_bytes() == before and "PASS" not in r.output


@pytest.mark.parametrize("option", ["--json", "--html"])
def test_a_file_it_did_not_write_is_not_replaced_its_own_is(world, tmp_path, option):
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    r = refused(audit_ref(world["cache"], option, mine), f"{option} {mine} already exists and is not a report or "
                                                         "page refcache wrote")
    assert mine.read_text() == "my notes\n" and "PASS" not in r.output
    ours = tmp_path / "out.txt"
    for _ in range(2):  # written, then replaced: a file of its own
        r = audit_ref(world["cache"], option, ours, "--model", world["model"], "--sample", 1)
        assert r.exit_code == 0, r.output
    assert ours.read_bytes().startswith(b"{" if option == "--json" else b"<!DOCTYPE html>")


def test_overwrite_output_dir_refuses_a_dataset_card_and_another_runs_card(world, tmp_path):
    """--overwrite-output-dir retires the card of the run recorded in the folder, nothing else named README.md: a
    cache's dataset card (tagged refcache too) and a card naming another run are refused and kept."""
    from dpo.card import RUN_KEY
    from dpo.resume import overwrite_plan
    from runtime.errors import JobError
    from schemas import run_manifest as rm

    out = tmp_path / "run"
    out.mkdir()
    rm.write_json(out / rm.RUN_RECORD, rm.run_record("a" * 32, "2026-01-01T00:00:00+00:00"))
    card = out / "README.md"
    for text in ((world["cache"] / fmt.CARD).read_text(),
                 f"---\ntags:\n- dpo\n- refcache\n{RUN_KEY}: {'b' * 32}\n---\n# another run's card\n"):
        card.write_text(text)
        with pytest.raises(JobError, match=r"README.md is not an earlier train-dpo run's own"):
            overwrite_plan(out)
        assert card.read_text() == text
    card.write_text(f"---\ntags:\n- dpo\n- refcache\n{RUN_KEY}: {'a' * 32}\n---\n# this run's card\n")
    assert card in overwrite_plan(out)[0]


@pytest.mark.parametrize("where", ["new_folder", "empty_folder"])
def test_top_k_above_the_vocabulary_leaves_nothing(world, tmp_path, where):
    out = tmp_path / "new" / "cache"
    if where == "empty_folder":
        out.mkdir(parents=True)
    r = refused(precompute(*world["args"], "--out", out, "--top-k", 2000), "--top-k 2000 is more than the model's "
                                                                         "vocabulary")
    assert_one_paragraph(r.output)
    assert (not (tmp_path / "new").exists()) if where == "new_folder" else list(out.iterdir()) == []


@pytest.mark.parametrize("where", ["nowhere", "data_folder", "empty_folder"])
def test_update_of_a_place_holding_no_cache_leaves_nothing(world, tmp_path, where):
    out = {"nowhere": tmp_path / "no" / "cache", "data_folder": tmp_path / "other-data",
           "empty_folder": tmp_path / "empty"}[where]
    if where != "nowhere":
        out.mkdir()
    if where == "data_folder":  # another data set's folder, given as --out by mistake
        write_jsonl(out / "train.jsonl", pref_rows(2, seed=1))
    before = sorted(tmp_path.rglob("*"))
    said = "does not exist" if where == "nowhere" else "holds no finished cache"  # a typo: what is near (UX pass)
    refused(precompute(*world["args"], "--out", out, "--update"), said)
    assert sorted(tmp_path.rglob("*")) == before


def test_update_of_a_mistyped_out_names_the_cache_near_it(world, tmp_path):
    copy_tree(world["cache"], tmp_path / "c1")
    r = refused(precompute(*world["args"], "--out", tmp_path / "c11", "--update"), "--update --out")
    assert f"does not exist; did you mean {tmp_path / 'c1'}?" in r.output, r.output


def test_a_refusal_under_the_lock_takes_back_the_lock(world, tmp_path):
    """A refusal that can only come under the lock (the settings of the shards found there): the folder is left
    as it was, without a lock file."""
    out = copy_tree(world["cache"], tmp_path / "cache")
    (out / fmt.LOCK).unlink(missing_ok=True)
    (out / fmt.MANIFEST).unlink()  # an interrupted run: its shards are judged under the lock
    before = file_hashes(out, ".*") | file_hashes(out)
    refused(precompute(*world["args"], "--out", out, "--dtype", "bfloat16"), "already holds a different cache")
    assert file_hashes(out, ".*") | file_hashes(out) == before


@pytest.mark.parametrize("place", ["data_folder", "empty_folder", "no_folder", "a_file", "empty_prefix"])
def test_a_place_holding_no_cache_is_named_as_such_never_an_interrupted_job(world, tmp_path, memory, place):
    where = {"data_folder": world["data"].parent, "empty_folder": tmp_path / "empty", "no_folder": tmp_path / "no",
             "a_file": world["data"], "empty_prefix": "memory://bucket/typo"}[place]
    if place == "empty_folder":
        where.mkdir()
    with pytest.raises(CacheError) as e:
        open_cache(where)
    assert e.value.kind == "no_cache" and "holds no cache" in e.value.message
    assert "interrupted" not in str(e.value)
    r = train("--model", world["model"], "--data", world["data"], "--ref-cache", where, "--output-dir",
              tmp_path / "run", *TRAIN)
    # train-dpo names a local place's option (issue 36); a folder that is not there: "does not exist", what is near
    named = "" if place == "empty_prefix" else f"--ref-cache {where}"
    refused(r, named + (": does not exist" if place == "no_folder" else " holds no cache"))
    assert "interrupted" not in r.output and not (tmp_path / "run").exists()


def test_a_folder_that_shows_a_cache_being_written_is_incomplete(world, tmp_path):
    out = copy_tree(world["cache"], tmp_path / "cache")
    (out / fmt.MANIFEST).unlink()
    with pytest.raises(CacheError) as e:
        open_cache(out)
    assert e.value.kind == "incomplete" and "interrupted" in e.value.message
    lock_only = tmp_path / "started"
    lock_only.mkdir()
    (lock_only / fmt.LOCK).write_text("12345")  # a writer killed before its first shard
    with pytest.raises(CacheError) as e:
        open_cache(lock_only)
    assert e.value.kind == "incomplete"
    shutil.rmtree(lock_only)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "training_args.bin", "model.safetensors",
                                  "model-00001-of-00002.safetensors"])
def test_overwrite_output_dir_refuses_a_trainer_file_no_earlier_run_wrote(tmp_path, name):
    """Hostile pass: a user's config.json, tokenizer_config.json and training_args.bin in an --output-dir with no
    run record were silently replaced by the Trainer's final save under --overwrite-output-dir. An earlier run's own
    (its record is in the folder) are retired."""
    from dpo.resume import overwrite_plan
    from runtime.errors import JobError
    from schemas import run_manifest as rm

    out = tmp_path / "run"
    out.mkdir()
    (out / name).write_text("mine")
    with pytest.raises(JobError, match=rf"{re.escape(name)} is not an earlier train-dpo run's own"):
        overwrite_plan(out)
    assert (out / name).read_text() == "mine"
    rm.write_json(out / rm.RUN_RECORD, rm.run_record("a" * 32, "2026-01-01T00:00:00+00:00"))
    assert out / name in overwrite_plan(out)[1]  # the earlier run's: left until the new run's final save
