"""precompute/cli.py: precompute-ref as a real process (kill -9 and resume, a second process on the same cache, exit
codes) and its --help, generated from the config dataclasses."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from conftest import HELPERS, dir_state, paused_in_shard, pref_rows, shard_hashes, write_jsonl
from precompute.cli import main
from schemas import format as fmt
from schemas.cache import open_cache

PRECOMPUTE_REF = str(Path(sys.executable).parent / "precompute-ref")
PAUSE_HELPER = str(HELPERS / "precompute_pause.py")


def run(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([PRECOMPUTE_REF, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def in_process(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_run_killed_mid_shard_resumes_to_the_clean_run_bytes(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(40, seed=29))
    args = ["--model", str(llama_dir), "--data", str(data), "--rows-per-shard", "4", "--no-progress"]
    out = tmp_path / "killed"
    # The uninterrupted run is a fresh process too (same environment, same threads), started alongside.
    clean_run = subprocess.Popen([PRECOMPUTE_REF, *args, "--out", str(tmp_path / "clean")], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    try:
        with paused_in_shard([*args, "--out", out], 3, tmp_path / "paused", timeout=300):
            # Mid-run: shards 0-2 finished, shard 3 half-written into its temp file, no manifest; then kill -9.
            assert sorted(p.name for p in out.glob("shard-*.parquet")) == [f"shard-{i:05d}.parquet" for i in range(3)]
            assert len(list(out.glob(".shard-00003.parquet.tmp-*"))) == 1
            assert not (out / fmt.MANIFEST).exists()
        _, err = clean_run.communicate(timeout=300)
        assert clean_run.returncode == 0, err
    finally:
        if clean_run.poll() is None:
            clean_run.kill()
            clean_run.wait()
    partial = shard_hashes(out)

    rerun = run(*args, "--out", out)
    assert rerun.returncode == 0, rerun.stderr
    assert "wrote 40 pairs (28 scored now) in 10 shards" in rerun.stdout  # only shards 3-9 were scored again
    assert "(3 already done)" in rerun.stderr

    clean = shard_hashes(tmp_path / "clean")
    assert len(clean) == 10
    assert shard_hashes(out) == clean
    assert {k: clean[k] for k in partial} == partial  # the shards written before the kill were kept as they were
    assert sorted(p.name for p in out.iterdir()) == sorted([*clean, fmt.MANIFEST, fmt.CARD, fmt.LOCK])  # no temp files
    assert json.loads((out / fmt.MANIFEST).read_text())["shards"] == \
        json.loads((tmp_path / "clean" / fmt.MANIFEST).read_text())["shards"]
    open_cache(out)


def test_second_process_on_the_same_cache_is_refused(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(8, seed=31))
    out = tmp_path / "cache"
    args = ["--model", llama_dir, "--data", data, "--out", out, "--no-progress"]
    in_process(*args)
    with open(out / fmt.LOCK, "a+") as held:  # what a running precompute-ref holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.truncate(0)
        held.write(str(os.getpid()))
        held.flush()
        before = dir_state(out)
        second = run(*args, "--overwrite")
        assert dir_state(out) == before  # nothing deleted, rewritten or added
    assert second.returncode == 2, second.stderr
    assert f"being written by another precompute-ref process (pid {os.getpid()})" in second.stderr
    assert second.stdout == ""
    open_cache(out)


def test_bad_row_exit_code_and_message(llama_dir, tmp_path):
    rows = pref_rows(6, seed=37)
    rows[2]["chosen"] = ""
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    result = run("--model", llama_dir, "--data", data, "--out", tmp_path / "cache", "--no-progress")
    assert result.returncode == 2
    assert result.stderr.strip().endswith(f"error: {data}, row 3: empty_field: 'chosen' is an empty string")
    assert result.stdout == "" and not (tmp_path / "cache" / fmt.MANIFEST).exists()


# ---------------------------------------------------------------------------------------------------------------
# --help


def test_help_is_generated_from_the_config_fields():
    """Options come from PrecomputeConfig and EncodingConfig themselves (no hand-kept list to drift): every field is
    an option in both spellings, with its metadata's words and the dataclass's default."""
    import dataclasses

    from precompute.job import PrecomputeConfig
    from schemas.encoding import EncodingConfig

    result = CliRunner().invoke(main, ["--help"], terminal_width=400)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for name in ("Model options:", "Data options:", "Encoding options:", "Computation options:", "Output options:"):
        assert name in text
    for cls in (PrecomputeConfig, EncodingConfig):
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                assert f"--{f.name.replace('_', '-')}" not in text
                continue
            assert f"--{f.name.replace('_', '-')}" in text and f"--{f.name}" in text
            assert " ".join(f.metadata["help"].split()) in text
            default = f.default if f.default is not dataclasses.MISSING else None
            if default is not None:
                assert " ".join(f.metadata["help"].split()) + f" [default: {default}]" in text


def test_a_missing_required_option_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["--data", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "missing --model (on the command line or in --config)" in result.output, result.output
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------------------------------------
# issue 25 item 11: the progress bar counts whole pairs; a rerun with nothing left says so


def test_progress_counts_whole_pairs_when_a_batch_splits_a_pair(llama_dir, tmp_path):
    """full_forward batches sequences by length, so a pair's chosen and rejected can land in different batches: the
    bar moves by the pairs each batch completed (whole numbers), not by half pairs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from precompute.modes import lookup
    from precompute.modes.scoring import score_pairs
    from runtime.data import encode_rows, load_rows
    from schemas.encoding import EncodingConfig

    tok = AutoTokenizer.from_pretrained(llama_dir)
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(24, seed=5))
    pairs = encode_rows(load_rows(data), tok, EncodingConfig()).pairs
    budget = 64
    batches = [list(b) for b in lookup("full_forward").plan(pairs, budget)]
    batch_of = {i: n for n, b in enumerate(batches) for i in b}
    split = [p for p in range(len(pairs)) if batch_of[2 * p] != batch_of[2 * p + 1]]
    assert split and len(batches) > 2  # the case under test occurs
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    ticks = []
    score_pairs(model, pairs, tok.pad_token_id, budget, "full_forward", lambda n, tokens: ticks.append(n))
    # independently: after batch n, the pairs whose two sequences are both in batches 0..n
    whole = [sum(max(batch_of[2 * p], batch_of[2 * p + 1]) == n for p in range(len(pairs)))
             for n in range(len(batches))]
    assert ticks == whole and all(type(t) is int for t in ticks) and sum(ticks) == len(pairs)


