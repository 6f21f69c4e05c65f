"""Bad input: a corpus of malformed data files and arguments for each command. Every case ends in one error
paragraph that names the file (and the row, for data) and the reason, with exit code 2 and no traceback (tracebacks
only with --debug). Everything runs in process (click's CliRunner); real processes are in test_fault_processes.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import DPO_PAIRS, pref_rows
from faultkit import TRAIN, assert_one_paragraph, copy_tree, precompute, train
from schemas import format as fmt

GOOD = [json.dumps(r) for r in pref_rows(4, seed=11)]  # ids r0000..r0003
CONV = [json.dumps(r) for r in pref_rows(DPO_PAIRS, fmt="conversational")]  # the rows of dpo_cache
IMPLICIT = [json.dumps(r) for r in pref_rows(4, seed=11, fmt="implicit")]  # no prompt key: TRL's implicit prompt
HUGE = " ".join(["question"] * 100_000) + "?"  # ~900 kB in one row


def msg(role, content):
    return {"role": role, "content": content}


def jsonl(*lines: str | bytes) -> bytes:
    return b"".join((line if isinstance(line, bytes) else line.encode("utf-8")) + b"\n" for line in lines)


def bad_line(row: int, line: str | bytes, good=GOOD) -> bytes:
    """A JSON Lines file whose line `row` (1-based) is `line` and the others are good rows."""
    lines = list(good)
    lines.insert(row - 1, line)
    return jsonl(*lines)


# ---------------------------------------------------------------------------------------------------------------
# data files: (case, file name, content, row, reason) -> "error: FILE, row ROW: REASON"

STANDARD = {
    "wrong_type_int": (bad_line(3, '{"id": "b", "prompt": "why?", "chosen": 5, "rejected": "no"}'), 3,
                       "bad_type: 'chosen' is int; expected a string or a list of messages"),
    "wrong_type_object": (bad_line(2, '{"id": "b", "prompt": {"text": "why?"}, "chosen": "a", "rejected": "b"}'), 2,
                          "bad_type: 'prompt' is dict"),
    "nan_value": (bad_line(2, '{"id": "b", "prompt": "why?", "chosen": NaN, "rejected": "b"}'), 2,
                  "missing_field: row has no 'chosen' value (missing or null"),  # the JSON loader reads NaN as null
    "missing_key": (bad_line(4, '{"id": "b", "prompt": "why?", "chosen": "yes"}'), 4,
                    "missing_field: row has no 'rejected'"),
    "null_value": (bad_line(1, '{"id": "b", "prompt": "why?", "chosen": "yes", "rejected": null}'), 1,
                   "missing_field: row has no 'rejected'"),
    "empty_string": (bad_line(2, '{"id": "b", "prompt": "", "chosen": "yes", "rejected": "no"}'), 2,
                     "empty_field: 'prompt' is an empty string"),
    "whitespace_string": (bad_line(2, '{"id": "b", "prompt": "why?", "chosen": " \\n\\t ", "rejected": "no"}'), 2,
                          "empty_field: 'chosen' is an empty string"),
    "invalid_utf8": (bad_line(3, b'{"id": "b", "prompt": "caf\xe9?", "chosen": "yes", "rejected": "no"}'), 3,
                     "bad_json: invalid UTF-8"),
    "truncated_last_line": (jsonl(*GOOD, '{"id": "b", "prompt": "why?", "chosen": "ye'), 5,
                            "bad_json: unparsable JSON"),
    "huge_single_row": (bad_line(2, json.dumps({"id": "b", "prompt": HUGE, "chosen": "yes", "rejected": "no"})), 2,
                        "prompt_too_long: prompt has"),
    "duplicate_id": (bad_line(4, '{"id": "r0001", "prompt": "why?", "chosen": "yes", "rejected": "no"}'), 4,
                     "duplicate_id: id 'r0001' already used at {file}, row 2"),
    "row_is_an_array": (bad_line(2, '["why?", "yes", "no"]'), 2, "bad_type: row is list, not an object"),
    "row_is_a_string": (bad_line(2, '"why? yes no"'), 2, "bad_type: row is str, not an object"),
    "lone_surrogate": (bad_line(2, '{"id": "b", "prompt": "why \\ud800?", "chosen": "yes", "rejected": "no"}'), 2,
                       "bad_text: 'prompt' is not valid Unicode text (lone surrogate '\\ud800' at character 4)"),
    "lone_surrogate_id": (bad_line(2, '{"id": "b\\udfff", "prompt": "why?", "chosen": "yes", "rejected": "no"}'), 2,
                          "bad_text: 'id' is not valid Unicode text"),
    "no_common_prompt": (bad_line(2, '{"id": "b", "chosen": "yes indeed", "rejected": "no way"}', IMPLICIT), 2,
                         "no_common_prompt: chosen and rejected share no common prefix"),
}
CONVERSATIONAL = {
    "wrong_message_role": (json.dumps({"id": "b", "prompt": [msg("robot", "hi")], "chosen": [msg("assistant", "a")],
                                       "rejected": [msg("assistant", "b")]}),
                           "bad_role: 'prompt'[0] has role 'robot'"),
    "completion_with_user_role": (json.dumps({"id": "b", "prompt": [msg("user", "hi")], "chosen": [msg("user", "a")],
                                              "rejected": [msg("assistant", "b")]}),
                                  "bad_role: 'chosen' completion must hold assistant messages only"),
    "message_without_content": (json.dumps({"id": "b", "prompt": [{"role": "user"}], "chosen": [msg("assistant", "a")],
                                            "rejected": [msg("assistant", "b")]}),
                                "bad_message: 'prompt'[0] is not a {'role', 'content'} message"),
    "message_content_not_text": (json.dumps({"id": "b", "prompt": [msg("user", ["hi"])],
                                             "chosen": [msg("assistant", "a")], "rejected": [msg("assistant", "b")]}),
                                 "bad_type: 'prompt'[0].content is list, not text"),
    "empty_message_list": (json.dumps({"id": "b", "prompt": [], "chosen": [msg("assistant", "a")],
                                       "rejected": [msg("assistant", "b")]}),
                           "empty_field: 'prompt' is an empty message list"),
    "mixed_formats": (json.dumps({"id": "b", "prompt": "hi", "chosen": [msg("assistant", "a")],
                                  "rejected": [msg("assistant", "b")]}),
                      "mixed_format: 'prompt' and the completions mix strings and message lists"),
}


def data_cases():
    for name, (content, row, reason) in STANDARD.items():
        yield name, "prefs.jsonl", content, row, reason
    for name, (line, reason) in CONVERSATIONAL.items():
        yield name, "prefs.jsonl", bad_line(2, line), 2, reason
    rows = [json.loads(g) for g in GOOD]
    yield ("json_array_bad_element", "prefs.json",
           json.dumps([rows[0], rows[1], {**rows[2], "chosen": 3}, rows[3]]).encode(), 3, "bad_type: 'chosen' is int")
    yield ("csv_missing_column", "prefs.csv", b"id,prompt,chosen\nb,why?,yes\n", 1,
           "missing_field: row has no 'rejected'")


DATA_CASES = list(data_cases())


def parquet_bytes(tmp: Path, table: pa.Table) -> bytes:
    pq.write_table(table, tmp / "t.parquet")
    return (tmp / "t.parquet").read_bytes()


@pytest.fixture(scope="module")
def models(tmp_path_factory, llama_dir) -> dict:
    """Checkpoint folders with one thing wrong each."""
    base = tmp_path_factory.mktemp("bad-models")
    m = {}

    def variant(name, edit):
        path = copy_tree(llama_dir, base / name)
        edit(path)
        m[name] = path

    variant("no_weights", lambda p: (p / "model.safetensors").unlink())

    def pickle_only(p):
        (p / "model.safetensors").unlink()
        torch.save({"lm_head.weight": torch.zeros(2, 2)}, p / "pytorch_model.bin")

    variant("pickle_only", pickle_only)

    def remote_code(p):
        config = json.loads((p / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
        (p / "config.json").write_text(json.dumps(config))
        (p / "modeling_custom.py").write_text(f"open({str(base / 'custom-code-ran')!r}, 'w').close()\n")

    variant("remote_code", remote_code)
    variant("no_config", lambda p: (p / "config.json").unlink())
    variant("config_not_json", lambda p: (p / "config.json").write_text('{"model_type": "llama",'))
    variant("no_tokenizer", lambda p: [(p / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")])

    def truncated_weights(p):
        data = (p / "model.safetensors").read_bytes()
        (p / "model.safetensors").write_bytes(data[: len(data) // 2])

    variant("truncated_weights", truncated_weights)

    def index_outside(p):  # the index is what transformers loads only without model.safetensors
        (p / "model.safetensors").unlink()
        (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}))

    variant("index_outside", index_outside)
    m["custom_code_ran"] = base / "custom-code-ran"
    return m


MODEL_CASES = {  # variant -> message parts ({model} is its path)
    "no_weights": ["{model}: no model.safetensors or model.safetensors.index.json, which is what transformers loads"],
    "pickle_only": ["{model}: only pickle weights (pytorch_model.bin); refcache loads safetensors only"],
    "remote_code": ["{model}: this model needs custom code from its folder (auto_map in config.json)",
                    "--trust-remote-code"],
    "no_config": ["{model}: not a Hugging Face checkpoint folder (no config.json)"],
    "config_not_json": ["{model}/config.json: not valid JSON"],
    "no_tokenizer": ["{model}: its tokenizer cannot be loaded"],
    "truncated_weights": ["{model}/model.safetensors: tensor", "points past the end of the file (truncated?)"],
    "index_outside": ["model.safetensors.index.json: weight file '../elsewhere.safetensors' is outside the checkpoint "
                      "folder"],
}


def assert_refused(result, parts, *, code=2):
    assert result.exit_code == code, result.output
    for part in parts:
        assert part in result.output, f"{part!r} not in\n{result.output}"
    assert_one_paragraph(result.output)


def usage_error(result, *parts):
    """click's usage errors: exit 2, 'Error:' and the option named, no traceback."""
    assert result.exit_code == 2, result.output
    assert "Error:" in result.output and "Traceback" not in result.output
    for part in parts:
        assert part in result.output, f"{part!r} not in\n{result.output}"


