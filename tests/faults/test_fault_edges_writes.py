"""Issue 22, "destroys or corrupts files it does not own" (items 1, 2, 3 and 5), across the three commands.

Each output is apart from every input (runtime.paths.check_apart, folders and files alike: audit-ref --json too);
precompute-ref writes only into an empty folder or one holding only its own cache (precompute.resume.own_files, the
one ownership rule of a resume and of --overwrite); no write follows, replaces or deletes a symlink planted at its
destination (storage.files, the one way the product writes a file; the lock is opened the same way); and one writer
per output folder (runtime.locks, precompute-ref's --out and train-dpo's --output-dir alike). Every refusal comes
before anything is written, and what was planted (and what it points to) is left exactly as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from huggingface_hub import DatasetCard

from conftest import pref_rows, write_jsonl
from faultkit import (TRAIN, assert_one_paragraph, audit, check_of, copy_tree, env, file_hashes, invoke, precompute,
                      set_metadata, train)
from schemas import format as fmt
from schemas.cache import open_cache

ROWS, PER_SHARD = 12, 4


@pytest.fixture(scope="module")
def world(tmp_path_factory, llama_dir):
    """A clean cache, and a cache of the same rows plus one bad row skipped (so with its own skipped.jsonl)."""
    base = tmp_path_factory.mktemp("edges-writes")
    rows = pref_rows(ROWS, seed=5)
    data = write_jsonl(base / "data" / "prefs.jsonl", rows)
    bad = write_jsonl(base / "data" / "bad.jsonl", [*rows, {"id": "x", "prompt": "why?", "chosen": 7, "rejected": "no"}])
    args = ["--model", llama_dir, "--rows-per-shard", PER_SHARD]
    for name, extra in (("clean", ["--data", data]), ("skipping", ["--data", bad, "--on-bad-row", "skip"])):
        made = precompute(*args, *extra, "--out", base / name)
        assert made.exit_code == 0, made.output
    assert (base / "skipping" / fmt.SKIPPED).is_file()
    return {"base": base, "data": data, "bad": bad, "args": args, "clean": base / "clean",
            "skipping": base / "skipping", "skip": ["--data", bad, "--on-bad-row", "skip"]}



def refused(result, *parts):
    assert result.exit_code == 2, result.output
    for part in parts:
        assert part in result.output, result.output
    assert_one_paragraph(result.output)


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def everything(*folders) -> list[dict]:
    return [file_hashes(f, ".*") | file_hashes(f) if f.is_dir() else {f.name: f.read_bytes()} for f in folders]


# ---------------------------------------------------------------------------------------------------------------
# 1: every file a command writes is apart from its inputs


def audit_json(cache, *args):
    from audit.cli import main

    return invoke(main, [cache, *args])


@pytest.mark.parametrize("where", ["cache_manifest", "cache_shard", "inside_cache", "data_file", "inside_model",
                                   "run_manifest", "symlink_to_manifest", "dotdot_into_cache", "hard_link_of_data"])
def test_1_audit_json_is_apart_from_every_input(world, llama_dir, tmp_path, where):
    cache = copy_tree(world["clean"], tmp_path / "cache")
    model = copy_tree(llama_dir, tmp_path / "model")
    data = Path(shutil.copy(world["data"], tmp_path / "prefs.jsonl"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "run-manifest.json").write_text(json.dumps({"kind": "refcache-train-dpo-run", "reference": {}}))
    target = {"cache_manifest": cache / fmt.MANIFEST, "cache_shard": cache / "shard-00000.parquet",
              "inside_cache": cache / "report.json", "data_file": data, "inside_model": model / "report.json",
              "run_manifest": run / "run-manifest.json", "symlink_to_manifest": tmp_path / "report.json",
              "dotdot_into_cache": run / ".." / "cache" / fmt.MANIFEST, "hard_link_of_data": tmp_path / "report.json"}[
        where]
    if where == "symlink_to_manifest":
        target.symlink_to(cache / fmt.MANIFEST)
    if where == "hard_link_of_data":
        target.hardlink_to(data)
    before = everything(cache, model, data, run)
    result = audit_json(cache, "--model", model, "--data", data, "--run", run, "--sample", 0, "--json", target)
    refused(result, f"error: --json {target} ", "writing there could overwrite or delete an input; choose an --json "
                                                  "apart from it")
    assert everything(cache, model, data, run) == before
    open_cache(cache)


def test_1_train_dpo_output_dir_holding_its_config_is_refused(llama_dir, dpo_data, dpo_cache, tmp_path):
    """The neighbour on train-dpo: --config is an input too (a config.json in the --output-dir would be overwritten
    by the model's config when the Trainer saves)."""
    out = tmp_path / "run"
    out.mkdir()
    config = out / "config.json"
    config.write_text(json.dumps({"learning_rate": 1e-3}))
    result = train("--config", config, "--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache,
                   "--output-dir", out, "--overwrite-output-dir", *TRAIN)
    refused(result, f"error: --output-dir {out} contains --config {config}: writing there could overwrite")
    assert names(out) == ["config.json"] and json.loads(config.read_text()) == {"learning_rate": 1e-3}


def test_1_precompute_out_inside_a_hub_data_sets_snapshot_is_refused(world, tmp_path):
    """--data named by hub id is the snapshot folder in the local Hugging Face cache it resolves to."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE) / "datasets--acme--edges-prefs"
    snap = root / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("0" * 40)
    shutil.copy(world["data"], snap / "train.jsonl")
    try:
        result = precompute(*world["args"], "--data", "acme/edges-prefs", "--out", snap / "cache")
        refused(result, f"error: --out {snap / 'cache'} is inside --data {snap}: writing there could overwrite")
        assert names(snap) == ["train.jsonl"]
    finally:
        shutil.rmtree(root)


# ---------------------------------------------------------------------------------------------------------------
# 2: precompute-ref writes only into an empty folder or one holding only its own cache


@pytest.mark.parametrize("data", ["clean", "bad_rows_skipped"])
def test_2_a_skipped_jsonl_that_is_not_its_own_is_refused_and_kept(world, tmp_path, data):
    out = tmp_path / "out"
    out.mkdir()
    (out / fmt.SKIPPED).write_text("my notes, not a cache's\n")
    result = precompute(*world["args"], *(["--data", world["data"]] if data == "clean" else world["skip"]),
                        "--out", out)
    refused(result, f"error: --out {out} holds files that are not this cache's own: skipped.jsonl (not the list of "
                    "rows this cache skipped); nothing was written or deleted", "choose another --out")
    assert names(out) == [fmt.SKIPPED] and (out / fmt.SKIPPED).read_text() == "my notes, not a cache's\n"  # no lock


@pytest.mark.parametrize("overwrite", [False, True])
def test_2_a_cache_whose_skipped_jsonl_is_not_its_own_is_refused(world, tmp_path, overwrite):
    """A skipped.jsonl in a cache is the cache's only as the list of rows that cache skipped (the manifest's
    counts): another one there is neither rewritten by a resume nor deleted by --overwrite."""
    out = copy_tree(world["skipping"], tmp_path / "cache")
    (out / fmt.SKIPPED).write_text(json.dumps({"row": 1, "reason": "mine", "note": "kept by hand"}) + "\n")
    before = everything(out)
    result = precompute(*world["args"], *world["skip"], "--out", out, *(["--overwrite"] if overwrite else []))
    refused(result, "holds files that are not this cache's own: skipped.jsonl (not the list of rows this cache "
                    "skipped)")
    assert everything(out) == before


# A name of atomic_write's temporary form (`.{name}.tmp-{pid}`) is the cache's own only where `name` is a file the
# cache writes: another program's temporary file (or a config named so) is kept and refused, in a cache or not.
OTHERS = ["notes_file", "folder", "hidden_file", "foreign_parquet", "foreign_readme", "card_of_another_cache",
          "foreign_temp", "foreign_temp_yaml"]


@pytest.mark.parametrize("into, other", [("empty_folder", o) for o in [*OTHERS, "foreign_manifest", "shard_temp"]]
                         + [("cache", o) for o in OTHERS])
def test_2_out_holding_files_that_are_not_a_caches_is_refused(world, tmp_path, other, into):
    out = copy_tree(world["clean"], tmp_path / "out") if into == "cache" else tmp_path / "out"
    out.mkdir(exist_ok=True)
    name = {"notes_file": "notes.txt", "folder": "keep", "hidden_file": ".env", "foreign_parquet": "table.parquet",
            "foreign_manifest": fmt.MANIFEST, "foreign_readme": fmt.CARD, "card_of_another_cache": fmt.CARD,
            "foreign_temp": ".notes.tmp-42", "foreign_temp_yaml": ".my-precompute.yaml.tmp-1",
            "shard_temp": ".shard-00000.parquet.tmp-42"}[other]
    if other == "folder":
        (out / name).mkdir()
        (out / name / "mine.txt").write_text("mine")
    elif other == "foreign_manifest":
        (out / name).write_text('{"name": "a web app manifest"}')
    elif other == "foreign_readme":  # a user's README, even one with card metadata, is not this cache's card
        (out / name).write_text("---\nlicense: mit\n---\n# my notes\n")
    elif other == "card_of_another_cache":  # a refcache card, of a cache of another model
        card = DatasetCard.load(world["clean"] / fmt.CARD)
        card.data.refcache["stamps"]["model_hash"] = "0" * 64
        card.save(out / name)
    else:
        (out / name).write_bytes(b"PAR1 not a cache's PAR1" if name.endswith(".parquet") else b"mine")
    before = everything(out)
    result = precompute(*world["args"], "--data", world["data"], "--out", out)
    refused(result, f"error: --out {out} holds files that are not this cache's own: {name}", "move them elsewhere")
    assert everything(out) == before


def test_2_its_own_skipped_jsonl_is_resumed_and_replaced(world, tmp_path):
    """Ownership holds where the cache's writer left things: skipped.jsonl beside the shards of an interrupted run
    (written just before the manifest), kept on resume and removed by --overwrite with data that skips nothing."""
    out = copy_tree(world["skipping"], tmp_path / "cache")
    (out / fmt.MANIFEST).unlink()
    listed = (out / fmt.SKIPPED).read_bytes()
    again = precompute(*world["args"], *world["skip"], "--out", out)
    assert again.exit_code == 0 and "(0 scored now)" in again.output, again.output
    assert (out / fmt.SKIPPED).read_bytes() == listed
    over = precompute(*world["args"], "--data", world["data"], "--out", out, "--overwrite")
    assert over.exit_code == 0, over.output
    assert names(out) == sorted([*file_hashes(world["clean"], "*.parquet"), fmt.MANIFEST, fmt.CARD, fmt.LOCK])


def test_2_its_own_card_is_rewritten_from_the_manifest_that_stays(world, tmp_path):
    """README.md is the cache's own when it is a refcache card of the manifest's stamps: a resume keeps the folder
    and rewrites a stale card (here one whose text and metadata were edited) from the manifest; a no-op rerun then
    changes no file; --overwrite deletes it with the cache and writes it again; audit-ref passes it throughout."""
    out = copy_tree(world["clean"], tmp_path / "cache")
    card = DatasetCard.load(out / fmt.CARD)
    clean = (out / fmt.CARD).read_bytes()
    card.data.refcache["rows"] = 1
    card.text = "edited by hand\n"
    card.save(out / fmt.CARD)
    assert invoke_audit(out) == (1, "FAIL")
    again = precompute(*world["args"], "--data", world["data"], "--out", out)
    assert again.exit_code == 0 and "(0 scored now)" in again.output, again.output
    assert (out / fmt.CARD).read_bytes() == clean and invoke_audit(out) == (0, "PASS")
    before = file_hashes(out)
    assert precompute(*world["args"], "--data", world["data"], "--out", out).exit_code == 0
    assert file_hashes(out) == before
    over = precompute(*world["args"], "--data", world["data"], "--out", out, "--overwrite")
    assert over.exit_code == 0, over.output
    # a cache made anew: its card is the clean one but for when this version was made (its version line)
    first, made = fmt.read_manifest(world["clean"])["created_at"], fmt.read_manifest(out)["created_at"]
    assert (out / fmt.CARD).read_bytes() == clean.replace(first.encode(), made.encode())
    assert invoke_audit(out) == (0, "PASS")
    clean = (out / fmt.CARD).read_bytes()
    # killed inside the card's write (after the manifest): a complete cache without its card, and the writer's
    # temporary file; the rerun removes the temporary, scores nothing and writes the card
    (out / fmt.CARD).unlink()
    (out / f".{fmt.CARD}.tmp-99999").write_bytes(clean[: len(clean) // 2])
    assert invoke_audit(out) == (0, "SKIP")
    again = precompute(*world["args"], "--data", world["data"], "--out", out)
    assert again.exit_code == 0 and "(0 scored now)" in again.output, again.output
    assert names(out) == sorted([*file_hashes(world["clean"], "*.parquet"), fmt.MANIFEST, fmt.CARD, fmt.LOCK])
    assert (out / fmt.CARD).read_bytes() == clean


def invoke_audit(cache) -> tuple[int, str]:
    """audit-ref's exit code and its card check's status."""
    code, report, _ = audit(cache)
    return code, check_of(report, "card")["status"]


# ---------------------------------------------------------------------------------------------------------------
# 3: no write follows a symlink at its destination (the lock and temporary files included)


@pytest.mark.parametrize("planted", [fmt.LOCK, fmt.MANIFEST, fmt.SKIPPED, fmt.CARD, "shard-00001.parquet",
                                     f".manifest.json.tmp-{os.getpid()}", f".{fmt.CARD}.tmp-{os.getpid()}"])
@pytest.mark.parametrize("mode", ["resume", "overwrite"])
def test_3_precompute_refuses_a_symlink_in_out_and_keeps_its_target(world, tmp_path, victim, planted, mode):
    out = copy_tree(world["skipping"], tmp_path / "cache")
    (out / planted).unlink(missing_ok=True)
    (out / planted).symlink_to(victim)
    before = everything(out)
    result = precompute(*world["args"], *world["skip"], "--out", out, *(["--overwrite"] if mode == "overwrite" else []))
    refused(result, f"holds files that are not this cache's own: {planted} (a symlink)")
    assert victim.read_text() == "precious\n" and everything(out) == before and os.readlink(out / planted) == str(victim)


def test_3_precompute_into_a_fresh_folder_with_a_planted_lock_symlink(world, tmp_path, victim):
    out = tmp_path / "out"
    out.mkdir()
    (out / fmt.LOCK).symlink_to(victim)
    result = precompute(*world["args"], "--data", world["data"], "--out", out)
    refused(result, f"{fmt.LOCK} (a symlink)")
    assert victim.read_text() == "precious\n" and names(out) == [fmt.LOCK]


def test_3_audit_json_at_a_symlink_is_refused_before_the_audit(world, tmp_path, victim):
    link = tmp_path / "report.json"
    link.symlink_to(victim)
    result = audit_json(world["clean"], "--json", link)
    refused(result, f"error: {link} is a symlink (to {victim}): refcache does not write there")
    assert "PASS" not in result.output  # refused before the audit ran
    assert victim.read_text() == "precious\n" and link.is_symlink()


@pytest.mark.parametrize("planted", ["metrics.jsonl", "model.safetensors", "run-manifest.json", fmt.LOCK,
                                     "checkpoint-1/trainer_state.json"])
def test_3_train_dpo_refuses_a_symlink_in_a_used_output_dir(llama_dir, dpo_data, dpo_cache, tmp_path, victim, planted):
    out = tmp_path / "run"
    (out / planted).parent.mkdir(parents=True)
    (out / planted).symlink_to(victim)
    before = sorted(out.rglob("*"))
    result = train("--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out,
                   "--overwrite-output-dir", *TRAIN)
    # the names a new run writes are judged first by dpo/resume.overwrite_plan (items 4, 6), any other link after
    theirs = {"metrics.jsonl": "metrics.jsonl (a symlink) is not an earlier train-dpo run's own",
              "run-manifest.json": "run-manifest.json (a symlink) is not an earlier train-dpo run's own",
              "checkpoint-1/trainer_state.json": "checkpoint-1 is not an earlier train-dpo run's own",
              "model.safetensors": "model.safetensors (a symlink) is not an earlier train-dpo run's own"}
    refused(result, theirs.get(planted, f"error: {out / planted} is a symlink (to {victim}): refcache does not write "
                                        "there"))
    assert victim.read_text() == "precious\n" and os.readlink(out / planted) == str(victim)
    assert sorted(out.rglob("*")) == before


# ---------------------------------------------------------------------------------------------------------------
# 5: one train-dpo per output dir


HOLD = """import fcntl, os, sys
with open(os.path.join(sys.argv[1], ".refcache.lock"), "a+") as f:  # what a running train-dpo holds
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(str(os.getpid()))
    f.flush()
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("extra", [[], ["--overwrite-output-dir"]])
def test_5_a_second_train_dpo_into_a_held_output_dir_is_refused(llama_dir, dpo_data, dpo_cache, tmp_path, extra):
    """Another process holds --output-dir (as a running train-dpo does): refused, naming its pid, nothing written;
    once it ends, the lock file it leaves does not make the folder a used one."""
    out = tmp_path / "run"
    out.mkdir()
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=env(), text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == "held\n"
        result = train(*args, *extra)
        refused(result, f"error: {out} is being written by another train-dpo process (pid {holder.pid}); wait for it "
                        "to finish or choose another --output-dir")
        assert names(out) == [fmt.LOCK]
    finally:
        holder.stdin.close()
        assert holder.wait(60) == 0
    if not extra:
        after = train(*args)
        assert after.exit_code == 0, after.output
        assert {"metrics.jsonl", "run-manifest.json", "model.safetensors", fmt.LOCK} <= set(names(out))


