"""Helpers shared by the test files: tiny models and BPE tokenizers built on the spot (nothing comes from a hub),
preference rows, and small readers of a cache folder or a train-dpo output folder.

The fixtures live in tests/conftest.py, which re-exports these names (`from conftest import build_llama` keeps
working). Helper scripts that tests start as subprocesses live in tests/helpers/.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data"
HELPERS = REPO / "tests" / "helpers"  # scripts run as subprocesses

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WORDS = "the a cat dog sky blue green red sun moon is are was be yes no sure hmm answer question what why how " \
        "one two three four five six seven eight nine ten add and plus minus colour fly swim run jump".split()

DPO_PAIRS = 40  # rows of the session's `dpo_data` fixture


# ---------------------------------------------------------------------------------------------------------------
# tokenizers and models


def corpus(n=400, seed=0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + rng.choice([".", "?", "!"]) for _ in range(n)]


def build_tokenizer(vocab_size=300, extra_special=(), chat_template=CHAT_TEMPLATE, seed=0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", *extra_special]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    return fast


# GPT-2 style: no BOS added to a text, a chat template that renders no BOS. Llama style: the tokenizer adds BOS to a
# text (a template post-processor) and the chat template starts with the BOS token. For comparing encodings with TRL.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def gpt2_style():
    return build_tokenizer()


def llama_style():
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer(chat_template=LLAMA_TEMPLATE)
    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.bos_token_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = LLAMA_TEMPLATE
    return fast


def build_llama(vocab_size, seed=0, hidden=32, layers=2, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, **overrides,
    )
    return LlamaForCausalLM(cfg).eval()


def build_gpt2(vocab_size, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=512, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def save_checkpoint(model, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# preference data


def pref_rows(n=24, seed=0, fmt="standard") -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) + "?"
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        b = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        if fmt == "standard":
            row = {"prompt": q, "chosen": "sure " + a, "rejected": "hmm " + b}
        elif fmt == "conversational":
            row = {"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": "sure " + a}],
                   "rejected": [{"role": "assistant", "content": "hmm " + b}]}
        else:  # implicit prompt
            row = {"chosen": q + " sure " + a, "rejected": q + " hmm " + b}
        rows.append({"id": f"r{i:04d}", **row})
    return rows


def hub_snapshot(kind: str, repo: str, files: dict[str, Path]) -> Path:
    """A model or data set `repo` in the local Hugging Face cache (HF_HOME of the session), laid out as the hub does:
    refs/main naming a commit, snapshot files linking into blobs/. `kind`: model or dataset."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE) / f"{kind}s--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    (root / "blobs").mkdir(exist_ok=True)
    for i, (name, src) in enumerate(files.items()):
        shutil.copy(src, root / "blobs" / f"blob{i}")
        (snap / name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    return snap


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------------------------
# a cache folder, read without refcache's own reader


def manifest_of(out: Path) -> dict:
    return json.loads((Path(out) / "manifest.json").read_text())


def shard_hashes(out: Path) -> dict[str, str]:
    """sha256 of every shard file in the directory (listed or not)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(out).glob("*.parquet"))}


def dir_state(out: Path) -> dict[str, str]:
    """Every file in the directory with its content hash."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(out).iterdir()) if p.is_file()}


def read_cache(out: Path):
    """All rows as a polars DataFrame, read straight from the shard files in manifest order (no refcache reader)."""
    import polars as pl

    return pl.concat([pl.read_parquet(Path(out) / s["file"]) for s in manifest_of(out)["shards"]])


def assert_same_values(a, b, tol=1e-5):
    """Every per-token value and sum of cache b within tol of cache a, row by row (ids and token ids equal): the same
    cache from a model split another way (device map, tensor parallelism), whose sums may round differently."""
    import numpy as np

    x, y = read_cache(a), read_cache(b)
    for col in ("id", "prompt_input_ids", "chosen_input_ids", "rejected_input_ids", "mask_checksum"):
        assert x[col].to_list() == y[col].to_list(), col
    for col in ("chosen_logps", "rejected_logps"):
        got, want = np.concatenate(y[col].to_list()), np.concatenate(x[col].to_list())
        assert got.shape == want.shape and np.abs(got - want).max() <= tol, col
    for col in ("chosen_logp", "rejected_logp"):
        assert np.allclose(y[col].to_numpy(), x[col].to_numpy(), rtol=0, atol=tol * 50), col


# ---------------------------------------------------------------------------------------------------------------
# a train-dpo output folder and run


def records(out: Path) -> list[dict]:
    """Every record of metrics.jsonl."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_records(out: Path) -> dict[int, dict]:
    """Training-step records (the ones with a loss) by step."""
    return {r["step"]: r for r in records(out) if "loss" in r}


@contextlib.contextmanager
def count_models():
    """Record the class of every transformers model constructed (a CausalLM builds its inner base model too)."""
    import pytest
    import transformers

    built: list[str] = []
    original = transformers.PreTrainedModel.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.PreTrainedModel, "__init__", counting)
        yield built


def assert_close(a: float, b: float, what: str, tol: float = 1e-6):
    # Relative for large values: log-prob sums of ~-100 in float32 carry 7.6e-6 per unit in the last place.
    assert abs(a - b) <= tol * max(1.0, abs(a)), f"{what}: {a} vs {b}"


# ---------------------------------------------------------------------------------------------------------------
# precompute-ref in process


def precompute_cli(*args):
    """Run precompute-ref in process; returns click's Result (exit_code, output = stdout and stderr)."""
    from click.testing import CliRunner

    from precompute.cli import main

    return CliRunner().invoke(main, [str(a) for a in args] + ["--no-progress"], catch_exceptions=False)


def precompute_ok(*args):
    result = precompute_cli(*args)
    assert result.exit_code == 0, result.output
    return result


def made_cache(tmp_path_factory, llama_dir, name: str, rows: int, per_shard: int = 4) -> tuple[Path, Path]:
    """(a finished cache of `rows` pref_rows in shards of `per_shard`, its data file), made once in a folder `name`."""
    base = tmp_path_factory.mktemp(name)
    data = write_jsonl(base / "d.jsonl", pref_rows(rows))
    precompute_ok("--model", llama_dir, "--data", data, "--out", base / "cache", "--rows-per-shard", per_shard)
    return base / "cache", data


def encoded_job(llama_dir, tmp_path_factory, name: str, rows: int, seed: int):
    """(the model in float32, the encoded pairs of `rows` pref_rows, the pad id, the data file) for tests that score
    pairs themselves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.data import encode_rows, load_rows
    from schemas.encoding import EncodingConfig

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(llama_dir)
    data = write_jsonl(tmp_path_factory.mktemp(name) / "d.jsonl", pref_rows(rows, seed=seed))
    pairs = encode_rows(load_rows(data), tok, EncodingConfig(chat_template="auto")).pairs
    return model, pairs, tok.pad_token_id, data


def scored_now(result) -> tuple[int, int]:
    """(pairs written, pairs scored by this run) from precompute-ref's closing line."""
    import re

    m = re.search(r"(?:wrote|the cache holds) (\d+) pairs \((\d+) scored now\)", result.output)
    assert m, result.output
    return int(m.group(1)), int(m.group(2))


def assert_not_valid(out: Path):
    """Nothing in `out` reads as a usable cache."""
    import pytest

    from schemas import format as fmt
    from schemas.cache import open_cache

    assert not (Path(out) / fmt.MANIFEST).exists()
    with pytest.raises(fmt.CacheError):
        open_cache(out)


def precompute_in_process(model, data, out, rows_per_shard=10, **options) -> Path:
    """run_precompute with bad rows skipped and no progress bar (`options`: further PrecomputeConfig fields);
    returns the cache folder."""
    from precompute.job import PrecomputeConfig, run_precompute

    run_precompute(PrecomputeConfig(model=str(model), data=str(data), out=str(out), rows_per_shard=rows_per_shard,
                                    on_bad_row="skip", progress=False, **options), log=lambda m: None)
    return Path(out)


# ---------------------------------------------------------------------------------------------------------------
# audit-ref in process, and a forger's edits of a cache


def audit_streams(cache, *args, color=False):
    """audit-ref in process, as typed: (exit code, stdout, stderr)."""
    from click.testing import CliRunner

    from audit.cli import main

    result = CliRunner().invoke(main, [str(cache), *map(str, args)], color=color, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def audit_ref(cache, *args, json_path=None):
    """Run audit-ref in process; returns (exit code, JSON report or None, console output). The report must be strict
    JSON (no NaN or Infinity)."""
    import pytest
    from click.testing import CliRunner

    from audit.cli import main

    json_path = Path(json_path or Path(cache).parent / "audit.json")
    json_path.unlink(missing_ok=True)
    result = CliRunner().invoke(main, [str(cache), *map(str, args), "--json", str(json_path)], catch_exceptions=False)
    strict = lambda c: pytest.fail(f"--json wrote {c}, which is not JSON")
    report = json.loads(json_path.read_text(), parse_constant=strict) if json_path.exists() else None
    return result.exit_code, report, result.output


def fake_run(out: Path, checkpoint: Path, cache: Path) -> Path:
    """A train-dpo output folder as `_finish` leaves it: a checkpoint (or a LoRA adapter) and a run manifest naming
    the cache."""
    from schemas import format as fmt
    from schemas.stamps import model_hash
    from storage.reads import file_sha256

    from schemas.stamps import adapter_hash

    shutil.copytree(checkpoint, out)
    manifest = json.loads((cache / fmt.MANIFEST).read_text())
    run = {"kind": "refcache-train-dpo-run",
           "reference": {"cache": {"path": str(cache), "manifest_sha256": file_sha256(cache / fmt.MANIFEST),
                                   "stamps": manifest["stamps"]}, "live_model": None},
           "final_model_hash": model_hash(out) if (out / "config.json").is_file() else None}
    if (out / "adapter_config.json").is_file():  # a LoRA run: its adapter over the cache's model, as recorded
        base = manifest["stamps"]["model_hash"]
        run["peft"] = {"base_model_hash": base, "reference_model_hash": base, "final_adapter_hash": adapter_hash(out),
                       "adapter_config": json.loads((out / "adapter_config.json").read_text())}
    (out / "run-manifest.json").write_text(json.dumps(run, indent=2))
    return out


def check_of(report, name) -> dict:
    """One check of an audit-ref report, by name."""
    return next(c for c in report["checks"] if c["name"] == name)


def statuses(report) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


def edit_manifest(cache: Path, edit) -> None:
    """Apply `edit` to the manifest dict and write it back the way the writer does."""
    from schemas import format as fmt

    manifest = json.loads((cache / fmt.MANIFEST).read_text())
    edit(manifest)
    forge_manifest(cache, manifest)


def forge_manifest(cache: Path, manifest: dict) -> None:
    """Write a manifest as a forger who knows the format would: with the cache's dataset card (when it has one)
    rendered again from it, so that only the rules that own the forged content can notice."""
    from schemas import format as fmt
    from schemas.card import write_card

    fmt.write_manifest(cache, manifest)
    if (cache / fmt.CARD).is_file():
        try:
            write_card(cache, fmt.read_manifest(cache))
        except fmt.CacheError:  # a manifest too broken to render a card from: the card stays as it was
            pass


def rewrite_shard(cache: Path, name: str, edit, *, ids=False) -> None:
    """Rewrite a shard with edited rows, keeping its schema and refcache metadata, then restamp its manifest entry
    (size and sha256; with ids=True also its ids checksum, footer and manifest) so that only the content checks can
    notice."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from schemas.stamps import ids_checksum
    from storage.reads import file_sha256

    path = cache / name
    table = pq.read_table(path)
    rows = table.to_pylist()
    edit(rows)
    schema = table.schema
    if ids:
        ids_sum = ids_checksum([r["id"] for r in rows])
        schema = schema.with_metadata({**schema.metadata, b"refcache.ids_checksum": ids_sum.encode()})
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, compression="zstd")

    def restamp(manifest):
        entry = next(s for s in manifest["shards"] if s["file"] == name)
        entry.update(bytes=path.stat().st_size, sha256=file_sha256(path))
        if ids:
            entry["ids_checksum"] = ids_sum

    edit_manifest(cache, restamp)


def rewrite_top_k_shard(cache: Path, name: str, edit) -> None:
    """A top-k shard rewritten as a forger who knows the format would: its rows read in their logical types
    (fmt.read_columns), `edit`ed, written back through the writer (fmt.shard_table / write_shard: the storage
    encoding, the sums and checksums of the rows as they now are) with its footer's stamps and computation, and its
    manifest entry restamped (size and sha256)."""
    import json

    import numpy as np

    from schemas import format as fmt
    from schemas import rules
    from schemas.encoding import EncodingConfig

    path = cache / name
    meta = fmt.read_footer(path).meta
    computation = json.loads(meta["computation"])
    rows = fmt.read_columns(path).to_pylist()
    edit(rows)
    scores = {side: [fmt.TokenScores(logps=r[f"{side}_logps"], **{s: np.asarray(r[f"{side}_{s}"])
                                                                  for s in rules.TOP_K_COLUMNS}) for r in rows]
              for side in ("chosen", "rejected")}
    table = fmt.shard_table([r["id"] for r in rows], *([r[f"{p}_input_ids"] for r in rows]
                                                      for p in ("prompt", "chosen", "rejected")),
                            scores["chosen"], scores["rejected"], top_k=fmt.top_k_of(computation))
    entry = fmt.write_shard(path, table, model_hash=meta["model_hash"], tokenizer_hash=meta["tokenizer_hash"],
                            encoding=EncodingConfig.from_dict(json.loads(meta["encoding"])), computation=computation)
    manifest = fmt.read_manifest(cache)
    manifest["shards"] = [entry if e["file"] == name else e for e in manifest["shards"]]
    forge_manifest(cache, manifest)


def float32_sum(values) -> float:
    """The float64 sum of float32 values, as the writer computes a sequence's log-prob."""
    import numpy as np

    return float(np.sum(np.asarray(values, np.float32).astype(np.float64)))


# ---------------------------------------------------------------------------------------------------------------
# processes and adapters

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def run_in_session(cmd, cwd, env=None, check=True, timeout=240) -> subprocess.CompletedProcess:
    """Run a process (torchrun and its workers, or a plain one) in its own session, so a timeout kills all of it;
    offline, one thread per process. With `check`, a non-zero exit fails the test with the tails of its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


@contextlib.contextmanager
def paused_in_shard(args, shard: int, marker: Path, cwd=None, timeout: float = 240):
    """precompute-ref ARGS as a real process (tests/helpers/precompute_pause.py) stopped inside the write of its
    `shard`-th shard (counting write_table calls from 0): yields the process once it is there, then kills it -9 and
    checks it died of that (a process the test left early is killed too)."""
    env = {**os.environ, "REFCACHE_PAUSE_AT_SHARD": str(shard), "REFCACHE_PAUSE_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, str(HELPERS / "precompute_pause.py"), *map(str, args)], env=env,
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"precompute-ref never reached the write of shard {shard}"
            time.sleep(0.05)
        yield proc
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def make_lora_adapter(model_dir: Path, out: Path, seed: int = 3) -> Path:
    """A LoRA adapter with non-zero B (an 'SFT LoRA': merging it changes the model), saved in peft format."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    wrapped.save_pretrained(out, safe_serialization=True)
    return out


SCALED_MODELING = '''from transformers import LlamaForCausalLM

from .scale import FACTOR


class ScaledLlamaForCausalLM(LlamaForCausalLM):
    """A Llama whose logits are multiplied by FACTOR (scale.py): custom code that changes what the model computes."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * FACTOR
        return out
'''


def make_custom_code_model(model_dir: Path, out: Path, factor: float = 1.0) -> Path:
    """A copy of a Llama checkpoint whose config.json auto_map loads modeling_scaled.ScaledLlamaForCausalLM from the
    folder (run only with trust_remote_code), importing FACTOR relatively from scale.py."""
    shutil.copytree(model_dir, out)
    (out / "modeling_scaled.py").write_text(SCALED_MODELING)
    (out / "scale.py").write_text(f"FACTOR = {factor!r}\n")
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_scaled.ScaledLlamaForCausalLM"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
