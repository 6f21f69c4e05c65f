"""dpo/verify.py: train-dpo refuses a cache that does not match what it would train on: one case per stamp, each with
its own message naming the difference and exit code 2, before any model is built or anything is written to the
output directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import CHAT_TEMPLATE, DPO_PAIRS, REPO, pref_rows, write_jsonl
from dpo.cli import main
from schemas.stamps import model_hash

TRAIN = ["--use-cpu", "--max-steps", "1", "--per-device-train-batch-size", "4", "--learning-rate", "1e-3",
         "--logging-steps", "1", "--no-plot"]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def change_one_weight(model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += torch.tensor(0.01, dtype=tensors[name].dtype)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def variants(tmp_path_factory, llama_dir, dpo_data, dpo_cache) -> dict[str, Path]:
    """Everything the refusal cases need, built once: each differs from the cached setup in one respect."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("refusal-variants")
    v = {}

    v["other_tokenizer"] = copy_model(llama_dir, root / "other-tokenizer")
    tok = AutoTokenizer.from_pretrained(v["other_tokenizer"])
    assert tok.add_tokens(["<extra>"]) == 1
    tok.save_pretrained(v["other_tokenizer"])

    v["other_template"] = copy_model(llama_dir, root / "other-template")
    tok = AutoTokenizer.from_pretrained(v["other_template"])
    tok.chat_template = CHAT_TEMPLATE.replace("|>\n", "|>: ")
    tok.save_pretrained(v["other_template"])

    v["other_weights"] = copy_model(llama_dir, root / "other-weights")
    change_one_weight(v["other_weights"])
    assert model_hash(v["other_weights"]) != model_hash(llama_dir)
    for name in ("other_tokenizer", "other_template"):  # only the tokenizer differs in those
        assert model_hash(v[name]) == model_hash(llama_dir)

    v["edited_shard"] = root / "edited-shard-cache"
    shutil.copytree(dpo_cache, v["edited_shard"])
    shard = v["edited_shard"] / "shard-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    rows = pref_rows(DPO_PAIRS, fmt="conversational")
    rows[7]["chosen"][0]["content"] += " edited"
    v["edited_data"] = write_jsonl(root / "edited" / "prefs.jsonl", rows)
    v["more_data"] = write_jsonl(root / "more" / "prefs.jsonl", pref_rows(DPO_PAIRS + 4, fmt="conversational"))
    return v


# (case id, extra arguments given the variants, substrings the message must hold given the variants)
CASES = [
    ("tokenizer", lambda v: ["--model", v["other_tokenizer"]],
     lambda v: ["tokenizer_hash mismatch", "not computed with this tokenizer"]),
    ("chat_template", lambda v: ["--model", v["other_template"]],
     lambda v: ["tokenizer_hash mismatch", "including its chat template"]),
    ("max_length", lambda v: ["--max-length", "64"],
     lambda v: ["--max-length 64 conflicts with the cache", "made with --max-length 1024"]),
    ("weights", lambda v: ["--model", v["other_weights"]],
     lambda v: ["model_hash mismatch", "not computed with this model", "this run:  " + model_hash(v["other_weights"])]),
    ("shard_hash", lambda v: ["--ref-cache", v["edited_shard"]],
     lambda v: ["shard shard-00001.parquet content differs from the manifest (file sha256)"]),
    ("mask_checksum", lambda v: ["--data", v["edited_data"]],
     lambda v: ["mask checksum mismatch for row 'r0007'", "where:    shard shard-00000.parquet, row 7"]),
    ("rows_missing", lambda v: ["--data", v["more_data"]],
     lambda v: ["4 of 44 data rows are not in the cache", "first ids: 'r0040', 'r0041', 'r0042', 'r0043'", "--update"]),
    ("ref_model_hash", lambda v: ["--ref-model-hash", "0" * 64],
     lambda v: ["model_hash mismatch", "this run:  " + "0" * 64]),
    ("ref_model", lambda v: ["--ref-model", v["other_weights"]],
     lambda v: ["model_hash mismatch", "this run:  " + model_hash(v["other_weights"])]),
]


def _args(llama_dir, dpo_data, dpo_cache, out, extra) -> list[str]:
    base = {"--model": llama_dir, "--data": dpo_data, "--ref-cache": dpo_cache, "--output-dir": out}
    extra = [str(a) for a in extra]
    for flag in list(base):
        if flag in extra:  # the case replaces this one
            i = extra.index(flag)
            base[flag] = extra.pop(i + 1)
            extra.pop(i)
    return [str(a) for kv in base.items() for a in kv] + extra + TRAIN


