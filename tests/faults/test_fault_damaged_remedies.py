"""Issue 36 (leftovers of the hostile pass): a refusal of a damaged cache leads somewhere. train-dpo, precompute-ref
(a resume, --update) and audit-ref answer a cache precompute-ref never wrote (a shard's bytes changed, a shard gone,
manifest.json cut short, its stamps, its requested attention or its format_version edited) with the command that
makes it again (schemas/findings.py `rebuild`), or audit-ref's findings, never with "audit-ref it" to an audit-ref
that refuses the same thing and tells no more; an edited setting is never "the cache's setting" to pass; an edited
format_version is a damaged manifest, not a newer refcache. And a model folder's file that cannot be read as a file
(a FIFO, a folder) is named as the folder's, not blamed on the data's chat template. Each case is the command as typed
and the message asserted."""

from __future__ import annotations

import json
import shlex
import os
import shutil

import pytest
from faultkit import assert_one_paragraph, audit, failed_checks, precompute, train
from support import dir_state, made_cache, pref_rows, write_jsonl

from schemas import format as fmt

S1 = "shard-00001.parquet"


@pytest.fixture(scope="module")
def made(tmp_path_factory, llama_dir):
    """A finished cache of 8 rows in shards of 4, and its data."""
    return made_cache(tmp_path_factory, llama_dir, "damaged-remedies", 8)


def _edit(out, edit):
    manifest = json.loads((out / fmt.MANIFEST).read_text())
    edit(manifest)
    (out / fmt.MANIFEST).write_text(json.dumps(manifest, indent=2))


