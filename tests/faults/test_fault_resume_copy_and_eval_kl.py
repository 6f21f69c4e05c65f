"""Issue 36 (leftovers of the hostile pass), train-dpo's quiet cases, each the command as typed and the line asserted:
a resume whose --ref-cache is a copy of the cache the run trained with (another folder, the same content and cache
id) goes on, and says so in one line; a top-k training cache with an eval cache made without --top-k gets a note whose
precompute-ref command (copied as printed) makes the eval cache that logs the KL figures."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from faultkit import TRAIN, copy_tree, precompute, train
from support import pref_rows, write_jsonl


@pytest.fixture(scope="module")
def world(tmp_path_factory, llama_dir):
    base = tmp_path_factory.mktemp("issue36-notes")
    data = write_jsonl(base / "train.jsonl", pref_rows(8))
    evals = write_jsonl(base / "eval.jsonl", pref_rows(4, seed=1))
    return {"base": base, "model": llama_dir, "data": data, "eval": evals}


def _cache(world, name, data, *options):
    out = world["base"] / name
    if not out.exists():
        made = precompute("--model", world["model"], "--data", data, "--out", out, *options)
        assert made.exit_code == 0, made.output
    return out


def test_a_resume_against_a_copy_of_its_cache_says_it_is_the_same_cache(world, tmp_path):
    cache = _cache(world, "cache", world["data"])
    i = TRAIN.index("--max-steps")
    args = ["--model", world["model"], "--data", world["data"], *TRAIN[:i], *TRAIN[i + 2:], "--save-steps", "1"]
    run = train(*args, "--ref-cache", cache, "--output-dir", tmp_path / "run", "--max-steps", "1")
    assert run.exit_code == 0, run.output
    trained_id = json.loads((tmp_path / "run" / "checkpoint-1" / "refcache-reference.json").read_text())["cache"]
    copy = copy_tree(cache, tmp_path / "copy")
    resumed = train(*args, "--ref-cache", copy, "--output-dir", tmp_path / "run", "--max-steps", "2",
                    "--resume-from-checkpoint", tmp_path / "run" / "checkpoint-1")
    assert resumed.exit_code == 0, resumed.output
    line = (f"resume: the cache at {copy} is the one this run trained with (cache id {trained_id['cache_id']}, was "
            f"at {cache})")
    assert line in resumed.output, resumed.output
    # checkpoint-2 was trained on the copy: resumed against it, no such line
    again = train(*args, "--ref-cache", copy, "--output-dir", tmp_path / "run", "--max-steps", "3",
                  "--resume-from-checkpoint", tmp_path / "run" / "checkpoint-2")
    assert again.exit_code == 0, again.output
    assert "is the one this run trained with" not in again.output, again.output


def test_an_eval_cache_without_top_k_is_answered_with_the_command_that_makes_one(world, tmp_path):
    top_k = _cache(world, "cache-top4", world["data"], "--top-k", "4")
    plain = _cache(world, "eval-plain", world["eval"])
    args = ["--model", world["model"], "--data", world["data"], "--ref-cache", top_k, "--eval-data", world["eval"],
            *TRAIN, "--eval-strategy", "steps", "--eval-steps", "1"]
    run = train(*args, "--eval-ref-cache", plain, "--output-dir", tmp_path / "run")
    assert run.exit_code == 0, run.output
    note = next(line for line in run.output.splitlines() if line.startswith("note: the eval cache"))
    assert "so the evaluations log no KL figures (the train steps do, from --ref-cache's top-k 4)" in note, note
    command = re.search(r"`(precompute-ref [^`]+)`, then pass --eval-ref-cache EVAL_CACHE", note)
    assert command, note
    words = shlex.split(command.group(1))
    assert words[words.index("--top-k") + 1] == "4" and words[words.index("--data") + 1] == str(world["eval"])
    # the command as printed, EVAL_CACHE filled in, makes the eval cache that logs the KL figures
    made = precompute(*[str(tmp_path / "eval-top4") if w == "EVAL_CACHE" else w for w in words[1:]])
    assert made.exit_code == 0, made.output
    again = train(*args, "--eval-ref-cache", tmp_path / "eval-top4", "--output-dir", tmp_path / "run2")
    assert again.exit_code == 0, again.output
    assert "log no KL figures" not in again.output, again.output