@pytest.mark.parametrize("case,extra,expected", CASES, ids=[c[0] for c in CASES])
def test_stamp_mismatch_refuses_with_exit_2(tmp_path, llama_dir, dpo_data, dpo_cache, variants, case, extra,
                                            expected, monkeypatch):
    import transformers

    def no_models(*args, **kwargs):
        raise AssertionError("a model was built before the refusal")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", no_models)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, _args(llama_dir, dpo_data, dpo_cache, out, extra(variants)))
    assert result.exit_code == 2, result.output
    assert "error:" in result.output
    for text in expected(variants):
        assert text in result.output, f"{case}: {text!r} not in\n{result.output}"
    assert "remedy:" in result.output
    assert not out.exists()  # refused before any training: no output directory, no checkpoint


def test_each_refusal_has_its_own_message(tmp_path, llama_dir, dpo_data, dpo_cache, variants):
    """Distinct causes do not share one generic message (tokenizer and chat template share a stamp; its message names
    the differing parts, so they differ too)."""
    first_lines = {}
    for case, extra, _ in CASES:
        out = tmp_path / case
        result = CliRunner().invoke(main, _args(llama_dir, dpo_data, dpo_cache, out, extra(variants)))
        assert result.exit_code == 2
        message = next(line for line in result.output.splitlines() if line.startswith("error:"))
        first_lines[case] = message.replace(str(dpo_cache), "CACHE").replace(str(variants["edited_shard"]), "CACHE")
    groups = {}
    for case, line in first_lines.items():
        groups.setdefault(line, []).append(case)
    shared = sorted(sorted(cases) for cases in groups.values() if len(cases) > 1)
    assert shared == [["ref_model", "ref_model_hash", "weights"]], first_lines
    assert first_lines["chat_template"].endswith("it differs in: chat_template")


def test_ref_model_is_hashed_not_loaded_and_the_right_one_is_accepted(tmp_path, llama_dir, dpo_data, dpo_cache,
                                                                     variants):
    """A policy starting elsewhere trains against the cache when --ref-model names the cache's reference; the
    reference is only hashed (one model built: the policy)."""
    import transformers

    built = []
    original = transformers.PreTrainedModel.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.PreTrainedModel, "__init__", counting)
        result = CliRunner().invoke(main, _args(variants["other_weights"], dpo_data, dpo_cache, out,
                                                ["--ref-model", llama_dir]))
    assert result.exit_code == 0, result.output
    assert sorted(built) == ["LlamaForCausalLM", "LlamaModel"]
    manifest = json.loads((out / "run-manifest.json").read_text())
    assert manifest["initial_model"]["model_hash"] == model_hash(variants["other_weights"])
    assert manifest["reference"]["cache"]["stamps"]["model_hash"] == model_hash(llama_dir)
    # The policy is not the reference here, so the first step's log-ratios are not zero.
    first = next(json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in l)
    assert first["logratio/chosen"] != 0


def test_refusal_exit_code_of_the_installed_command(tmp_path, llama_dir, dpo_data, dpo_cache):
    """The real console script, in its own process: exit status 2 and the message on stderr."""
    out = tmp_path / "out"
    exe = Path(sys.executable).parent / "train-dpo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [str(exe), *_args(llama_dir, dpo_data, dpo_cache, out, ["--ref-model-hash", "f" * 64])],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "model_hash mismatch" in proc.stderr and "f" * 64 in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# issue 16 (what a TRL user expects), item 11: mismatch messages say what differs


def test_tokenizer_mismatch_names_the_differing_parts(llama_dir, dpo_cache, dpo_data):
    from transformers import AutoTokenizer

    from dpo.verify import verify_and_join
    from schemas.format import StampMismatch

    tok = AutoTokenizer.from_pretrained(llama_dir)
    tok.chat_template = tok.chat_template.replace("|>\n", "|>: ")
    with pytest.raises(StampMismatch, match=r"it differs in: chat_template\n") as e:
        verify_and_join(tokenizer=tok, model_dir=str(llama_dir), data=str(dpo_data), split="train",
                        cache_dir=str(dpo_cache), log=lambda m: None)
    assert "it differs in: chat_template" in str(e.value).splitlines()[0]


def test_conversational_cache_with_standard_data_says_the_template_differs(tmp_path, llama_dir, dpo_cache):
    from transformers import AutoTokenizer

    from dpo.verify import verify_and_join

    standard = write_jsonl(tmp_path / "std.jsonl", pref_rows(40, fmt="standard"))  # same ids r0000.., no template
    with pytest.raises(Exception, match="chat-template rendering differs"):
        verify_and_join(tokenizer=AutoTokenizer.from_pretrained(llama_dir), model_dir=str(llama_dir),
                        data=str(standard), split="train", cache_dir=str(dpo_cache), log=lambda m: None)