def shard_bytes(out):
    raw = bytearray((out / S1).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (out / S1).write_bytes(bytes(raw))


def shard_gone(out):
    (out / S1).unlink()


def manifest_cut(out):
    text = (out / fmt.MANIFEST).read_text()
    (out / fmt.MANIFEST).write_text(text[: len(text) // 2])


def stamps_edited(out):
    _edit(out, lambda m: m["stamps"].__setitem__("mask_checksum", "0" * 64))


def attention_edited(out):
    _edit(out, lambda m: m["computation"].__setitem__("requested_attn_implementation", "eager"))


def attention_garbage(out):
    _edit(out, lambda m: m["computation"].__setitem__("requested_attn_implementation", "bogus"))


def format_99(out):
    _edit(out, lambda m: m.__setitem__("format_version", 99))


def format_0(out):
    _edit(out, lambda m: m.__setitem__("format_version", 0))


# damage -> whether audit-ref reads the manifest (then it reports the damage as a failing check: the remedy
# "audit-ref CACHE lists every check it fails" leads somewhere) or refuses it (then its refusal is the rebuild command)
DAMAGE = {shard_bytes: True, shard_gone: True, stamps_edited: True, attention_edited: True, attention_garbage: True,
          manifest_cut: False, format_99: False, format_0: False}


def _copy(made, tmp_path, damage):
    out = shutil.copytree(made[0], tmp_path / "cache")
    damage(out)
    return out


def _rebuild_named(output: str, out, model, data):
    """The refusal's remedy is the command that makes the cache again, with the reference and data (as recorded or
    as typed); the words are the one remedy's (schemas/findings.py rebuild)."""
    assert "the cache is damaged" in output, output
    assert f"`precompute-ref --model {model} --data {data} " in output, output
    assert f"--out {out} --overwrite`" in output, output


@pytest.mark.parametrize("damage", list(DAMAGE), ids=[d.__name__ for d in DAMAGE])
def test_train_dpo_refuses_a_damaged_cache_with_the_rebuild_command(made, llama_dir, tmp_path, damage):
    out = _copy(made, tmp_path, damage)
    refused = train("--model", llama_dir, "--data", made[1], "--ref-cache", out, "--output-dir", tmp_path / "run",
                    "--max-steps", 1)
    assert refused.exit_code == 2, refused.output
    _rebuild_named(refused.output, out, llama_dir, made[1])
    assert "fresh --out directory" not in refused.output and "upgrade refcache" not in refused.output


@pytest.mark.parametrize("damage", list(DAMAGE), ids=[d.__name__ for d in DAMAGE])
def test_update_of_a_damaged_cache_never_loops_through_audit_ref(made, llama_dir, tmp_path, damage):
    """--update refuses; where it says "audit-ref CACHE", audit-ref reports the damage as a failing check; where
    audit-ref cannot read the manifest either, neither sends the user to the other: both give the rebuild command."""
    out = _copy(made, tmp_path, damage)
    before = dir_state(out)
    refused = precompute("--model", llama_dir, "--data", made[1], "--out", out, "--update")
    assert refused.exit_code == 2, refused.output
    assert_one_paragraph(refused.output)
    if damage is stamps_edited:  # the card records the stamps the manifest did: which of the two was edited is open
        assert ("README.md (a refcache dataset card whose stamps are not manifest.json's: the card or the manifest "
                "was edited") in refused.output, refused.output
    else:
        assert f"--out {out} --overwrite`" in refused.output and "the cache is damaged" in refused.output, \
            refused.output
    assert "pass --attn-implementation" not in refused.output
    assert dir_state(out) == before
    code, report, output = audit(out)
    if DAMAGE[damage]:  # where the refusal sends the user to audit-ref, audit-ref reports the damage as checks
        assert code != 0 and report is not None and failed_checks(report), output
        # and its report ends with the way on (ux44b: a FAIL with no remedy), the rows as the manifest lists them
        assert "remedy: the cache is damaged" in output and f"--out {out} --overwrite`" in output, output
        assert " 8 rows" in output.splitlines()[2], output
    else:
        assert "audit-ref" not in refused.output, refused.output
        assert code == 2 and report is None, output
        assert "the cache is damaged" in output and f"--out {out} --overwrite`" in output, output


@pytest.mark.parametrize("value", ["eager", "bogus"])
def test_a_resume_over_an_edited_requested_attention_is_a_damaged_cache(made, llama_dir, tmp_path, value):
    """The manifest records a requested attention its shards were not scored with: precompute-ref never wrote that,
    so the cache is damaged; it once read "made with --attn-implementation auto; this run gives eager: pass
    --attn-implementation auto", a setting the user never gave."""
    out = _copy(made, tmp_path, attention_edited if value == "eager" else attention_garbage)
    before = dir_state(out)
    refused = precompute("--model", llama_dir, "--data", made[1], "--out", out, "--rows-per-shard", 4)
    assert refused.exit_code == 2, refused.output
    assert "pass --attn-implementation" not in refused.output and "this run gives" not in refused.output
    assert "the cache is damaged" in refused.output and f"--out {out} --overwrite`" in refused.output, refused.output
    if value == "eager":
        assert "records requested_attn_implementation='eager', but shard-00000.parquet" in refused.output
        assert "so the manifest was edited" in refused.output
    assert dir_state(out) == before


@pytest.mark.parametrize("damage", [format_99, format_0], ids=["99", "0"])
def test_an_edited_format_version_is_a_damaged_manifest(made, llama_dir, tmp_path, damage):
    """Not "upgrade refcache" (the manifest names this refcache as its writer) and nothing about the versions' files:
    the manifest is damaged, and the command that makes the cache again."""
    out = _copy(made, tmp_path, damage)
    code, _, output = audit(out)
    assert code == 2, output
    assert "so the manifest is damaged (edited), not from another refcache" in output, output
    assert "upgrade" not in output and "manifest-0" not in output, output
    _rebuild_named(output, out, llama_dir, made[1])


@pytest.mark.parametrize("kind", ["fifo", "folder", "unreadable"])
def test_a_model_folders_file_that_cannot_be_read_is_named_as_the_folders(made, llama_dir, tmp_path, kind):
    """A FIFO (refused without blocking on it), a folder or a file this user may not open as tokenizer_config.json:
    named as the model folder's file, never as the data's chat template failing on row 1."""
    model = shutil.copytree(llama_dir, tmp_path / "model")
    target = model / "tokenizer_config.json"
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    else:
        if os.geteuid() == 0:
            pytest.skip("root opens a file of mode 000")
        target.write_text("{}")
        target.chmod(0)
    refused = precompute("--model", model, "--data", made[1], "--out", tmp_path / "out")
    assert refused.exit_code == 2, refused.output
    assert_one_paragraph(refused.output)
    why = {"fifo": "it is a FIFO (named pipe), not a regular file", "folder": "it is a folder, not a file",
           "unreadable": "opening it fails (Permission denied)"}[kind]
    assert f"{model}: the model folder's tokenizer_config.json cannot be read: {why}; " in refused.output, \
        refused.output
    assert "chat template" not in refused.output and "row 1" not in refused.output, refused.output
    assert not (tmp_path / "out").exists()


def test_the_rebuild_remedy_of_an_updated_cache_never_overwrites_its_earlier_versions(made, llama_dir, tmp_path):
    """Found by the closing passes (ux44b, h44): on an updated cache with a damaged shard of its current version, or a
    current manifest that no longer reads, the remedy was `--overwrite`, which deletes the earlier versions runs
    trained on (version 1 still verifies). It is now a fresh folder, naming the versions kept and how they are read;
    the command as printed makes a cache without touching this one."""
    out = _copy(made, tmp_path, lambda out: None)
    grown = write_jsonl(tmp_path / "grown.jsonl", pref_rows(10))
    assert precompute("--model", llama_dir, "--data", grown, "--out", out, "--update").exit_code == 0
    new_shard = next(p for p in sorted(out.glob("shard-v00002-*.parquet")))
    raw = bytearray(new_shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    new_shard.write_bytes(bytes(raw))
    said = ("also keeps the cache's earlier version 1, which `train-dpo --cache-version N` and `audit-ref "
            "--cache-version N` still read where they verify, and which --overwrite there would delete")
    code, _, output = audit(out)
    assert code != 0 and said in output and "--overwrite`" not in output, output
    assert "make it again into a fresh folder with `precompute-ref --model " in output
    assert audit(out, "--cache-version", "1")[0] == 0  # the earlier version still verifies, as said
    (out / fmt.MANIFEST).write_text("{garbage")  # the current manifest unreadable: the files say what is kept
    before = dir_state(out)
    refused = train("--model", llama_dir, "--data", grown, "--ref-cache", out, "--output-dir", tmp_path / "run",
                    "--use-cpu", "--max-steps", "1")
    assert refused.exit_code == 2 and said in refused.output and "--overwrite`" not in refused.output, refused.output
    line = " ".join(refused.output.split())
    command = line.split("make it again into a fresh folder with `", 1)[1].split("`", 1)[0]
    remade = precompute(*shlex.split(command.replace("NEW_CACHE", str(tmp_path / "new")))[1:])
    assert remade.exit_code == 0, remade.output
    assert dir_state(out) == before  # followed as printed, the remedy left the damaged cache and its versions be
