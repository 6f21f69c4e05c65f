"""Real processes: precompute-ref SIGKILLed at each phase of writing a cache, train-dpo SIGKILLed between checkpoints,
two writers on one cache, train-dpo on a cache still being written, and exit codes / tracebacks of real processes.

Every fault is deterministic (tests/helpers/fault_launcher.py stops the real command at an exact place). All processes
are forked at once from one interpreter that imported the commands a single time (faultkit.Zygote); the clean runs
they are compared with happen in process meanwhile.

After a kill nothing in the directory reads as a valid cache or shard unless it is complete and equal to a clean
run's; the same command then resumes, keeps what was finished, and ends with a cache equal to an uninterrupted run's.
A train-dpo run killed after checkpoint-4 keeps its checkpoints and, resumed from checkpoint-4, ends with the weights
of an uninterrupted run.
"""

from __future__ import annotations

import json
import re
import signal

import pytest

from conftest import pref_rows, write_jsonl
from faultkit import TRAIN, Zygote, audit, file_hashes, manifest_of, precompute, train, wait_for
from schemas import format as fmt
from schemas.cache import open_cache
from schemas.stamps import model_hash

ROWS, PER_SHARD = 24, 6  # four shards
SHARDS = [f"shard-{i:05d}.parquet" for i in range(ROWS // PER_SHARD)]

# phase -> (fault, shards complete when killed, temp file left by the kill or None)
PHASES = {
    "before_first_shard": ({"at": "first_shard"}, [], None),
    "inside_shard_write": ({"at": "shard_write", "shard": 1}, SHARDS[:1], ".shard-00001.parquet.tmp-"),
    "between_rename_and_next_shard": ({"at": "shard_renamed", "shard": 0}, SHARDS[:1], None),
    "between_last_rename_and_manifest": ({"at": "shard_renamed", "shard": "last"}, SHARDS, None),
    "inside_manifest_write": ({"at": "manifest_write"}, SHARDS, ".manifest.json.tmp-"),
    "inside_last_shard": ({"at": "shard_write", "shard": "last"}, SHARDS[:3], ".shard-00003.parquet.tmp-"),
}
TRAIN_ARGS = [*TRAIN[:TRAIN.index("--max-steps")], *TRAIN[TRAIN.index("--max-steps") + 2:],
              "--max-steps", "6", "--save-steps", "2", "--seed", "7"]


def scored_now(output: str) -> tuple[int, int]:
    m = re.search(r"(?:wrote|the cache holds) (\d+) pairs \((\d+) scored now\)", output)
    assert m, output
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="module")
def world(tmp_path_factory, llama_dir, dpo_data, dpo_cache):
    """Fork every process at once; meanwhile make the clean cache and the uninterrupted training run in process."""
    base = tmp_path_factory.mktemp("processes")
    data = write_jsonl(base / "prefs.jsonl", pref_rows(ROWS, seed=41))
    bad = write_jsonl(base / "bad.jsonl", [*pref_rows(3), {"id": "x", "prompt": "why?", "chosen": 7, "rejected": "no"}])
    args = ["--model", llama_dir, "--data", data, "--rows-per-shard", PER_SHARD, "--no-progress"]
    train_args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, *TRAIN_ARGS]
    w = {"base": base, "args": args, "train_args": train_args, "clean": base / "clean",
         "train_out": base / "train-killed", "train_clean": base / "train-clean", "busy": base / "busy",
         "paused": base / "paused.reached", "go": base / "go", "bad": bad}
    runs = {phase: ("precompute-ref", [*args, "--out", base / phase], {"marker": base / f"{phase}.reached", **fault})
            for phase, (fault, _, _) in PHASES.items()}
    runs["train"] = ("train-dpo", [*train_args, "--output-dir", w["train_out"]],
                     {"at": "checkpoint", "step": 4, "marker": base / "train.reached"})
    w["train_mid_out"] = base / "train-killed-mid-checkpoint"
    runs["train_mid_checkpoint"] = ("train-dpo", [*train_args, "--output-dir", w["train_mid_out"]],
                                    {"at": "checkpoint_write", "step": 4})
    # concurrency: a writer paused inside shard 1; once it is there, a second writer and a train-dpo start
    busy = [*args, "--out", w["busy"]]
    runs["writer"] = ("precompute-ref", busy, {"at": "shard_write", "shard": 1, "action": "pause",
                                               "marker": w["paused"], "go": w["go"]})
    runs["second_writer"] = ("precompute-ref", busy, {"after": w["paused"]})
    runs["second_writer_overwrite"] = ("precompute-ref", [*busy, "--overwrite"], {"after": w["paused"]})
    runs["reader"] = ("train-dpo", ["--model", llama_dir, "--data", data, "--ref-cache", w["busy"],
                                    "--output-dir", base / "reader-out", *TRAIN], {"after": w["paused"]})
    # exit codes and tracebacks of real processes
    runs["bad_row"] = ("precompute-ref", ["--model", llama_dir, "--data", bad, "--out", base / "bad-out"], {})
    runs["bad_row_debug"] = ("precompute-ref", ["--model", llama_dir, "--data", bad, "--out", base / "bad-out-2",
                                                "--debug"], {})
    runs["train_incomplete"] = ("train-dpo", ["--model", llama_dir, "--data", dpo_data, "--ref-cache", base,
                                              "--output-dir", base.parent / f"{base.name}-never", *TRAIN], {})
    runs["audit_incomplete"] = ("audit-ref", [base], {})
    w["procs"] = zygote = Zygote(base / "procs", runs)
    try:
        clean = precompute(*args[:-1], "--out", w["clean"])
        assert clean.exit_code == 0, clean.output
        uninterrupted = train(*train_args, "--output-dir", w["train_clean"])
        assert uninterrupted.exit_code == 0, uninterrupted.output
        yield w
    finally:
        zygote.close()