# ---------------------------------------------------------------------------------------------------------------
# precompute-ref


@pytest.mark.parametrize("case,name,content,row,reason", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_precompute_bad_data_names_file_row_and_reason(llama_dir, tmp_path, case, name, content, row, reason):
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "cache"
    result = precompute("--model", llama_dir, "--data", data, "--out", out)
    assert_refused(result, [f"error: {data}, row {row}: {reason.replace('{file}', str(data))}"])
    assert not (out / fmt.MANIFEST).exists()


FILE_CASES = {  # case -> (file name, content, message after "error: {path}")
    "empty_file": ("prefs.jsonl", b"", ": no rows"),
    "blank_lines_only": ("prefs.jsonl", b"\n  \n\n", ": no rows"),
    "unsupported_suffix": ("prefs.txt", jsonl(*GOOD), ": unsupported file type '.txt'; use .jsonl, .json, .parquet "
                                                      "or .csv"),
    "json_not_parseable": ("prefs.json", b'[{"prompt": "a", ', ": unparsable JSON"),
    "corrupt_parquet": ("prefs.parquet", b"PAR1" + b"\x00" * 64 + b"PAR1", ": could not be loaded"),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_precompute_unusable_data_file(llama_dir, tmp_path, case):
    name, content, reason = FILE_CASES[case]
    data = tmp_path / name
    data.write_bytes(content)
    result = precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "cache")
    assert_refused(result, [f"error: {data}{reason}"])


def test_precompute_parquet_with_wrong_column_types(llama_dir, tmp_path):
    data = tmp_path / "prefs.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["why?", "how?"], "chosen": [1, 2], "rejected": ["x", "y"]}),
                   data)
    assert_refused(precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "c"),
                   [f"error: {data}, row 1: bad_type: 'chosen' is int"])


