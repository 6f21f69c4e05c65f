"""The three stamps (schemas/stamps.py): each is stable where nothing that matters changed, and each change that
matters flips the stamp that owns it and no other."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, pref_rows
from schemas.format import STAMPS
from schemas.encoding import EncodingConfig, encode_pair
from schemas.stamps import (
    WeightsError,
    combined_mask_checksum,
    model_hash,
    tokenizer_fingerprint,
    tokenizer_hash,
    weight_files,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BASE_CFG = EncodingConfig(max_length=128)
# A fixed small dataset: standard rows (no template under chat_template=auto) and conversational rows (templated).
ROWS = pref_rows(6, seed=3, fmt="standard") + pref_rows(4, seed=4, fmt="conversational")


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def row_checksums(tok, rows, cfg) -> list[str]:
    return [encode_pair(r, tok, cfg).mask_checksum for r in rows]


def all_stamps(tok, model_dir, rows=ROWS, cfg=BASE_CFG) -> dict:
    return {
        "tokenizer_hash": tokenizer_hash(tok),
        "model_hash": model_hash(model_dir),
        "mask_checksum": combined_mask_checksum(row_checksums(tok, rows, cfg), cfg.to_json()),
    }


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


class Workspace:
    """Copies of the session's Llama checkpoint, one per variant, edited on disk."""

    def __init__(self, root: Path, base: Path):
        self.root, self.base, self.n = root, base, 0

    def copy(self, files=None) -> Path:
        self.n += 1
        dst = self.root / f"v{self.n:02d}"
        dst.mkdir()
        for f in self.base.iterdir():
            if files is None or f.name in files:
                shutil.copy2(f, dst / f.name)
        return dst

    def tokenizer(self, edit) -> object:
        d = self.copy(TOKENIZER_FILES)
        edit(d)
        return load_tokenizer(d)

    def model(self, edit) -> Path:
        d = self.copy({"config.json", "model.safetensors"})
        edit(d)
        return d


@pytest.fixture(scope="session")
def ws(tmp_path_factory, llama_dir) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("stamp-variants"), llama_dir)


@pytest.fixture(scope="session")
def base_tok(llama_dir):
    return load_tokenizer(llama_dir)


@pytest.fixture(scope="session")
def base(base_tok, llama_dir) -> dict:
    return all_stamps(base_tok, llama_dir)


# ---------------------------------------------------------------------------------------------------------------
# stability


def test_tokenizer_hash_survives_save_and_load(tokenizer, llama_dir, tmp_path):
    loaded = load_tokenizer(llama_dir)
    loaded.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert tokenizer_hash(tokenizer) == tokenizer_hash(loaded) == tokenizer_hash(again)
    assert len(tokenizer_hash(tokenizer)) == 64
    # The fingerprint holds what changes ids: the backend spec (vocab, merges, normalizer, ...), specials, template.
    fp = tokenizer_fingerprint(loaded)
    assert fp["special_tokens"] == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": None}
    assert fp["chat_template"] == tokenizer.chat_template
    assert fp["backend"]["model"]["merges"] and "truncation" not in fp["backend"]


def test_tokenizer_hash_ignores_runtime_truncation_and_padding(llama_dir):
    tok = load_tokenizer(llama_dir)
    before = tokenizer_hash(tok)
    tok.backend_tokenizer.enable_truncation(max_length=7)
    tok.backend_tokenizer.enable_padding(length=9)
    assert tokenizer_hash(tok) == before


def test_slow_tokenizer_is_refused():
    class Slow:  # anything without a tokenizers backend
        pass

    with pytest.raises(TypeError, match="fast"):
        tokenizer_hash(Slow())


