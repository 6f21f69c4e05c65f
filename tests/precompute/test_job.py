"""precompute-ref in process (click's CliRunner), the job end to end (precompute/job.py): numbers against a plain
forward, bad input, RNG hygiene. Data formats and containers: tests/runtime/test_data.py; resume and refusals of
another job: test_resume.py; real subprocesses and --help: test_cli.py."""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import shutil

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import assert_not_valid, dir_state, manifest_of, pref_rows, read_cache, write_jsonl
from conftest import precompute_cli as cli, precompute_ok as ok
from schemas import format as fmt
from schemas.cache import open_cache

# ---------------------------------------------------------------------------------------------------------------
# 1. the cached numbers equal an independent plain forward


@pytest.mark.parametrize(
    "model_fixture, data_format, max_length",
    [("llama_dir", "conversational", 1024), ("gpt2_dir", "standard", 48)],  # gpt2: char-level, completions truncated
)
def test_cached_logps_equal_plain_transformers_forward(request, tmp_path, model_fixture, data_format, max_length):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = request.getfixturevalue(model_fixture)
    rows = pref_rows(20, seed=3, fmt=data_format)
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    out = tmp_path / "cache"
    # Small shards and a small token budget: several length-sorted, right-padded batches in every shard.
    result = ok("--model", model_dir, "--data", data, "--out", out, "--rows-per-shard", 6, "--token-budget", 150,
                "--max-length", max_length)
    assert float(re.search(r"padding: ([\d.]+)%", result.output).group(1)) > 0  # the padded path was exercised
    manifest = manifest_of(out)
    assert [s["rows"] for s in manifest["shards"]] == [6, 6, 6, 2]
    comp = manifest["computation"]
    assert comp["dtype"] == "float32" and comp["device_type"] == "cpu"
    assert comp["mode"] in ("full_forward", "kv_cache", "packed", "shared_prompt", "single")  # never "auto"
    assert comp["head"] == "hook"  # plain projection heads: verified against the model's own logits
    assert comp["attn_implementation"] == "sdpa"  # what transformers picks for these models, actually loaded

    schema = pq.read_schema(out / manifest["shards"][0]["file"])
    assert schema.field("chosen_logps").type == pa.list_(pa.float32())
    assert schema.field("chosen_logp").type == pa.float64()
    df = read_cache(out)
    assert df["id"].to_list() == [r["id"] for r in rows]  # input order, whatever the batching order

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    plain = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    truncated = 0
    for row, rec in zip(rows, df.iter_rows(named=True)):
        prompt = rec["prompt_input_ids"]
        # The ids belong to this row (checked against the tokenizer directly, not through the encoder).
        # BOS as the tokenizer and the template give it: this tokenizer adds none, the template renders none
        if data_format == "standard":
            assert prompt == tok(row["prompt"])["input_ids"] == plain(row["prompt"])
        else:
            assert tok.decode(prompt) == f"<|user|>\n{row['prompt'][0]['content']}</s>\n<|assistant|>\n"
        for side in ("chosen", "rejected"):
            comp = rec[f"{side}_input_ids"]
            if data_format == "standard":
                full = plain(row[side]) + [eos]
                assert comp == full[: max_length - len(prompt)]
                truncated += len(comp) < len(full)
            else:
                assert tok.decode(comp) == row[side][0]["content"] + "</s>"
            logps = np.asarray(rec[f"{side}_logps"], dtype=np.float32)
            assert len(logps) == len(comp) > 0
            with torch.no_grad():  # one unpadded row, full log-softmax
                lp = model(torch.tensor([prompt + comp])).logits.float().log_softmax(-1)[0]
            p = len(prompt)
            expected = lp[torch.arange(p - 1, p - 1 + len(comp)), torch.tensor(comp)].numpy()
            np.testing.assert_allclose(logps, expected, rtol=0, atol=1e-5)
            assert np.all(logps < 0)
            total = math.fsum(float(x) for x in logps)  # float64 sum of the stored float32 values
            assert rec[f"{side}_logp"] == pytest.approx(total, rel=1e-12, abs=1e-9)
    if data_format == "standard":
        assert truncated > 0  # keep_start truncation happened and was scored over the kept tokens only


# ---------------------------------------------------------------------------------------------------------------
# 2. bad input