def test_precompute_data_folder_without_data_files(llama_dir, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("nothing here")
    assert_refused(precompute("--model", llama_dir, "--data", tmp_path / "d", "--out", tmp_path / "c"),
                   [f"error: {tmp_path / 'd'}: no .jsonl, .json, .parquet or .csv files found"])


def test_precompute_saved_dataset_without_the_split(llama_dir, tmp_path):
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list(pref_rows(3))}).save_to_disk(str(tmp_path / "ds"))
    assert_refused(precompute("--model", llama_dir, "--data", tmp_path / "ds", "--out", tmp_path / "c"),
                   [f"error: {tmp_path / 'ds'}: no split 'train'; available: ['test']"])


def test_precompute_conversational_rows_with_chat_template_off(llama_dir, tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_bytes(jsonl(*CONV[:3]))
    assert_refused(precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "c", "--chat-template", "off"),
                   [f"error: {data}, row 1: needs_chat_template: conversational row but the encoding config has "
                    "chat_template=off"])


@pytest.mark.parametrize("variant", sorted(MODEL_CASES))
def test_precompute_bad_model_folder(models, tmp_path, variant):
    data = tmp_path / "prefs.jsonl"
    data.write_bytes(jsonl(*GOOD))
    out = tmp_path / "cache"
    result = precompute("--model", models[variant], "--data", data, "--out", out)
    assert_refused(result, [p.format(model=models[variant]) for p in MODEL_CASES[variant]])
    assert not out.exists()  # refused before the cache directory was made
    assert not models["custom_code_ran"].exists()


