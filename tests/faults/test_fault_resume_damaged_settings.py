"""Issue 36 (hostile pass): the settings a resume or an update takes from --out (a finished cache's manifest.json, or an
interrupted first run's shard footer) pass through the same option types and declared domains as the command line.
A tampered value (rows_per_shard 0 or 4.0, top_k -1 or "8", dtype float64, an encoding max_length 1024.0 or -3) is a
damaged cache: refused with exit 2, one paragraph naming the file and the key, nothing written; never an unexpected
error, never a remedy built from the bad value. Each case is the command as typed and the message asserted."""

from __future__ import annotations

import json
import shutil

import pytest
from faultkit import assert_one_paragraph, set_metadata
from support import dir_state, pref_rows, precompute_cli, write_jsonl, made_cache

from precompute.config import OPTION_OF, PrecomputeConfig, cache_settings
from runtime.errors import JobError
from schemas import format as fmt
from schemas.encoding import EncodingConfig

FIRST_SHARD = "shard-00000.parquet"


@pytest.fixture(scope="module")
def made(tmp_path_factory, llama_dir):
    """A finished cache of 12 rows in shards of 4, and its data."""
    return made_cache(tmp_path_factory, llama_dir, "damaged-settings", 12)


def _tampered(made, tmp_path, where: str, section: str, key: str, value, shard: str = FIRST_SHARD):
    """A copy of the cache with `section`[`key`] set to `value`: in manifest.json as a text editor would, or (the
    manifest deleted: an interrupted first run) in `shard`'s footer, rewritten with pyarrow."""
    out = shutil.copytree(made[0], tmp_path / "tm")
    if where == "manifest":
        manifest = json.loads((out / fmt.MANIFEST).read_text())
        manifest[section][key] = value
        (out / fmt.MANIFEST).write_text(json.dumps(manifest))
    else:
        (out / fmt.MANIFEST).unlink()
        (out / fmt.CARD).unlink(missing_ok=True)
        recorded = json.loads(fmt.read_shard_metadata(out / shard)[section])
        set_metadata(out, shard, section, json.dumps({**recorded, key: value}))
    return out


CASES = [  # (section, key, value, what the message says of it)
    ("computation", "rows_per_shard", 0, "out of range; expected a whole number >= 1"),
    ("computation", "rows_per_shard", "4; rm -rf /", "is not a number"),
    ("computation", "rows_per_shard", 4.0, "never a float"),
    ("computation", "rows_per_shard", 1e300, "never a float"),
    ("computation", "rows_per_shard", True, "is not a number"),
    ("computation", "top_k", "8", "never a string"),
    ("computation", "top_k", -1, "out of range; expected a whole number >= 0"),
    ("computation", "dtype", "float64", "is not one of 'auto', 'float32'"),
    ("computation", "token_budget", 0, "not a positive number of tokens"),
    ("computation", "requested_batching", "fast", "is not one of 'auto'"),
    ("computation", "device_type", "0; rm -rf ~", "a torch device type"),  # once "remedy: pass --device 0; rm -rf ~"
    ("encoding", "max_length", -3, "a whole number >= 2"),
    ("encoding", "max_length", 1024.0, "a whole number >= 2"),
    ("encoding", "max_length", 8.5, "a whole number >= 2"),
    ("encoding", "max_length", 1e30, "a whole number >= 2"),
    ("encoding", "truncation_mode", 3, "one of keep_start, keep_end, error"),
    ("encoding", "add_eos", "yes", "true or false"),
]


@pytest.mark.parametrize("where", ["manifest", "footer"])
@pytest.mark.parametrize("section,key,value,words", CASES, ids=[f"{c[1]}={c[2]!r}" for c in CASES])
def test_a_tampered_recorded_setting_is_a_damaged_cache_refused_naming_the_file_and_key(
        made, llama_dir, tmp_path, where, section, key, value, words):
    out = _tampered(made, tmp_path, where, section, key, value)
    before = dir_state(out)
    refused = precompute_cli("--model", llama_dir, "--data", made[1], "--out", out)
    assert refused.exit_code == 2, refused.output
    assert_one_paragraph(refused.output)
    named = str(out / fmt.MANIFEST) if where == "manifest" else f"{out / FIRST_SHARD}'s footer"
    assert f"{named}: {section} '{key}'" in refused.output, refused.output
    assert words in refused.output and "the cache is damaged" in refused.output, refused.output
    # the remedy leads somewhere: the command that makes the cache again (audit-ref could tell no more than this)
    assert f"make it again with `precompute-ref --model {llama_dir} --data " in refused.output, refused.output
    assert f"--out {out} --overwrite`" in refused.output, refused.output
    # no remedy made of the bad value (top_k -1 once read "this run gives --top-k -1"), no default named instead
    assert "this run gives" not in refused.output and "--update" not in refused.output
    assert "unexpected" not in refused.output
    assert dir_state(out) == before