@pytest.mark.parametrize("key", ["computation", "encoding"])
def test_2_a_footer_read_as_values_by_resume_and_audit_alike(world, tmp_path, key):
    """A shard footer's JSON values written with other spacing and key order hold the same settings: a resume of the
    interrupted run keeps the shard, and audit-ref then passes the cache (it compared the bytes, and failed the
    shard with 'expected {}, found {}')."""
    out = copy_tree(world["clean"], tmp_path / "cache")
    (out / fmt.MANIFEST).unlink()
    meta = pq.read_schema(out / "shard-00000.parquet").metadata
    value = json.loads(meta[(fmt.META_PREFIX + key).encode()])
    respaced = json.dumps(dict(reversed(list(value.items()))), indent=2)
    set_metadata(out, "shard-00000.parquet", key, respaced)
    again = precompute(*world["args"], "--data", world["data"], "--out", out)
    assert again.exit_code == 0, again.output
    assert pq.read_schema(out / "shard-00000.parquet").metadata[(fmt.META_PREFIX + key).encode()] == respaced.encode()
    code, _, output = audit(out)
    assert code == 0, output


@pytest.mark.parametrize("name", [".shard-00000.parquet.tmp-42", ".README.md.tmp-7", ".manifest.json.tmp-9"])
def test_2_a_users_file_under_a_temporary_name_in_a_cache_is_refused_and_kept(world, tmp_path, name):
    """Closing UX pass: in a cache folder, a rerun that went through deleted a user's file named as a temporary of
    the cache's own files (by its name alone): it must begin as the cache's writer begins that file."""
    out = copy_tree(world["clean"], tmp_path / "cache")
    (out / name).write_text("precious")
    result = precompute(*world["args"], "--data", world["data"], "--out", out)
    refused(result, f"holds files that are not this cache's own: {name} (not a temporary file of this cache)")
    assert (out / name).read_text() == "precious"
    if "parquet" not in name:  # a user's note headed as such files are (closing pass): still not the writer's
        (out / name).write_text("---\ntitle: my own draft\n---\n" if "README" in name else '{"a": 1}')
        refused(precompute(*world["args"], "--data", world["data"], "--out", out), name)
    begun = (b"PAR1 partial" if "parquet" in name else (out / fmt.CARD).read_bytes()[:300] if "README" in name
             else (out / fmt.MANIFEST).read_bytes()[:40])  # as a killed writer left it
    (out / name).write_bytes(begun)
    assert precompute(*world["args"], "--data", world["data"], "--out", out).exit_code == 0
    assert not (out / name).exists()  # a killed writer's: removed