ARG_CASES = {  # case -> (arguments replacing or adding to the good ones, exit code, message parts)
    "out_is_a_file": ({"--out": "{tmp}/a-file"}, ["Invalid value for '--out'", "is a file"]),
    "max_length_1": (["--max-length", "1"], ["Invalid value for '--max-length'", "'1' is out of range; expected a whole number >= 2"]),
    "rows_per_shard_0": (["--rows-per-shard", "0"], ["Invalid value for '--rows-per-shard'"]),
    "token_budget_0": (["--token-budget", "0"], ["Invalid value for '--token-budget'"]),
    "truncation_mode_unknown": (["--truncation-mode", "middle"], ["Invalid value for '--truncation-mode'"]),
    "dtype_unknown": (["--dtype", "int8"], ["Invalid value for '--dtype'"]),
    "unknown_option": (["--bogus"], ["No such option '--bogus'"]),
    # checked where the options are read, before any model is loaded (issue 36)
    "attn_implementation_unknown": (["--attn-implementation", "bogus"],
                                    ["Invalid value for '--attn-implementation'",
                                     "'bogus' is not an attention implementation; use one of auto, eager, sdpa"]),
}
JOB_ARG_CASES = {  # refusals of ours (exit 2, "error: ...")
    # --model and --data may be hub ids, so a missing path is judged by the job, not by click
    "model_path_missing": ({"--model": "{tmp}/nowhere"}, ["error: --model {tmp}/nowhere: does not exist ({tmp} "
                                                          "holds: "]),
    "data_path_missing": ({"--data": "{tmp}/nowhere.jsonl"}, ["error: --data {tmp}/nowhere.jsonl: does not exist ({tmp} "
                                                              "holds: "]),
    "out_under_a_file": ({"--out": "{tmp}/a-file/cache"}, ["error: --out {tmp}/a-file/cache: cannot write the cache "
                                                           "directory there (Not a directory)"]),
    "device_unknown": (["--device", "tpu9"], ["error: --device tpu9: Invalid device string: 'tpu9'"]),
    "device_cuda_without_cuda": (["--device", "cuda"], ["error: --device cuda: CUDA is not available on this machine"]),
    "other_cache_in_out": ({"--out": "{cache}"}, ["already holds a different cache; to bring it to this data",
                                                   "pass --update; else use --overwrite to replace it"]),
}


def _args(base: dict, given, tmp: Path, cache: Path) -> list[str]:
    args = dict(base)
    extra = []
    if isinstance(given, dict):
        args.update({k: v.format(tmp=tmp, cache=cache) for k, v in given.items()})
    else:
        extra = list(given)
    return [str(a) for kv in args.items() for a in kv] + extra


@pytest.mark.parametrize("case", sorted(ARG_CASES) + sorted(JOB_ARG_CASES))
def test_precompute_bad_arguments(llama_dir, dpo_cache, tmp_path, case):
    if case == "device_cuda_without_cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    data = tmp_path / "prefs.jsonl"
    data.write_bytes(jsonl(*GOOD))
    (tmp_path / "a-file").write_text("x")
    cache = copy_tree(dpo_cache, tmp_path / "other-cache")
    before = sorted(p.name for p in cache.iterdir())
    given, parts = ARG_CASES.get(case) or JOB_ARG_CASES[case]
    base = {"--model": llama_dir, "--data": data, "--out": tmp_path / "cache"}
    result = precompute(*_args(base, given, tmp_path, cache))
    parts = [p.format(tmp=tmp_path, cache=cache) for p in parts]
    if case in ARG_CASES:
        usage_error(result, *parts)
    else:
        assert_refused(result, parts)
    assert not (tmp_path / "cache" / fmt.MANIFEST).exists()
    assert sorted(p.name for p in cache.iterdir()) == before