def test_eval_cache_given_as_ref_cache_says_so(tmp_path, llama_dir):
    from transformers import AutoTokenizer

    from dpo.verify import verify_and_join
    from precompute.job import PrecomputeConfig, run_precompute

    write_jsonl(tmp_path / "d" / "train.jsonl", pref_rows(6))
    write_jsonl(tmp_path / "d" / "eval.jsonl", pref_rows(4, seed=3))
    run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(tmp_path / "d"), split="test",
                                    out=str(tmp_path / "eval-cache"), progress=False), log=lambda m: None)
    with pytest.raises(Exception, match=r"(?s)the cache holds split 'test' \(the eval split's cache\).*--eval-ref-cache") as e:
        verify_and_join(tokenizer=AutoTokenizer.from_pretrained(llama_dir), model_dir=str(llama_dir),
                        data=str(tmp_path / "d"), split="train", cache_dir=str(tmp_path / "eval-cache"),
                        log=lambda m: None)
    # issue 25 item 11: one remedy, this one; not also "re-run precompute-ref over the full data", which contradicts it
    assert e.value.remedy == ("pass it as --eval-ref-cache, and the cache of split 'train' as --ref-cache "
                              "(precompute-ref --split train makes one)")
    assert str(e.value).count("remedy") == 1 and "full data" not in str(e.value)
    # the train split's cache given as --eval-ref-cache (closing UX pass: was told to pass it as --ref-cache)
    run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(tmp_path / "d"), out=str(tmp_path / "train-cache"),
                                    progress=False), log=lambda m: None)
    with pytest.raises(Exception, match=r"the cache holds split 'train', not 'test'") as e:
        verify_and_join(tokenizer=AutoTokenizer.from_pretrained(llama_dir), model_dir=str(llama_dir),
                        data=str(tmp_path / "d"), split="test", cache_dir=str(tmp_path / "train-cache"),
                        cache_option="--eval-ref-cache", log=lambda m: None)
    assert e.value.remedy == (f"make one with `precompute-ref --model {llama_dir} --data {tmp_path / 'd'} --split test "
                              "--out EVAL_CACHE`, then pass --eval-ref-cache EVAL_CACHE")


# ---------------------------------------------------------------------------------------------------------------
# a live reference: rows encoded, nothing verified, and the type says so


def test_live_rows_are_encoded_not_verified(llama_dir, dpo_data, dpo_cache):
    from transformers import AutoTokenizer

    from dpo.verify import EncodedOnly, Verified, encode_only, verify_and_join
    from schemas.encoding import EncodingConfig

    tok = AutoTokenizer.from_pretrained(llama_dir)
    live = encode_only(tokenizer=tok, data=str(dpo_data), split="train", encoding=EncodingConfig())
    assert isinstance(live, EncodedOnly) and not isinstance(live, Verified)
    assert live.report == {"rows": live.table.num_rows, "mode": "live reference"} and live.table.num_rows > 0
    assert not any(name.startswith("ref_") for name in live.table.column_names)  # no reference values to trust
    cached = verify_and_join(tokenizer=tok, model_dir=str(llama_dir), data=str(dpo_data), split="train",
                             cache_dir=str(dpo_cache), log=lambda m: None)
    assert isinstance(cached, Verified) and "stamps" in cached.report
    assert cached.table.select(["id", "prompt_ids", "chosen_ids", "rejected_ids"]).equals(live.table)  # same rows


def test_a_top_k_cache_is_held_to_the_top_k_rules_before_training(tmp_path):
    """train-dpo runs the top-k rules of the rule book (schemas/rules.py top_k_findings, audit-ref's) in its one
    scan: a top-k id outside the vocabulary, written through the writer with every checksum made to match, is
    refused before any training; the clean cache verifies."""
    from conftest import DATA, precompute_in_process, rewrite_top_k_shard
    from dpo.verify import verify_and_join
    from runtime.checkpoint import load_tokenizer
    from schemas.cache import CacheError

    model, data = DATA / "sft-model", write_jsonl(tmp_path / "prefs.jsonl", pref_rows(6))
    cache = precompute_in_process(model, data, tmp_path / "cache", top_k=4)
    tokenizer = load_tokenizer(str(model))
    verify = lambda: verify_and_join(tokenizer=tokenizer, model_dir=str(model), data=str(data), split="train",
                                     cache_dir=str(cache), log=lambda m: None)
    assert verify().table.column("ref_chosen_top_ids").to_pylist()[0][0].__len__() == 4
    manifest = json.loads((cache / "manifest.json").read_text())

    def out_of_range(rows):
        rows[1]["chosen_top_ids"][0][3] = len(tokenizer) + 7

    rewrite_top_k_shard(cache, manifest["shards"][0]["file"], out_of_range)
    with pytest.raises(CacheError, match=r"top-k columns of row .* are inconsistent.*top_k_ids"):
        verify()