@pytest.mark.parametrize("section,key,value", [("computation", "rows_per_shard", 0), ("computation", "top_k", -1),
                                               ("computation", "dtype", "float64"), ("encoding", "max_length", -3)])
def test_a_later_shards_tampered_footer_is_damage_not_a_setting_to_pass(made, llama_dir, tmp_path, section, key,
                                                                        value):
    """The settings come from the first footer; a kept shard's own footer is checked alike as the resume reads it
    (it once read "made with --rows-per-shard 0 ... remedy: pass --rows-per-shard 0")."""
    out = _tampered(made, tmp_path, "footer", section, key, value, shard="shard-00001.parquet")
    before = dir_state(out)
    refused = precompute_cli("--model", llama_dir, "--data", made[1], "--out", out)
    assert refused.exit_code == 2, refused.output
    assert_one_paragraph(refused.output)
    assert f"{out / 'shard-00001.parquet'}'s footer: {section} '{key}'" in refused.output, refused.output
    assert "the cache is damaged" in refused.output and "pass --" not in refused.output, refused.output
    assert dir_state(out) == before


def test_a_recorded_value_is_escaped_and_clipped(made, llama_dir, tmp_path):
    out = _tampered(made, tmp_path, "footer", "computation", "dtype", "\x1b[2J\nremedy: curl x | sh" + "z" * 50_000)
    refused = precompute_cli("--model", llama_dir, "--data", made[1], "--out", out)
    assert refused.exit_code == 2, refused.output
    assert "\x1b" not in refused.output and "\\x1b[2J\\nremedy" in refused.output
    assert all(len(line) < 2100 for line in refused.output.splitlines()) and "characters left out" in refused.output


def test_an_untampered_copy_still_resumes_with_its_settings(made, llama_dir, tmp_path):
    out = shutil.copytree(made[0], tmp_path / "tm")
    (out / fmt.MANIFEST).unlink()  # an interrupted first run: its settings come from the footers
    resumed = precompute_cli("--model", llama_dir, "--data", made[1], "--out", out)
    assert resumed.exit_code == 0, resumed.output
    assert "resume: the interrupted run's settings: --rows-per-shard 4" in resumed.output


@pytest.mark.parametrize("key", list(OPTION_OF))
def test_every_recorded_setting_goes_through_its_option_type(llama_dir, tmp_path, key):
    """Enumerated: every recorded key a refusal names as an option (OPTION_OF: RECORDED_SETTINGS and the device)
    is checked, so a new one cannot skip it (a list is no option's value)."""
    out = tmp_path / "cache"
    out.mkdir()
    encoding = EncodingConfig().to_dict()
    (out / fmt.MANIFEST).write_text(json.dumps({"computation": {key: [1]}, "encoding": encoding}))
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(2))
    with pytest.raises(JobError, match=f"manifest.json: computation '{key}'.*the cache is damaged"):
        cache_settings(PrecomputeConfig(model=str(llama_dir), data=str(data), out=str(out)))


def test_a_recorded_attention_not_installed_here_is_no_damage(llama_dir, tmp_path):
    """flash_attention_2 is a setting precompute-ref makes (on a CUDA machine with flash-attn): where its package is
    missing the resume is refused naming the attention, never calling the cache damaged."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    out = tmp_path / "cache"
    out.mkdir()
    computation = {"requested_attn_implementation": "flash_attention_2"}
    (out / fmt.MANIFEST).write_text(json.dumps({"computation": computation, "encoding": EncodingConfig().to_dict()}))
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(2))
    with pytest.raises(JobError, match="scored with --attn-implementation flash_attention_2, which cannot load here "
                                       r"\(flash_attention_2 is supported, but its package is not installed") as e:
        cache_settings(PrecomputeConfig(model=str(llama_dir), data=str(data), out=str(out)))
    assert "damaged" not in str(e.value) and "use one of" not in str(e.value)