def test_precompute_debug_shows_the_traceback(llama_dir, tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_bytes(STANDARD["missing_key"][0])
    result = precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "c", "--debug")
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.output and "DataError" in result.output
    assert f"error: {data}, row 4: missing_field" in result.output


# ---------------------------------------------------------------------------------------------------------------
# train-dpo (against the session's conversational cache, so the data is encoded after the cache is verified)


def train_data_cases():
    for name, (line, reason) in CONVERSATIONAL.items():
        yield name, bad_line(6, line, CONV), 6, reason
    yield ("lone_surrogate", bad_line(6, CONVERSATIONAL["wrong_message_role"][0].replace('"robot", "content": "hi"',
                                                                                     '"user", "content": "hi \\ud800"'),
                                      CONV), 6, "bad_text: 'prompt'[0].content is not valid Unicode text")
    for name in ("wrong_type_int", "missing_key", "empty_string", "invalid_utf8", "row_is_an_array", "huge_single_row"):
        content, _, reason = STANDARD[name]
        line = [ln for ln in content.split(b"\n") if ln and ln.decode("utf-8", "replace") not in GOOD][0]
        yield name, bad_line(6, line, CONV), 6, reason
    yield "truncated_last_line", jsonl(*CONV, CONV[0][:30]), DPO_PAIRS + 1, "bad_json: unparsable JSON"
    yield ("duplicate_id", bad_line(6, CONV[1], CONV), 6, "duplicate_id: id 'r0001' already used at {file}, row 2")


TRAIN_DATA_CASES = list(train_data_cases())


@pytest.mark.parametrize("case,content,row,reason", TRAIN_DATA_CASES, ids=[c[0] for c in TRAIN_DATA_CASES])
def test_train_bad_data_names_file_row_and_reason(llama_dir, dpo_cache, tmp_path, case, content, row, reason):
    data = tmp_path / "prefs.jsonl"
    data.write_bytes(content)
    out = tmp_path / "out"
    result = train("--model", llama_dir, "--data", data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN)
    assert_refused(result, [f"error: {data}, row {row}: {reason.replace('{file}', str(data))}"])
    assert not out.exists()


@pytest.mark.parametrize("variant", sorted(MODEL_CASES))
def test_train_bad_model_folder(models, dpo_data, dpo_cache, tmp_path, variant):
    out = tmp_path / "out"
    result = train("--model", models[variant], "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out,
                   *TRAIN)
    assert_refused(result, [p.format(model=models[variant]) for p in MODEL_CASES[variant]])
    assert not out.exists() and not models["custom_code_ran"].exists()