LONG_PROMPT = " ".join(["question"] * 50) + "?"
BAD_ROWS = {  # case -> (JSON Lines line, reason key)
    "missing_field": ('{"id": "bad-missing", "prompt": "why?", "chosen": "sure yes"}', "missing_field"),
    "mistyped": ('{"id": "bad-int", "prompt": "why?", "chosen": 5, "rejected": "hmm no"}', "bad_type"),
    "empty_completion": ('{"id": "bad-empty", "prompt": "why?", "chosen": "", "rejected": "hmm no"}', "empty_field"),
    "blank_completion": ('{"id": "bad-blank", "prompt": "why?", "chosen": "sure", "rejected": "  "}', "empty_field"),
    "unparsable_json": ('{"id": "bad-json", "prompt": "why?", "chosen": "sure"', "bad_json"),
    "non_text_list": ('{"id": "bad-list", "prompt": "why?", "chosen": "sure", "rejected": [1, 2]}', "bad_message"),
    "non_text_bool": ('{"id": "bad-bool", "prompt": true, "chosen": "sure", "rejected": "hmm"}', "bad_type"),
    "prompt_too_long": (json.dumps({"id": "bad-long", "prompt": LONG_PROMPT, "chosen": "sure", "rejected": "hmm"}),
                        "prompt_too_long"),
    "duplicate_id": ('{"id": "r0001", "prompt": "why?", "chosen": "sure yes", "rejected": "hmm no"}', "duplicate_id"),
}
GOOD = [json.dumps(r) for r in pref_rows(6, seed=17)]  # ids r0000..r0005; all fit in --max-length 40


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_stops_the_run_naming_file_row_and_reason(llama_dir, tmp_path, case):
    line, reason = BAD_ROWS[case]
    # The bad row is on line 5: a blank line 2 must not shift the row number.
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join([GOOD[0], "", GOOD[1], GOOD[2], line, *GOOD[3:]]) + "\n")
    out = tmp_path / "cache"
    result = cli("--model", llama_dir, "--data", data, "--out", out, "--max-length", 40)
    assert result.exit_code == 2, result.output
    assert f"error: {data}, row 5: {reason}" in result.output
    assert_not_valid(out)


def test_missing_column_names_the_column(llama_dir, tmp_path):
    rows = [{"id": r["id"], "prompt": r["prompt"], "chosen": r["chosen"], "rejectd": r["rejected"]}
            for r in pref_rows(5)]
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    result = cli("--model", llama_dir, "--data", data, "--out", tmp_path / "cache")
    assert result.exit_code == 2
    assert f"{data}, row 1: missing_field: row has no 'rejected'" in result.output and "rejectd" in result.output
    assert not (tmp_path / "cache" / fmt.MANIFEST).exists()


def test_skip_bad_rows_lists_and_counts_them(llama_dir, tmp_path):
    identical = json.dumps({"id": "same", "prompt": "why?", "chosen": "sure yes", "rejected": "sure yes"})
    d = tmp_path / "prefs"
    d.mkdir()
    a, b = d / "train-a.jsonl", d / "train-b.jsonl"
    # File a loads through `datasets`; file b holds an unparsable line and is read line by line.
    lines_a = [GOOD[0], "", GOOD[1]] + [BAD_ROWS[c][0] for c in (
        "missing_field", "mistyped", "empty_completion", "blank_completion", "non_text_list", "non_text_bool",
        "prompt_too_long")] + [identical, GOOD[2]]
    lines_b = [GOOD[3], BAD_ROWS["unparsable_json"][0], BAD_ROWS["duplicate_id"][0], GOOD[4], "", GOOD[5]]
    a.write_text("\n".join(lines_a) + "\n")
    b.write_text("\n".join(lines_b) + "\n")
    out = tmp_path / "cache"
    result = ok("--model", llama_dir, "--data", d, "--out", out, "--max-length", 40, "--on-bad-row", "skip")
    assert "skipped 9 bad rows" in result.output
    assert "warning: 1 pairs have identical chosen and rejected completions" in result.output

    expected = [
        (str(a), 4, "bad-missing", "missing_field"), (str(a), 5, "bad-int", "bad_type"),
        (str(a), 6, "bad-empty", "empty_field"), (str(a), 7, "bad-blank", "empty_field"),
        (str(a), 8, "bad-list", "bad_message"), (str(a), 9, "bad-bool", "bad_type"),
        (str(a), 10, "bad-long", "prompt_too_long"),
        (str(b), 2, None, "bad_json"), (str(b), 3, "r0001", "duplicate_id"),
    ]
    listed = [json.loads(line) for line in (out / fmt.SKIPPED).read_text().splitlines()]
    assert [(s["file"], s["row"], s["id"], s["reason"]) for s in listed] == expected
    assert all(s["detail"] for s in listed)
    source = manifest_of(out)["source"]
    assert source["skipped_by_reason"] == {"bad_json": 1, "bad_message": 1, "bad_type": 2, "duplicate_id": 1,
                                           "empty_field": 2, "missing_field": 1, "prompt_too_long": 1}
    assert source["skipped"] == 9 and source["identical_pairs"] == 1 and source["rows_in"] == 16
    cache = open_cache(out)
    ids = cache.index.column("id").to_pylist()
    assert ids == ["r0000", "r0001", "same", "r0002", "r0003", "r0004", "r0005"]
    same = read_cache(out).filter(pl.col("id") == "same").row(0, named=True)
    np.testing.assert_allclose(same["chosen_logps"], same["rejected_logps"], rtol=0, atol=1e-6)

    # A rerun without bad rows removes the stale skipped.jsonl.
    clean = write_jsonl(tmp_path / "clean.jsonl", [json.loads(g) for g in GOOD])
    ok("--model", llama_dir, "--data", clean, "--out", out, "--max-length", 40, "--overwrite")
    assert not (out / fmt.SKIPPED).exists() and manifest_of(out)["source"]["skipped_by_reason"] == {}


