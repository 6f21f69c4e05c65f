"""What a TRL user brings along (issue 25): a torchrun launch without --use-cpu on a machine without a GPU, and the
evaluation settings of a `trl dpo` recipe or of the Trainer's options. Each is carried out as asked or refused with
the remedy, never dropped in silence: one job across the torchrun processes; an evaluation asked for happens (its
rows need a cache: the message names the command that makes it) and one turned off does not happen. And data with
bad rows against a cache that skipped them (precompute-ref --on-bad-row skip): the refusal says so and what to pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TORCHRUN, pref_rows, run_in_session, write_jsonl
from faultkit import EXIT_REFUSED, TRAIN, assert_one_paragraph, precompute, train


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evals(out: Path) -> list[int]:
    return [r["step"] for r in metrics(out) if "eval_loss" in r]


# ---------------------------------------------------------------------------------------------------------------
# torchrun without --use-cpu


def test_torchrun_on_cpu_without_use_cpu_is_one_job(tmp_path, llama_dir, dpo_data, dpo_cache):
    """Two processes, no GPU, no --use-cpu: the Trainer joins the launcher's gloo group (world size 2), so each step
    is logged once and one summary is printed, not two single-process trainings into one folder."""
    out = tmp_path / "run"
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out,
            "--max-steps", "2", "--per-device-train-batch-size", "2", "--logging-steps", "1", "--learning-rate",
            "1e-3", "--save-strategy", "no", "--no-plot"]
    p = run_in_session([*TORCHRUN, "-m", "dpo.cli", *map(str, args)], REPO, env={"PYTHONPATH": str(REPO)})
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2]  # once each, not once per process
    assert p.stdout.count("trained 2 steps") == 1, p.stdout
    assert json.loads((out / "run-manifest.json").read_text())["result"]["world_size"] == 2


def test_a_trainer_outside_the_launchers_job_is_refused(monkeypatch):
    """The one mechanism behind it: under torchrun, a Trainer job of another size than the launcher's is refused
    before any data is read (whatever made the Trainer train alone: a device setting, an accelerator it skipped)."""
    from dpo.preflight import check_one_job
    from runtime.errors import JobError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(JobError, match=r"^launched as 2 processes \(WORLD_SIZE=2\), but the Trainer set up a job "
                                       r"of 1: each process would train alone"):
        check_one_job(1)
    check_one_job(2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_one_job(1)  # torchrun --nproc-per-node 1, or no torchrun


# ---------------------------------------------------------------------------------------------------------------
# evaluation settings


@pytest.fixture(scope="module")
def folder(tmp_path_factory, llama_dir):
    """A data folder with train.jsonl and test.jsonl (datasets' splits train and test) and the train split's cache."""
    root = tmp_path_factory.mktemp("trl-folder")
    data = root / "prefs"
    write_jsonl(data / "train.jsonl", pref_rows(12, fmt="conversational"))
    write_jsonl(data / "test.jsonl", pref_rows(8, seed=7, fmt="conversational"))
    made = precompute("--model", llama_dir, "--data", data, "--out", root / "cache-train")
    assert made.exit_code == 0, made.output
    return {"root": root, "data": data, "cache": root / "cache-train"}


def recipe(tmp_path: Path, llama_dir, folder, **keys) -> Path:
    """A `trl dpo` YAML (ScriptArguments, ModelConfig and DPOConfig keys) that evaluates on its test split."""
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": str(llama_dir), "dataset_name": str(folder["data"]),
                                    "dataset_test_split": "test", "eval_strategy": "steps", "eval_steps": 1,
                                    "output_dir": str(tmp_path / "run"), **keys}))
    return path


def test_trl_recipe_evaluation_without_its_cache_is_refused(tmp_path, llama_dir, folder):
    result = train("--config", recipe(tmp_path, llama_dir, folder), "--ref-cache", folder["cache"], *TRAIN)
    assert result.exit_code == EXIT_REFUSED, result.output
    assert (f"error: evaluation on split 'test' of --data {folder['data']} (for --eval-strategy steps) needs the "
            f"reference log-probs of its rows: run `precompute-ref --model {llama_dir} --data {folder['data']} "
            "--split test --out EVAL_CACHE`") in result.output
    assert "pass --eval-ref-cache EVAL_CACHE, or pass --eval-strategy no" in result.output
    assert_one_paragraph(result.output)
    assert not (tmp_path / "run").exists()


def test_trl_recipe_evaluates_with_the_cache_the_message_names(tmp_path, llama_dir, folder):
    """The command the refusal names makes the cache, and the recipe then evaluates on its test split."""
    eval_cache = folder["root"] / "cache-test"
    if not eval_cache.exists():
        made = precompute("--model", llama_dir, "--data", folder["data"], "--split", "test", "--out", eval_cache)
        assert made.exit_code == 0, made.output
    i = TRAIN.index("--max-steps")
    result = train("--config", recipe(tmp_path, llama_dir, folder), "--ref-cache", folder["cache"],
                   "--eval-ref-cache", eval_cache, *TRAIN[:i], *TRAIN[i + 2:], "--max-steps", "2")
    assert result.exit_code == 0, result.output
    assert f"note: --eval-strategy steps: evaluating on split 'test' of --data {folder['data']}" in result.output
    assert evals(tmp_path / "run") == [1, 2]  # every eval_steps, none at the start (TRL's eval_on_start false)
    manifest = json.loads((tmp_path / "run" / "run-manifest.json").read_text())
    assert manifest["eval_data"]["split"] == "test" and manifest["result"]["eval"]["eval_loss"] > 0


def test_trl_recipe_with_eval_strategy_no_trains_without_evaluation(tmp_path, llama_dir, folder):
    """TRL's default (eval_strategy no; dataset_test_split is always in a recipe): no evaluation, no eval cache asked."""
    result = train("--config", recipe(tmp_path, llama_dir, folder, eval_strategy="no", eval_on_start=False),
                   "--ref-cache", folder["cache"], *TRAIN)
    assert result.exit_code == 0, result.output
    assert evals(tmp_path / "run") == [] and "note: --eval-strategy" not in result.output
    assert json.loads((tmp_path / "run" / "run-manifest.json").read_text())["eval_data"] is None


def test_unquoted_no_in_a_recipe_is_the_strategy_no(tmp_path):
    """YAML 1.1 reads `eval_strategy: no` as false; it is the strategy no, not a type error or a run that evaluates."""
    from dpo.config_file import load_config_file

    path = tmp_path / "dpo.yaml"
    path.write_text("eval_strategy: no\nsave_strategy: no\nlogging_strategy: no\ndataset_test_split: test\n")
    assert load_config_file(str(path)) == {"eval_strategy": "no", "save_strategy": "no", "logging_strategy": "no",
                                           "eval_split": "test"}


def test_eval_strategy_steps_without_eval_rows_is_refused(tmp_path, llama_dir, dpo_data, dpo_cache):
    result = train("--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir",
                   tmp_path / "run", "--eval-strategy", "steps", *TRAIN)
    assert result.exit_code == EXIT_REFUSED, result.output
    assert (f"error: --eval-strategy steps needs evaluation rows, and --data {dpo_data} is one file (it has no split "
            "'test' to evaluate on): give --eval-data EVAL_FILE with --eval-ref-cache EVAL_CACHE") in result.output
    assert_one_paragraph(result.output)
    assert not (tmp_path / "run").exists()


def test_eval_on_start_without_eval_rows_is_refused(tmp_path, llama_dir, dpo_data, dpo_cache):
    result = train("--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir",
                   tmp_path / "run", "--eval-on-start", *TRAIN)
    assert result.exit_code == EXIT_REFUSED, result.output
    assert "error: --eval-on-start asks for an evaluation, and there is none: no --eval-data" in result.output
    assert_one_paragraph(result.output)


def test_eval_strategy_no_evaluates_nothing(tmp_path, llama_dir, dpo_data, dpo_cache):
    """--eval-data with --eval-strategy no: verified (and recorded), never evaluated: not at the start, the steps or
    the end."""
    result = train("--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--eval-data", dpo_data,
                   "--eval-split", "train", "--eval-strategy", "no", "--output-dir", tmp_path / "run", *TRAIN)
    assert result.exit_code == 0, result.output
    assert f"note: --eval-strategy no: --eval-data {dpo_data} is verified, not evaluated" in result.output
    assert evals(tmp_path / "run") == []
    manifest = json.loads((tmp_path / "run" / "run-manifest.json").read_text())
    assert manifest["result"]["eval"] == {} and manifest["eval_data"]["path"] == str(dpo_data)


# ---------------------------------------------------------------------------------------------------------------
# a cache made with --on-bad-row skip


@pytest.fixture(scope="module")
def skip_cache(tmp_path_factory, llama_dir):
    """Data with two bad rows (line 6 has no chosen, line 23 is not JSON) and its cache made with --on-bad-row skip."""
    root = tmp_path_factory.mktemp("skip-cache")
    lines = [json.dumps(r) for r in pref_rows(30, fmt="conversational")]
    lines[5] = json.dumps({"id": "x5", "prompt": [{"role": "user", "content": "hi"}]})
    lines[22] = "not json at all"
    data = root / "prefs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    made = precompute("--model", llama_dir, "--data", data, "--out", root / "cache", "--on-bad-row", "skip")
    assert made.exit_code == 0 and "skipped 2 bad rows" in made.output, made.output
    return {"data": data, "cache": root / "cache"}


def test_train_on_a_skip_cache_says_it_skipped_and_what_to_pass(tmp_path, llama_dir, skip_cache):
    result = train("--model", llama_dir, "--data", skip_cache["data"], "--ref-cache", skip_cache["cache"],
                   "--output-dir", tmp_path / "run", *TRAIN)
    assert result.exit_code == EXIT_REFUSED, result.output
    assert (f"error: {skip_cache['data']}, row 6: missing_field: row has no 'chosen' value") in result.output
    assert (f"; the cache {skip_cache['cache']} was made with --on-bad-row skip and left out 2 bad row(s) (listed "
            "in its skipped.jsonl): pass --on-bad-row skip to train on the rows it holds") in result.output
    assert_one_paragraph(result.output)
    assert not (tmp_path / "run").exists()


def test_train_with_on_bad_row_skip_on_a_skip_cache_trains_and_says_so(tmp_path, llama_dir, skip_cache):
    """The remedy the refusal names: the same rows are left out, and the log says how many and why."""
    result = train("--model", llama_dir, "--data", skip_cache["data"], "--ref-cache", skip_cache["cache"],
                   "--output-dir", tmp_path / "run", "--on-bad-row", "skip", *TRAIN)
    assert result.exit_code == 0, result.output
    assert f"verified {skip_cache['cache']}, cache version 1 " in result.output  # (the version line)
    assert ": 28 rows, 2 bad rows skipped (bad_json: 1, missing_field: 1)" in result.output
    manifest = json.loads((tmp_path / "run" / "run-manifest.json").read_text())
    assert manifest["data"]["rows"] == 28


def test_a_bad_row_against_a_cache_that_skipped_none_has_no_skip_hint(tmp_path, llama_dir, dpo_data, dpo_cache):
    """The hint is the cache's record, not a guess: a cache made with --on-bad-row error gets the plain refusal."""
    lines = dpo_data.read_text().splitlines()
    lines[5] = "not json at all"
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    result = train("--model", llama_dir, "--data", data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "run",
                   *TRAIN)
    assert result.exit_code == EXIT_REFUSED, result.output
    assert f"error: {data}, row 6: bad_json: unparsable JSON (Expecting value at column 1)" in result.output
    assert "--on-bad-row skip" not in result.output


@pytest.mark.parametrize("option, value, said", [("--optim-args", "foo", "the Trainer cannot build the optimizer"),
                                                 ("--lr-scheduler-kwargs", "[1,2]", "are a JSON object")])
def test_a_trainer_option_read_only_when_training_starts_is_refused_before_anything_is_written(
        tmp_path, llama_dir, dpo_data, dpo_cache, option, value, said):
    """Hostile pass: a bad --optim-args / --lr-scheduler-kwargs failed at the first step, exit 1 'unexpected
    ValueError', after the run record was written: the corrected rerun was then refused ('already holds files')."""
    out = tmp_path / "run"
    r = train("--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN,
              option, value)
    assert r.exit_code == EXIT_REFUSED and said in r.output, r.output
    assert_one_paragraph(r.output)
    assert not out.exists()