def test_the_run_manifest_names_the_verified_cache_by_its_absolute_path(tmp_path, monkeypatch, llama_dir, dpo_data,
                                                                        dpo_cache):
    """Issue 36 item 3: --ref-cache given relative (as typed in the cache's parent folder), the run manifest's
    reference.verification.cache is the cache's absolute path, like every other place the manifest names."""
    shutil.copytree(dpo_cache, tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["--model", str(llama_dir), "--data", str(dpo_data), "--ref-cache", "cache",
                                       "--output-dir", "run", *TRAIN], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    reference = json.loads((tmp_path / "run" / "run-manifest.json").read_text())["reference"]
    assert reference["verification"]["cache"] == str(tmp_path / "cache") == reference["cache"]["path"]


def test_an_eval_cache_lacking_rows_is_named_and_told_to_update(tmp_path, llama_dir):
    """UX pass: --eval-ref-cache lacking rows of a one-file --eval-data was told 'the cache holds split train, not
    test: pass it as --eval-ref-cache' (it was that already; a single file has no splits), without naming which
    cache; and a row a later version of it removed was told nothing of the version (--cache-version is
    --ref-cache's only). Now: the option named, and the --update that brings it to the eval data."""
    from support import precompute_ok

    rows = pref_rows(16, seed=3)
    train, small_eval = write_jsonl(tmp_path / "p12.jsonl", rows[:12]), write_jsonl(tmp_path / "e12.jsonl", rows[:12])
    whole_eval = write_jsonl(tmp_path / "e16.jsonl", rows)
    precompute_ok("--model", llama_dir, "--data", train, "--out", tmp_path / "c4")
    precompute_ok("--model", llama_dir, "--data", small_eval, "--out", tmp_path / "e4")
    args = ["--model", str(llama_dir), "--data", str(train), "--ref-cache", str(tmp_path / "c4"), "--eval-data",
            str(whole_eval), "--eval-ref-cache", str(tmp_path / "e4"), "--output-dir", str(tmp_path / "r"), *TRAIN]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"4 of 16 data rows are not in the cache {tmp_path / 'e4'} (--eval-ref-cache)" in result.output
    assert "holds split" not in result.output and "pass it as" not in result.output
    assert f"--data {whole_eval} --out {tmp_path / 'e4'} --update" in result.output, result.output
    assert "--split" not in result.output  # the cache's own split (train), the default

    shared = list(args)  # the training rows' cache given for the eval rows too (closing pass: its --update remedy
    shared[shared.index(str(tmp_path / "e4"))] = str(tmp_path / "c4")  # would have dropped the training rows)
    result = CliRunner().invoke(main, shared)
    assert result.exit_code == 2 and "an --update of this one to the eval data would drop the training rows" in \
        result.output, result.output
    # e16.jsonl is one file of split train by its name (runtime.data_files.split_of_file): no --split to give
    assert f"--data {whole_eval} --out EVAL_CACHE`, then pass --eval-ref-cache EVAL_CACHE" in result.output
    assert "--update`" not in result.output

    precompute_ok("--model", llama_dir, "--data", write_jsonl(tmp_path / "e11.jsonl", rows[:11]), "--out",
                  tmp_path / "e4", "--update")  # version 2 removes row 11
    args[args.index(str(whole_eval))] = str(small_eval)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "1 of 12 data rows are not in the cache" in result.output
    assert "version 2 of the cache removed them" in result.output and "--cache-version" not in result.output
    assert f"--data {small_eval} --out {tmp_path / 'e4'} --update" in result.output, result.output


def test_a_cache_path_with_a_space_is_written_as_a_shell_takes_it_back(tmp_path, llama_dir, dpo_data, dpo_cache):
    """UX pass: running text named 'my caches/c 1' unquoted (the verified line, the rows-missing refusal, audit-ref's
    header), while commands and summaries quoted it (storage.quoting.shell_word, the one quoting)."""
    import shlex

    from audit.cli import main as audit_ref

    cache = tmp_path / "my caches" / "c 1"
    shutil.copytree(dpo_cache, cache)
    result = CliRunner().invoke(main, ["--model", str(llama_dir), "--data", str(dpo_data), "--ref-cache", str(cache),
                                       "--output-dir", str(tmp_path / "run"), *TRAIN], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"verified {shlex.quote(str(cache))}, " in result.output, result.output
    more = write_jsonl(tmp_path / "more.jsonl", pref_rows(len(open(dpo_data).readlines()) + 2))
    result = CliRunner().invoke(main, ["--model", str(llama_dir), "--data", str(more), "--ref-cache", str(cache),
                                       "--output-dir", str(tmp_path / "run2"), *TRAIN])
    assert result.exit_code == 2 and f"not in the cache {shlex.quote(str(cache))};" in result.output, result.output
    header = CliRunner().invoke(audit_ref, [str(cache)]).output.splitlines()[0]
    assert header == f"audit-ref {shlex.quote(str(cache))}", header