TRAIN_ARG_CASES = {  # case -> (arguments replacing or adding to the good ones, usage error?, message parts)
    "model_missing": ({"--model": None}, True, ["missing --model"]),
    "output_dir_missing": ({"--output-dir": None}, True, ["missing --output-dir"]),
    "model_path_missing": ({"--model": "{tmp}/nowhere"}, False, ["error: --model {tmp}/nowhere: does not exist ({tmp} "
                                                                 "holds: "]),
    "data_path_missing": ({"--data": "{tmp}/nowhere.jsonl"}, False, ["error: --data {tmp}/nowhere.jsonl: does not exist "
                                                                     "({tmp} holds: "]),
    "data_unsupported_suffix": ({"--data": "{tmp}/prefs.txt"}, False, ["error: {tmp}/prefs.txt: unsupported file "
                                                                       "type '.txt'"]),
    "data_empty_file": ({"--data": "{tmp}/empty.jsonl"}, False, ["error: {tmp}/empty.jsonl: no rows"]),
    "ref_cache_missing": ({"--ref-cache": "{tmp}/no-cache"}, False, ["error: --ref-cache {tmp}/no-cache: does not "
                                                                     "exist ({tmp} holds: "]),
    "ref_cache_is_a_file": ({"--ref-cache": "{tmp}/a-file"}, False, ["error: --ref-cache {tmp}/a-file holds no cache "
                                                                     "(a file, not a folder)", "remedy:   pass the --out "
                                                                     "of a finished precompute-ref run"]),
    # an empty folder holds no cache: nothing there says a precompute-ref ever wrote it (issue 34, family 2)
    "ref_cache_without_manifest": ({"--ref-cache": "{tmp}/no-manifest"}, False,
                                   ["error: --ref-cache {tmp}/no-manifest holds no cache (it is empty)"]),
    "no_reference_at_all": ({"--ref-cache": None}, False, ["error: give --ref-cache DIR (the reference's log-probs, made "
                                                           "once with `precompute-ref --model ",
                                                           "--out REF_CACHE`, then --ref-cache REF_CACHE) or --ref-model "
                                                           "PATH (a live reference, loaded beside the policy)"]),
    "ref_model_hash_without_cache": ({"--ref-cache": None, "--ref-model": "{llama}", "--ref-model-hash": "0" * 64}, False,
                                     ["error: --ref-model-hash only declares which reference a --ref-cache must "
                                      "hold; add --ref-cache"]),
    "output_dir_under_a_file": ({"--output-dir": "{tmp}/a-file/out"}, False,
                                ["error: --output-dir {tmp}/a-file/out: {tmp}/a-file is a file, not a directory"]),
    "resume_checkpoint_missing": (["--resume-from-checkpoint", "{tmp}/checkpoint-9"], False,
                                  ["error: --resume-from-checkpoint {tmp}/checkpoint-9: no such directory"]),
    "resume_from_a_partial_checkpoint": (["--resume-from-checkpoint", "{tmp}/partial"], False,
                                         ["error: --resume-from-checkpoint {tmp}/partial: no trainer_state.json in it"]),
    "batch_size_0": (["--per-device-train-batch-size", "0"], True,
                     ["Invalid value for '--per-device-train-batch-size'", "'0' is out of range; expected a whole "
                      "number >= 1"]),
    # issue 34 family 3: numbers checked against their declared domain; an option the loss does not read refused
    "kl_coef_nan": (["--kl-coef", "nan"], True, ["Invalid value for '--kl-coef'", "'nan' is not finite"]),
    "tdpo_alpha_inf": (["--loss-type", "tdpo2", "--tdpo-alpha", "inf"], True,
                       ["Invalid value for '--tdpo-alpha'", "'inf' is not finite"]),
    "kl_coef_negative": (["--kl-coef", "-1"], True, ["Invalid value for '--kl-coef'", "'-1' is out of range"]),
    "tdpo_alpha_with_sigmoid": (["--tdpo-alpha", "0.9"], True, ["--tdpo-alpha 0.9: the sigmoid loss does not read it",
                                                                 "an option of tdpo2"]),
    "lora_r_without_peft": (["--lora-r", "8"], False, ["error: --lora-r only apply to a LoRA policy; add --use-peft"]),
    "lr_scheduler_unknown": (["--lr-scheduler-type", "sideways"], False, ["error: invalid training options:",
                                                                          "sideways"]),
    "learning_rate_not_a_number": (["--learning-rate", "fast"], True, ["Invalid value for '--learning-rate'"]),
    "loss_type_unknown": (["--loss-type", "magic"], True, ["Invalid value for '--loss-type'"]),
    "on_bad_row_unknown": (["--on-bad-row", "ignore"], True, ["Invalid value for '--on-bad-row'"]),
    "config_file_missing": (["--config", "{tmp}/nowhere.yaml"], True, ["--config {tmp}/nowhere.yaml: does not exist"]),
    "config_file_not_json": (["--config", "{tmp}/bad.json"], True, ["{tmp}/bad.json: not valid JSON"]),
    "config_file_not_yaml": (["--config", "{tmp}/bad.yaml"], True, ["{tmp}/bad.yaml: not valid YAML"]),
    "config_file_not_a_mapping": (["--config", "{tmp}/list.yaml"], True, ["{tmp}/list.yaml: expected a mapping"]),
    "config_file_unknown_key": (["--config", "{tmp}/unknown.yaml"], True, ["{tmp}/unknown.yaml: unknown option(s) "
                                                                           "betta"]),
    "max_length_conflict": (["--max-length", "99"], False, ["error: --max-length 99 conflicts with the cache"]),
    "eval_rows_not_cached": (["--eval-data", "{tmp}/eval.jsonl"], False, ["needs the reference log-probs of its rows: "
                                                                          "run `precompute-ref", "--eval-ref-cache"]),
    "eval_rows_not_in_eval_cache": (["--eval-data", "{tmp}/eval.jsonl", "--eval-ref-cache", "{cache}"], False,
                                    ["2 of 2 data rows are not in the cache"]),
}