# ---------------------------------------------------------------------------------------------------------------
# crashes


@pytest.mark.parametrize("phase", list(PHASES))
def test_precompute_killed_then_rerun_equals_a_clean_run(world, phase):
    fault, complete, temp = PHASES[phase]
    base, out, clean = world["base"], world["base"] / phase, world["clean"]
    code, _, stderr = world["procs"].result(phase)
    assert code == -signal.SIGKILL, stderr
    assert (base / f"{phase}.reached").exists()
    clean_shards = file_hashes(clean, "*.parquet")

    # 1. After the kill: completed shards are intact and equal to the clean run's; anything partial sits in a dot-file
    #    that is neither a shard nor a manifest; the directory reads as incomplete.
    shards = file_hashes(out, "*.parquet")
    assert sorted(shards) == complete
    assert shards == {k: clean_shards[k] for k in complete}
    others = sorted(p.name for p in out.iterdir() if p.name not in shards)
    assert fmt.MANIFEST not in others
    temps = [n for n in others if n != fmt.LOCK]
    assert all(n.startswith(".") and ".tmp-" in n and not n.endswith((".parquet", ".json")) for n in temps), temps
    assert [n.rsplit("-", 1)[0] + "-" for n in temps] == ([temp] if temp else [])
    with pytest.raises(fmt.CacheError) as err:
        open_cache(out)
    assert err.value.kind == "incomplete"
    code, report, output = audit(out)
    assert code == 2 and report is None and "no manifest.json" in output

    # 2. The same command again: only the missing shards are scored, and the result equals a clean run.
    rerun = precompute(*world["args"][:-1], "--out", out)
    assert rerun.exit_code == 0, rerun.output
    assert scored_now(rerun.output) == (ROWS, ROWS - PER_SHARD * len(complete))
    if complete and len(complete) < len(SHARDS):
        assert f"({len(complete)} already done)" in rerun.output
    assert file_hashes(out, "*.parquet") == clean_shards
    assert {k: file_hashes(out, "*.parquet")[k] for k in complete} == shards  # finished shards kept, not rewritten
    assert sorted(p.name for p in out.iterdir()) == sorted([*clean_shards, fmt.MANIFEST, fmt.CARD, fmt.LOCK])  # no temp files
    ours, theirs = manifest_of(out), manifest_of(clean)
    for key in ("shards", "stamps", "encoding", "rows", "format_version", "computation"):
        assert ours[key] == theirs[key], key
    open_cache(out)