def test_a_rerun_with_nothing_left_says_nothing_to_score(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(8, seed=41))
    args = ["--model", llama_dir, "--data", data, "--out", tmp_path / "cache"]
    first = in_process(*args, "--no-progress").output
    assert "throughput:" in first and "nothing to score" not in first
    rerun = in_process(*args).output  # with the progress bar: nothing to draw either
    assert "nothing to score: the cache holds 8 pairs (0 scored now)" in rerun
    assert "nothing to score: every pair was in the cache already" in rerun
    assert "tokens/s" not in rerun and "throughput" not in rerun and "tok/s" not in rerun


def test_the_progress_bar_counts_pairs(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(10, seed=43))
    out = in_process("--model", llama_dir, "--data", data, "--out", tmp_path / "cache", "--token-budget", 64).output
    assert "10/10" in out and ("pair/s" in out or "s/pair" in out) and "row/s" not in out, out


def test_trl_spellings_and_a_top_k_summary(llama_dir, tmp_path):
    """precompute-ref takes TRL's --model_name_or_path / --dataset_name / --dataset_train_split as train-dpo does (one
    alias table), and the summary of a top-k cache says top-8."""
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(6, seed=3))
    out = tmp_path / "cache"
    result = in_process("--model_name_or_path", llama_dir, "--dataset_name", data, "--dataset_train_split", "train",
                        "--out", out, "--top-k", 8, "--no-progress")
    assert open_cache(out).manifest["computation"]["top_k"] == 8
    assert "top-8: every completion token's 8 most probable tokens" in result.stdout
    plain = in_process("--model", llama_dir, "--data", data, "--out", tmp_path / "plain", "--no-progress")
    assert "top-" not in plain.stdout


def test_top_k_help_gives_the_size_per_k():
    text = " ".join(CliRunner().invoke(main, ["--help"]).output.split())
    assert "--model-name-or-path" in text and "--dataset-name" in text
    # the README's measured bytes per completion token, K = 0 / 8 / 32 / 128
    assert "about 7 bytes per completion token at K = 0, 31 at K = 8, 86 at K = 32, 288 at K = 128" in text