def test_pickle_only_checkpoint_is_refused(llama_dir, tmp_path):
    model = tmp_path / "pickled"
    model.mkdir()
    for f in llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, model)
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, model / "pytorch_model.bin")
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(4))
    result = cli("--model", model, "--data", data, "--out", tmp_path / "cache")
    assert result.exit_code == 2, result.output
    assert "pytorch_model.bin" in result.output and "safetensors only" in result.output
    assert not (tmp_path / "cache").exists()


def test_remote_code_checkpoint_needs_trust_remote_code(llama_dir, tmp_path):
    model = tmp_path / "custom"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    ran = tmp_path / "custom-code-ran"
    (model / "modeling_custom.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(4))
    result = cli("--model", model, "--data", data, "--out", tmp_path / "cache")
    assert result.exit_code == 2, result.output
    assert "auto_map" in result.output and "--trust-remote-code" in result.output
    assert not ran.exists() and not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------------------------------------------
# 3. the caller's RNG and the model are left alone


def rng_snapshot():
    np_state = np.random.get_state()
    return random.getstate(), (np_state[0], np_state[1].tobytes(), *np_state[2:]), torch.get_rng_state().clone()


def assert_same_rng(a, b):
    assert a[0] == b[0], "python random state changed"
    assert a[1] == b[1], "numpy random state changed"
    assert torch.equal(a[2], b[2]), "torch random state changed"


def test_run_precompute_leaves_global_rng_and_checkpoint_unchanged(llama_dir, tmp_path, monkeypatch):
    from precompute import job
    from runtime.checkpoint import Checkpoint
    from schemas.stamps import model_hash

    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(10, seed=19))
    checkpoint, hash_before = dir_state(llama_dir), model_hash(llama_dir)
    real_load = Checkpoint.load_model

    def load_drawing_random_numbers(*args, **kwargs):  # as a random init or dropout in the reference would
        random.random(), np.random.rand(), torch.rand(3)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(Checkpoint, "load_model", load_drawing_random_numbers)
    cfg = lambda out: job.PrecomputeConfig(model=str(llama_dir), data=str(data), out=str(out), progress=False)

    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = rng_snapshot()
    summary = job.run_precompute(cfg(tmp_path / "a"), log=lambda m: None)
    assert summary["rows_scored"] == 10
    assert_same_rng(rng_snapshot(), before)
    assert dir_state(llama_dir) == checkpoint and model_hash(llama_dir) == hash_before

    # Control: with the guard made a no-op, the same job moves every generator, so the check above can fail.
    monkeypatch.setattr(job, "preserved_rng", contextlib.nullcontext)
    job.run_precompute(cfg(tmp_path / "b"), log=lambda m: None)
    after = rng_snapshot()
    assert after[0] != before[0] and after[1] != before[1] and not torch.equal(after[2], before[2])


def test_scoring_leaves_the_model_parameters_unchanged(llama_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from runtime.data import Source, encode_rows
    from precompute.modes import score_pairs
    from schemas.encoding import EncodingConfig

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.train()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rows = pref_rows(6, seed=23)
    encoded = encode_rows(Source(rows, [("x", i) for i in range(6)], ["x"]), tokenizer, EncodingConfig())
    chosen, rejected, _ = score_pairs(model, encoded.pairs, tokenizer.pad_token_id, token_budget=64)
    assert len(chosen) == len(rejected) == 6
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert torch.is_grad_enabled()