def test_model_hash_survives_save_and_load(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    sharded = weight_files(tmp_path / "sharded")
    assert len(sharded) > 3 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    assert model_hash(llama_dir) == model_hash(tmp_path / "plain") == model_hash(tmp_path / "sharded")


def test_model_hash_ignores_file_level_config_fields(ws, base):
    def edit(d):
        def change(c):
            c["_name_or_path"] = "/somewhere/else"
            c["transformers_version"] = "9.9.9"
            c["architectures"] = ["SomethingElse"]
            c["use_cache"] = not c.get("use_cache", True)
            c["dtype"] = "bfloat16"  # the tensors' own dtypes are what is hashed

        edit_json(d / "config.json", change)

    assert model_hash(ws.model(edit)) == base["model_hash"]


def test_model_hash_ignores_file_layout_and_metadata(ws, base):
    def edit(d):
        tensors = load_file(d / "model.safetensors")
        reordered = dict(sorted(tensors.items(), reverse=True))
        save_file(reordered, d / "model.safetensors", metadata={"format": "pt", "note": "re-saved elsewhere"})

    assert model_hash(ws.model(edit)) == base["model_hash"]

    def split_backwards(d):
        # Two shards where the first file holds the names that sort last: the hash follows names, not files.
        tensors = load_file(d / "model.safetensors")
        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[len(names) // 2 :],
                  "model-00002-of-00002.safetensors": names[: len(names) // 2]}
        for file, part in halves.items():
            save_file({n: tensors[n] for n in part}, d / file, metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        (d / "model.safetensors").unlink()

    split = ws.model(split_backwards)
    assert len(weight_files(split)) == 2
    assert model_hash(split) == base["model_hash"]


def test_stamps_equal_in_a_fresh_process(llama_dir, base_tok):
    code = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from schemas.stamps import model_hash, tokenizer_hash\n"
        "d = sys.argv[1]\n"
        "print(json.dumps({'t': tokenizer_hash(AutoTokenizer.from_pretrained(d)), 'm': model_hash(d)}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "4321", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(llama_dir)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"t": tokenizer_hash(base_tok), "m": model_hash(llama_dir)}


def test_hub_snapshot_symlinks_are_followed(llama_dir, tmp_path, base):
    """A Hugging Face hub cache holds snapshots/<rev>/<file> as symlinks into ../../blobs; that must hash alike."""
    from transformers import AutoModelForCausalLM

    shards = tmp_path / "shards"
    AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).save_pretrained(shards, max_shard_size="20KB")
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(shards.iterdir())):
        shutil.copy2(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    assert all(p.is_symlink() for p in snap.iterdir())
    assert len(weight_files(snap)) > 3
    assert model_hash(snap) == base["model_hash"]


# ---------------------------------------------------------------------------------------------------------------
# sensitivity: each change flips exactly the stamps it should


def _swap_adjacent(merges, first) -> None:
    i = merges.index(first)
    assert not set("".join(merges[i])) & set("".join(merges[i + 1]))  # disjoint characters: the two commute
    merges[i], merges[i + 1] = merges[i + 1], merges[i]


def _set_rope_theta(c):
    if "rope_parameters" in c:
        c["rope_parameters"]["rope_theta"] = 500000.0
    else:
        c["rope_theta"] = 500000.0


def _tensor_edit(fn):
    def edit(d):
        tensors = load_file(d / "model.safetensors")
        save_file(fn(tensors), d / "model.safetensors", metadata={"format": "pt"})

    return edit


def _nudge_one_element(t):
    w = t["model.layers.1.mlp.down_proj.weight"]
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(math.inf))
    return t


def _rename(t):
    # "model.norm.gain" still sorts last, so the bytes are hashed in the same order: only the name differs.
    assert max(t) == "model.norm.weight"
    t["model.norm.gain"] = t.pop("model.norm.weight")
    return t


def _reshape(t):
    t["lm_head.weight"] = t["lm_head.weight"].reshape(-1, 16).contiguous()  # same bytes, other shape
    return t


def _relabel_dtype(t):
    t["model.norm.weight"] = t["model.norm.weight"].view(torch.int32)  # same bytes, other dtype
    return t


def _swap_same_shape(t):
    a, b = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    assert t[a].shape == t[b].shape
    t[a], t[b] = t[b], t[a]
    return t


def _cut_completion(rows):
    rows = [dict(r) for r in rows]
    rows[2] = {**rows[2], "chosen": rows[2]["chosen"].rsplit(" ", 1)[0]}
    assert rows[2]["chosen"] != ROWS[2]["chosen"]
    return rows


def _truncating_length(tok) -> int:
    encoded = [encode_pair(r, tok, BASE_CFG) for r in ROWS]
    return max(len(e.prompt_ids) for e in encoded) + 2


def _template_edit(old, new):
    def edit(d):
        text = (d / "chat_template.jinja").read_text()
        assert old in text
        (d / "chat_template.jinja").write_text(text.replace(old, new))

    return edit


def _tok_json(fn):
    return lambda d: edit_json(d / "tokenizer.json", fn)


# name -> (how to build the variant from (workspace, base tokenizer), the stamps that must change)
VARIANTS = {
    # tokenizer: a change that leaves this dataset's ids alone flips the tokenizer hash only; one that changes them
    # flips the mask checksum as well (the mask checksum is a function of the ids).
    # Two adjacent merges over disjoint characters commute: the ids cannot change, yet the tokenizer hash does.
    "two adjacent independent merges swapped": (
        lambda ws, tok: {"tok": ws.tokenizer(_tok_json(lambda t: _swap_adjacent(t["model"]["merges"], ["r", "e"])))},
        {"tokenizer_hash"},
    ),
    "merge dropped": (
        lambda ws, tok: {"tok": ws.tokenizer(_tok_json(lambda t: t["model"]["merges"].remove(["r", "e"])))},
        {"tokenizer_hash", "mask_checksum"},
    ),
    "merge moved up (' green' splits as g|ree|n, not gre|en)": (
        lambda ws, tok: {"tok": ws.tokenizer(_tok_json(lambda t: t["model"]["merges"].insert(
            1, t["model"]["merges"].pop(t["model"]["merges"].index(["re", "e"])))))},
        {"tokenizer_hash", "mask_checksum"},
    ),
    "added token": (
        lambda ws, tok: {"tok": _with_added_token(ws)},
        {"tokenizer_hash"},
    ),
    "chat template, branch the data does not reach": (
        lambda ws, tok: {"tok": ws.tokenizer(_template_edit(
            "{% for m in messages %}", "{% for m in messages %}{% if m['role'] == 'tool' %}[tool]{% endif %}"))},
        {"tokenizer_hash"},
    ),
    "chat template, rendering changed": (
        lambda ws, tok: {"tok": ws.tokenizer(_template_edit("</s>\n{% endfor %}", "</s>\n\n{% endfor %}"))},
        {"tokenizer_hash", "mask_checksum"},
    ),
    "normalizer added (lowercase; the data is lowercase)": (
        lambda ws, tok: {"tok": ws.tokenizer(_tok_json(lambda t: t.update(normalizer={"type": "Lowercase"})))},
        {"tokenizer_hash"},
    ),
    "pre-tokenizer add_prefix_space": (
        lambda ws, tok: {"tok": ws.tokenizer(_tok_json(lambda t: t["pre_tokenizer"].update(add_prefix_space=True)))},
        {"tokenizer_hash", "mask_checksum"},
    ),
    # A different EOS changes the id appended to (or kept at the end of) every completion, so the masks change too.
    "eos token": (
        lambda ws, tok: {"tok": ws.tokenizer(
            lambda d: edit_json(d / "tokenizer_config.json", lambda c: c.update(eos_token="<|system|>")))},
        {"tokenizer_hash", "mask_checksum"},
    ),
    # model
    "one weight element": (
        lambda ws, tok: {"model_dir": ws.model(_tensor_edit(_nudge_one_element))},
        {"model_hash"},
    ),
    "config rope_theta": (
        lambda ws, tok: {"model_dir": ws.model(lambda d: edit_json(d / "config.json", _set_rope_theta))},
        {"model_hash"},
    ),
    "config rms_norm_eps": (
        lambda ws, tok: {"model_dir": ws.model(
            lambda d: edit_json(d / "config.json", lambda c: c.update(rms_norm_eps=1e-5)))},
        {"model_hash"},
    ),
    "weights cast to bfloat16": (
        lambda ws, tok: {"model_dir": ws.model(_tensor_edit(lambda t: {k: v.bfloat16() for k, v in t.items()}))},
        {"model_hash"},
    ),
    "weights cast to float16 and back": (  # same dtype and names, rounded values
        lambda ws, tok: {"model_dir": ws.model(_tensor_edit(lambda t: {k: v.half().float() for k, v in t.items()}))},
        {"model_hash"},
    ),
    "tensor renamed": (
        lambda ws, tok: {"model_dir": ws.model(_tensor_edit(_rename))},
        {"model_hash"},
    ),
    "tensor reshaped, same bytes": (
        lambda ws, tok: {"model_dir": ws.model(_tensor_edit(_reshape))},
        {"model_hash"},
    ),
    "tensor dtype relabelled, same bytes": (
        lambda ws, tok: {"model_dir": ws.model(_tensor_edit(_relabel_dtype))},
        {"model_hash"},
    ),
    "two same-shape tensors swapped": (
        lambda ws, tok: {"model_dir": ws.model(_tensor_edit(_swap_same_shape))},
        {"model_hash"},
    ),
    # data and encoding
    "max_length that truncates": (
        lambda ws, tok: {"cfg": dataclasses.replace(BASE_CFG, max_length=_truncating_length(tok))},
        {"mask_checksum"},
    ),
    "a completion cut short in the data": (
        lambda ws, tok: {"rows": _cut_completion(ROWS)},
        {"mask_checksum"},
    ),
    "rows reordered": (
        lambda ws, tok: {"rows": ROWS[1:] + ROWS[:1]},
        {"mask_checksum"},
    ),
    "truncation_mode at a truncating max_length": (
        lambda ws, tok: {
            "cfg": EncodingConfig(max_length=_truncating_length(tok), truncation_mode="keep_end"),
            "base_cfg": EncodingConfig(max_length=_truncating_length(tok), truncation_mode="keep_start"),
        },
        {"mask_checksum"},
    ),
    "truncation_mode with nothing truncated": (  # the encoding config itself is part of the checksum
        lambda ws, tok: {"cfg": dataclasses.replace(BASE_CFG, truncation_mode="error")},
        {"mask_checksum"},
    ),
    "add_bos off": (
        lambda ws, tok: {"cfg": dataclasses.replace(BASE_CFG, add_bos=False)},
        {"mask_checksum"},
    ),
    "add_eos off": (
        lambda ws, tok: {"cfg": dataclasses.replace(BASE_CFG, add_eos=False)},
        {"mask_checksum"},
    ),
    "chat_template on (the standard rows templated too)": (
        lambda ws, tok: {"cfg": dataclasses.replace(BASE_CFG, chat_template="on")},
        {"mask_checksum"},
    ),
    "a column mapping (the rows as the encoder sees them unchanged: the recorded mapping is hashed in)": (
        lambda ws, tok: {"cfg": dataclasses.replace(BASE_CFG, columns="prompt=question")},
        {"mask_checksum"},
    ),
    "completion_end template (TRL's completion: the template's text after the EOS is hashed in too)": (
        lambda ws, tok: {"cfg": dataclasses.replace(BASE_CFG, completion_end="template")},
        {"mask_checksum"},
    ),
    # nothing that matters
    "tokenizer_config model_max_length": (
        lambda ws, tok: {"tok": ws.tokenizer(
            lambda d: edit_json(d / "tokenizer_config.json", lambda c: c.update(model_max_length=2048)))},
        set(),
    ),
    "row ids renamed": (
        lambda ws, tok: {"rows": [{**r, "id": "other-" + r["id"]} for r in ROWS]},
        set(),
    ),
}


def _with_added_token(ws):
    tok = ws.tokenizer(lambda d: None)
    before = len(tok)
    assert tok.add_tokens(["<|tool|>"], special_tokens=True) == 1 and len(tok) == before + 1
    return tok


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_change_flips_exactly_its_stamps(name, ws, base_tok, llama_dir, base):
    make, expected = VARIANTS[name]
    v = {"tok": base_tok, "model_dir": llama_dir, "rows": ROWS, "cfg": BASE_CFG, "base_cfg": BASE_CFG}
    v.update(make(ws, base_tok))
    reference = base if v["base_cfg"] is BASE_CFG else all_stamps(base_tok, llama_dir, ROWS, v["base_cfg"])
    got = all_stamps(v["tok"], v["model_dir"], v["rows"], v["cfg"])
    changed = {s for s in STAMPS if got[s] != reference[s]}
    assert changed == expected, f"{name}: changed {sorted(changed)}, expected {sorted(expected)}"


def test_sensitivity_table_is_broad(ws, base_tok, base):
    # The acceptance bar: at least ten distinct changes that flip one stamp and only it, for every stamp a cache
    # carries (schemas.format.STAMPS), and a change of every field of the encoding config a cache records.
    assert set(base) == set(STAMPS)  # all_stamps computes each stamp of the product's list, no more
    single = [n for n, (_, e) in VARIANTS.items() if len(e) == 1]
    assert len(single) >= 10
    assert {next(iter(VARIANTS[n][1])) for n in single} == set(STAMPS)
    varied = set()
    for make, _ in VARIANTS.values():
        v = {"cfg": BASE_CFG, "base_cfg": BASE_CFG, **make(ws, base_tok)}
        varied |= {f.name for f in dataclasses.fields(EncodingConfig)
                   if getattr(v["cfg"], f.name) != getattr(v["base_cfg"], f.name)}
    assert varied == {f.name for f in dataclasses.fields(EncodingConfig)}


def test_per_row_checksums_show_what_changed(base_tok):
    """Where the encoding config changes but no row is truncated, the rows are identical: the combined checksum
    differs because the config is hashed into it. Where max_length truncates, rows themselves differ."""
    same = row_checksums(base_tok, ROWS, dataclasses.replace(BASE_CFG, truncation_mode="error"))
    assert same == row_checksums(base_tok, ROWS, BASE_CFG)
    short = dataclasses.replace(BASE_CFG, max_length=_truncating_length(base_tok))
    differ = [a != b for a, b in zip(row_checksums(base_tok, ROWS, short), row_checksums(base_tok, ROWS, BASE_CFG))]
    assert any(differ) and not all(differ)


def test_combined_mask_checksum_layout():
    import hashlib

    rows = ["00" * 32, "ab" * 32]
    enc = BASE_CFG.to_json()
    expected = hashlib.sha256(b"refcache-masks-v1" + enc.encode() + bytes(32) + bytes.fromhex("ab" * 32)).hexdigest()
    assert combined_mask_checksum(rows, enc) == expected
    assert combined_mask_checksum(rows[::-1], enc) != expected
    assert combined_mask_checksum(rows, EncodingConfig(max_length=64).to_json()) != expected
    assert combined_mask_checksum([], enc) == hashlib.sha256(b"refcache-masks-v1" + enc.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# weight files that must be refused


def _write_config(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))


def test_pickle_only_checkpoint_is_refused(tmp_path):
    _write_config(tmp_path)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="pickle") as err:
        weight_files(tmp_path)
    assert "pytorch_model.bin" in str(err.value) and "safetensors" in str(err.value)
    with pytest.raises(WeightsError):
        model_hash(tmp_path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABS", "sub/../../outside.safetensors"])
def test_index_pointing_outside_the_folder_is_refused(tmp_path, name):
    model = tmp_path / "model"
    _write_config(model)
    save_file({"w": torch.zeros(2)}, tmp_path / "outside.safetensors")
    save_file({"v": torch.zeros(2)}, model / "model-00001-of-00001.safetensors")
    name = str(tmp_path / "outside.safetensors") if name == "ABS" else name
    index = {"metadata": {}, "weight_map": {"v": "model-00001-of-00001.safetensors", "w": name}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="outside the checkpoint folder"):
        weight_files(model)


def test_index_listing_a_missing_file_is_refused(tmp_path):
    _write_config(tmp_path)
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="does not exist"):
        weight_files(tmp_path)


def test_no_weights_or_no_folder(tmp_path):
    _write_config(tmp_path / "empty")
    with pytest.raises(WeightsError, match="no model.safetensors or model.safetensors.index.json"):
        weight_files(tmp_path / "empty")
    with pytest.raises(WeightsError, match="not a directory"):
        weight_files(tmp_path / "nowhere")
    (tmp_path / "noconfig").mkdir()
    save_file({"w": torch.zeros(2)}, tmp_path / "noconfig" / "model.safetensors")
    with pytest.raises(WeightsError, match="config.json"):
        model_hash(tmp_path / "noconfig")


def test_broken_safetensors_are_refused(llama_dir, tmp_path):
    data = (llama_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    cases = {
        "truncated": data[:-16],
        "huge header": struct.pack("<Q", len(data) * 2) + data[8:],
        "bad header json": data[:8] + b"{" * n + data[8 + n :],
        "too short": data[:5],
    }
    messages = {"truncated": "past the end", "huge header": "corrupt", "bad header json": "corrupt",
                "too short": "short"}
    for name, blob in cases.items():
        d = tmp_path / name.replace(" ", "_")
        _write_config(d)
        (d / "model.safetensors").write_bytes(blob)
        with pytest.raises(WeightsError, match=messages[name]):
            model_hash(d)


def test_tensor_in_two_files_is_refused(tmp_path):
    _write_config(tmp_path)
    save_file({"w": torch.zeros(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2), "v": torch.ones(2)}, tmp_path / "b.safetensors")
    index = {"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="also appears"):
        model_hash(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# custom code (auto_map, --trust-remote-code): the files it comes from are part of the stamps (issue 22, item 8)

# model_hash(data/sft-model) as computed by the code before custom code was hashed: a model without auto_map keeps it
SFT_MODEL_HASH = "daa080e41d34848d3786bbce7a9f1c2ebe87d3387dedc9e4e6dcfe45dd5e88ec"
SFT_TOKENIZER_HASH = "c18b6f6f664a44059cffab70487279661d1ff370f93106f27118fedff53b9f2d"


def test_a_model_without_custom_code_keeps_its_hash():
    assert model_hash(REPO / "data" / "sft-model") == SFT_MODEL_HASH
    assert tokenizer_hash(load_tokenizer(REPO / "data" / "sft-model")) == SFT_TOKENIZER_HASH


def test_custom_model_code_is_in_the_model_hash(llama_dir, tmp_path):
    from runtime.checkpoint import Checkpoint
    from support import make_custom_code_model

    model = make_custom_code_model(llama_dir, tmp_path / "custom")
    first = model_hash(model)
    assert first != model_hash(llama_dir)  # the same tensors and config fields, but code computes the logits
    assert Checkpoint.open(str(model), trust_remote_code=True).base_hash == first  # one function for every command
    seen = {first}
    for name, text in (("modeling_scaled.py", "# edited\n"), ("scale.py", "FACTOR = 2.0\n"),  # its relative import
                       ("helpers.py", "X = 1\n")):  # any top-level .py: transformers looks for relative imports there
        with open(model / name, "a") as f:
            f.write(text)
        seen.add(model_hash(model))
    assert len(seen) == 4
    (model / "notes.txt").write_text("not code")
    (model / "sub").mkdir()
    (model / "sub" / "unused.py").write_text("X = 2\n")  # transformers loads no module from a subfolder
    assert model_hash(model) in seen


@pytest.mark.parametrize("ref,message", [
    ("org/repo--modeling_scaled.ScaledLlamaForCausalLM", "runs code from another repository"),
    ("modeling_absent.ScaledLlamaForCausalLM", "names modeling_absent.py, which is not in the checkpoint folder"),
    ("../modeling_scaled.ScaledLlamaForCausalLM", "names code outside the checkpoint folder"),
])
def test_custom_code_that_cannot_be_hashed_is_refused(llama_dir, tmp_path, ref, message):
    from support import make_custom_code_model

    model = make_custom_code_model(llama_dir, tmp_path / "custom")
    edit_json(model / "config.json", lambda c: c["auto_map"].__setitem__("AutoModelForCausalLM", ref))
    with pytest.raises(WeightsError, match=message):
        model_hash(model)


def test_custom_tokenizer_code_is_in_the_tokenizer_hash(llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from schemas.stamps import tokenizer_parts

    folder = Path(shutil.copytree(llama_dir, tmp_path / "tok"))
    plain = tokenizer_hash(load_tokenizer(folder))
    code = "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n"
    (folder / "tokenization_custom.py").write_text(code + "    pass\n")
    edit_json(folder / "tokenizer_config.json", lambda c: c.update(
        auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}, tokenizer_class="CustomTokenizer"))
    custom = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert type(custom).__name__ == "CustomTokenizer"
    first = tokenizer_hash(custom)
    assert first != plain and "code" in tokenizer_parts(custom)
    (folder / "tokenization_custom.py").write_text(code + "    def _encode_plus(self, *a, **k):\n"
                                                   "        return super()._encode_plus(*a, **k)\n")
    assert tokenizer_hash(AutoTokenizer.from_pretrained(folder, trust_remote_code=True)) != first


def test_custom_code_in_a_subfolder_is_hashed_there(llama_dir, tmp_path):
    """auto_map 'sub/module.Class': transformers loads module.py and its relative imports from sub/."""
    from support import make_custom_code_model

    model = make_custom_code_model(llama_dir, tmp_path / "custom")
    (model / "sub").mkdir()
    for name in ("modeling_scaled.py", "scale.py"):
        (model / name).rename(model / "sub" / name)
    edit_json(model / "config.json", lambda c: c["auto_map"].__setitem__(
        "AutoModelForCausalLM", "sub/modeling_scaled.ScaledLlamaForCausalLM"))
    first = model_hash(model)
    (model / "sub" / "scale.py").write_text("FACTOR = 2.0\n")
    assert model_hash(model) != first