@pytest.mark.parametrize("case", sorted(TRAIN_ARG_CASES))
def test_train_bad_arguments(llama_dir, dpo_data, dpo_cache, tmp_path, case):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "prefs.txt").write_text("x")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "partial").mkdir()
    (tmp_path / "no-manifest").mkdir()
    shutil.copy(llama_dir / "model.safetensors", tmp_path / "partial")  # weights saved, the rest never written
    (tmp_path / "bad.json").write_text('{"beta": 0.2,')
    (tmp_path / "bad.yaml").write_text("beta: [0.2\n")
    (tmp_path / "list.yaml").write_text("- beta\n- 0.2\n")
    (tmp_path / "unknown.yaml").write_text("betta: 0.2\n")
    (tmp_path / "eval.jsonl").write_bytes(jsonl(*[json.dumps(r) for r in pref_rows(2, seed=99, fmt="conversational")])
                                          .replace(b'"r000', b'"e000'))
    given, is_usage, parts = TRAIN_ARG_CASES[case]
    out = tmp_path / "out"
    args = {"--model": llama_dir, "--data": dpo_data, "--ref-cache": dpo_cache, "--output-dir": out}
    extra = []
    if isinstance(given, dict):
        for k, v in given.items():
            if v is None:
                args.pop(k)
            else:
                args[k] = v.format(tmp=tmp_path, llama=llama_dir)
    else:
        extra = [a.format(tmp=tmp_path, cache=dpo_cache) for a in given]
    result = train(*[str(a) for kv in args.items() for a in kv], *TRAIN, *extra)  # the case's values win
    parts = [p.format(tmp=tmp_path) for p in parts]
    if is_usage:
        usage_error(result, *parts)
    else:
        assert_refused(result, parts)
    assert not out.exists()


def test_train_debug_shows_the_traceback(llama_dir, dpo_cache, tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_bytes(bad_line(6, CONVERSATIONAL["wrong_message_role"][0], CONV))
    result = train("--model", llama_dir, "--data", data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "o",
                   *TRAIN, "--debug")
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.output and f"error: {data}, row 6: bad_role" in result.output


# ---------------------------------------------------------------------------------------------------------------
# audit-ref


def manifest_damage(kind):
    def damage(cache: Path):
        path = cache / fmt.MANIFEST
        if kind == "missing":
            path.unlink()
        elif kind == "not_json":
            path.write_text("{not json")
        elif kind == "not_utf8":
            path.write_bytes(b'{"format_version": 1, "x": "\xff"}')
        elif kind == "a_list":
            path.write_text("[1, 2]")
        elif kind == "future_version":
            # as a newer refcache writes it: a newer format and that release named as the writer
            path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 7,
                                        "software": {"refcache": "99.0"}}))
        elif kind == "no_stamps":
            m = json.loads(path.read_text())
            del m["stamps"]
            path.write_text(json.dumps(m))
        elif kind == "bad_encoding":
            m = json.loads(path.read_text())
            m["encoding"]["max_length"] = 1
            path.write_text(json.dumps(m))
    return damage