@pytest.mark.parametrize("name", ["shard-00042.parquet", "shard-v00007-00000.parquet"])
def test_2_a_users_file_under_a_shards_name_is_refused_and_kept_by_overwrite_too(world, tmp_path, name):
    """Hostile pass (h44): a user's text under a shard's name no version of the cache names was taken for the cache's
    own (by its name alone) and deleted by --overwrite. Such a file is the cache's with a refcache footer, or
    beginning as Parquet does (a killed writer's); a shard a version names is the cache's, damaged or not (scored
    again: test_fault_edges_identity's test_7)."""
    out = copy_tree(world["clean"], tmp_path / "cache")
    (out / name).write_text("precious")
    for extra in ((), ("--overwrite",)):
        result = precompute(*world["args"], "--data", world["data"], "--out", out, *extra)
        refused(result, f"holds files that are not this cache's own: {name} (no refcache footer)")
        assert (out / name).read_text() == "precious"
    raw = bytearray((world["clean"] / "shard-00001.parquet").read_bytes())  # the cache's own shard, damaged
    raw[len(raw) // 2] ^= 0xFF
    (out / name).unlink()
    (out / "shard-00001.parquet").write_bytes(bytes(raw))
    assert precompute(*world["args"], "--data", world["data"], "--out", out, "--overwrite").exit_code == 0


def test_2_a_refused_rerun_removes_no_temporary_file(world, tmp_path):
    """Hostile pass: the temporary files of a cache's own names were removed before the rerun was refused (other
    data): removed only once the resume refuses nothing."""
    out = copy_tree(world["clean"], tmp_path / "cache")
    (out / ".shard-00009.parquet.tmp-11").write_text("my precious notes")
    other = write_jsonl(tmp_path / "other.jsonl", pref_rows(ROWS, seed=99))
    result = precompute(*world["args"], "--data", other, "--out", out)
    assert result.exit_code == 2, result.output
    assert (out / ".shard-00009.parquet.tmp-11").read_text() == "my precious notes"