def test_train_killed_between_checkpoints_resumes_to_the_uninterrupted_weights(world):
    out, clean = world["train_out"], world["train_clean"]
    code, _, stderr = world["procs"].result("train")
    assert code == -signal.SIGKILL, stderr

    # The completed checkpoints are whole and equal to the uninterrupted run's; nothing looks like a finished run.
    for step in (2, 4):
        ckpt = out / f"checkpoint-{step}"
        assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == step
        for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
            assert (ckpt / name).is_file(), name
        assert model_hash(ckpt) == model_hash(clean / f"checkpoint-{step}")
    assert not (out / "checkpoint-6").exists()
    assert not (out / "model.safetensors").exists() and not (out / "run-manifest.json").exists()
    kept = {step: file_hashes(out / f"checkpoint-{step}") for step in (2, 4)}

    resumed = train(*world["train_args"], "--output-dir", out, "--resume-from-checkpoint", out / "checkpoint-4")
    assert resumed.exit_code == 0, resumed.output
    assert "trained 6 steps" in resumed.output
    run = json.loads((out / "run-manifest.json").read_text())
    assert run["result"]["steps"] == 6
    assert run["final_model_hash"] == model_hash(out) == model_hash(world["train_clean"])
    assert json.loads((clean / "run-manifest.json").read_text())["final_model_hash"] == run["final_model_hash"]
    assert model_hash(out / "checkpoint-6") == model_hash(clean / "checkpoint-6")
    assert {step: file_hashes(out / f"checkpoint-{step}") for step in (2, 4)} == kept  # not rewritten or lost
    steps = {json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert {1, 2, 3, 4, 5, 6} <= steps  # the resumed run's log continues the killed run's


def test_train_killed_while_saving_a_checkpoint_refuses_it_and_resumes_from_the_one_before(world):
    """Killed inside checkpoint-4's save (weights written, trainer_state.json not): resuming from the partial folder
    is refused up front (the Trainer would fail on it after verification, or in some versions restart at step 0 from
    half-saved state); checkpoint-2 is whole and resumes to the uninterrupted run's weights."""
    out = world["train_mid_out"]
    code, _, stderr = world["procs"].result("train_mid_checkpoint")
    assert code == -signal.SIGKILL, stderr
    assert (out / "checkpoint-4" / "model.safetensors").exists()
    assert not (out / "checkpoint-4" / "trainer_state.json").exists()
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2

    refused = train(*world["train_args"], "--output-dir", out, "--resume-from-checkpoint", out / "checkpoint-4")
    assert refused.exit_code == 2, refused.output
    assert f"error: --resume-from-checkpoint {out / 'checkpoint-4'}: no trainer_state.json in it (not a Trainer " \
           "checkpoint, or one interrupted while being saved)" in refused.output
    resumed = train(*world["train_args"], "--output-dir", out, "--resume-from-checkpoint", out / "checkpoint-2")
    assert resumed.exit_code == 0, resumed.output
    assert model_hash(out) == model_hash(world["train_clean"])
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4  # now whole


# ---------------------------------------------------------------------------------------------------------------
# concurrency


def test_second_writer_and_reader_are_refused_while_a_writer_runs(world):
    procs, busy = world["procs"], world["busy"]
    wait_for(world["paused"], procs.proc, timeout=300)
    during = file_hashes(busy, ".*") | file_hashes(busy)
    assert sorted(p.name for p in busy.glob("*.parquet")) == SHARDS[:1] and not (busy / fmt.MANIFEST).exists()
    writer_pid = (world["paused"]).read_text()

    for name in ("second_writer", "second_writer_overwrite"):
        code, stdout, stderr = procs.result(name)
        assert code == 2, stderr
        assert f"error: {busy} is being written by another precompute-ref process (pid {writer_pid}); wait for it " \
               "to finish or choose another --out" in stderr
        assert "Traceback" not in stderr and stdout == ""
    code, _, stderr = procs.result("reader")
    assert code == 2, stderr
    assert f"error: --ref-cache {busy} has no manifest.json: the cache is incomplete (precompute-ref is still running or was " \
           "interrupted)" in stderr and "remedy:   wait for precompute-ref to finish" in stderr
    assert not (world["base"] / "reader-out").exists()
    # in process too, with --overwrite: refused, and nothing of the running writer's was touched
    result = precompute(*world["args"][:-1], "--out", busy, "--overwrite")
    assert result.exit_code == 2 and "being written by another precompute-ref process" in result.output
    code, report, output = audit(busy)
    assert code == 2 and "no manifest.json" in output
    assert file_hashes(busy, ".*") | file_hashes(busy) == during

    world["go"].write_text("")  # the writer carries on and finishes a cache equal to a clean run
    code, stdout, stderr = procs.result("writer")
    assert code == 0, stderr
    assert scored_now(stdout) == (ROWS, ROWS)
    assert file_hashes(busy, "*.parquet") == file_hashes(world["clean"], "*.parquet")
    assert manifest_of(busy)["shards"] == manifest_of(world["clean"])["shards"]
    open_cache(busy)


# ---------------------------------------------------------------------------------------------------------------
# exit codes and tracebacks of real processes


def test_real_process_exit_codes_and_tracebacks(world):
    bad, procs = world["bad"], world["procs"]
    reason = f"error: {bad}, row 4: bad_type: 'chosen' is int; expected a string or a list of messages"
    code, stdout, stderr = procs.result("bad_row")
    assert (code, stdout) == (2, "") and stderr.strip().endswith(reason) and "Traceback" not in stderr
    code, _, stderr = procs.result("bad_row_debug")
    assert code == 2 and "Traceback (most recent call last)" in stderr and "DataError" in stderr and reason in stderr
    code, _, stderr = procs.result("train_incomplete")
    # a folder with no shard, lock or temporary file of a writer: no cache there, not an interrupted one
    assert code == 2 and "holds no cache (no manifest.json and no shard" in stderr and "Traceback" not in stderr
    code, _, stderr = procs.result("audit_incomplete")
    assert code == 2 and "holds no cache" in stderr and "Traceback" not in stderr