AUDIT_CASES = {  # case -> (damage to the cache copy or None, arguments, usage error?, message parts)
    "cache_path_missing": (None, ["{tmp}/nowhere"], True, ["CACHE {tmp}/nowhere: does not exist"]),
    "cache_path_is_a_file": (None, ["{tmp}/a-file"], True, ["Invalid value for 'CACHE'", "is a file"]),
    "manifest_missing": (manifest_damage("missing"), ["{cache}"], False, ["error: {cache} has no manifest.json"]),
    "manifest_not_json": (manifest_damage("not_json"), ["{cache}"], False, ["manifest.json is not valid JSON"]),
    "manifest_not_utf8": (manifest_damage("not_utf8"), ["{cache}"], False, ["manifest.json is not valid JSON"]),
    "manifest_a_list": (manifest_damage("a_list"), ["{cache}"], False, ["manifest.json has no integer "
                                                                       "format_version"]),
    "manifest_future_version": (manifest_damage("future_version"), ["{cache}"], False,
                                ["has format version 7; this refcache reads version 1", "upgrade refcache"]),
    "manifest_without_stamps": (manifest_damage("no_stamps"), ["{cache}"], False,
                                ["manifest.json: 'stamps' is missing or malformed"]),
    "manifest_bad_encoding": (manifest_damage("bad_encoding"), ["{cache}"], False,
                              ["manifest.json: bad encoding config (encoding 'max_length' is 1, not a value precompute-ref writes"]),
    "data_without_model": (None, ["{cache}", "--data", "{data}"], True, ["--data needs --model"]),
    "sample_and_all": (None, ["{cache}", "--sample", "3", "--all"], True, ["give --sample N or --all, not both"]),
    "tolerance_0": (None, ["{cache}", "--tolerance", "0"], True, ["Invalid value for '--tolerance'"]),
    "sample_negative": (None, ["{cache}", "--sample", "-1"], True, ["Invalid value for '--sample'"]),
    "model_path_missing": (None, ["{cache}", "--model", "{tmp}/nowhere"], True, ["Invalid value for '--model'"]),
    "data_path_missing": (None, ["{cache}", "--model", "{llama}", "--data", "{tmp}/nowhere.jsonl"], True,
                          ["Invalid value for '--data'"]),
    "data_unsupported_suffix": (None, ["{cache}", "--model", "{llama}", "--sample", "0", "--data", "{tmp}/prefs.txt"],
                                False, ["error: {tmp}/prefs.txt: unsupported file type '.txt'"]),
    "data_empty_file": (None, ["{cache}", "--model", "{llama}", "--sample", "0", "--data", "{tmp}/empty.jsonl"], False,
                        ["error: {tmp}/empty.jsonl: no rows"]),
    "run_without_run_manifest": (None, ["{cache}", "--run", "{tmp}"], True, ["run-manifest.json is missing or not a "
                                                                            "train-dpo run manifest"]),
    "unknown_option": (None, ["{cache}", "--bogus"], True, ["No such option '--bogus'"]),
}
AUDIT_MODEL_CASES = ["no_weights", "pickle_only", "remote_code", "config_not_json", "no_tokenizer", "truncated_weights"]


@pytest.mark.parametrize("case", sorted(AUDIT_CASES) + [f"model_{v}" for v in AUDIT_MODEL_CASES])
def test_audit_bad_input(llama_dir, dpo_data, dpo_cache, models, tmp_path, case):
    cache = copy_tree(dpo_cache, tmp_path / "cache")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "prefs.txt").write_text("x")
    (tmp_path / "empty.jsonl").write_text("")
    if case.startswith("model_") and case[len("model_"):] in AUDIT_MODEL_CASES:
        variant = case[len("model_"):]
        damage, args, is_usage = None, ["{cache}", "--model", str(models[variant])], False
        parts = [p.format(model=models[variant]) for p in MODEL_CASES[variant]]
    else:
        damage, args, is_usage, parts = AUDIT_CASES[case]
    if damage:
        damage(cache)
    fill = {"tmp": tmp_path, "cache": cache, "data": dpo_data, "llama": llama_dir}
    from faultkit import invoke
    from audit.cli import main

    result = invoke(main, [a.format(**fill) for a in args])
    parts = [p.format(**fill) for p in parts]
    if is_usage:
        usage_error(result, *parts)
    else:
        assert_refused(result, parts)


def test_audit_json_into_a_missing_folder(dpo_cache, tmp_path):
    from faultkit import invoke
    from audit.cli import main

    target = tmp_path / "no-such-folder" / "report.json"
    result = invoke(main, [dpo_cache, "--json", target])
    assert (result.exit_code == 0 and target.exists()) or (result.exit_code == 2 and str(target) in result.output), \
        result.output
