"""The harness of the bench/ suite (no measurement of its own): environment, device, model and data builders, child
processes (`run_child`, `child_parser`/`child_argv`, `rounds`: configurations round-robin over processes,
`run_process`: a command as a user runs it) and results (`parser`, `save`, `workdir`). Everything is built locally
at fixed seeds (Llama-style models, a word-level tokenizer so lengths are exact, synthetic pairs); nothing from a hub.
"""

from __future__ import annotations

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
if "HF_HOME" not in os.environ:  # a private cache (datasets' too), removed at exit; child processes inherit it
    import atexit
    import shutil as _shutil

    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="refcache-bench-hf-")
    atexit.register(_shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(os.environ["HF_HOME"], "datasets"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DATASETS_VERBOSITY", "error")

import contextlib
import datetime
import json
import platform
import shutil
import statistics  # noqa: F401  (the parts read common.statistics)
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
RESULTS = BENCH / "results"
DATA = REPO / "data"
sys.path.insert(0, str(REPO))

LOADAVG_START = round(os.getloadavg()[0], 2)  # 1-minute load average when the part started

# device

def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def dtype_name(dev: torch.device) -> str:
    return "bfloat16" if dev.type == "cuda" else "float32"  # what precompute-ref's dtype=auto picks


def torch_dtype(dev: torch.device) -> torch.dtype:
    return getattr(torch, dtype_name(dev))


def sync(dev=None) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def quiet() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# models: Llama-style, built from a config at a fixed seed. Parameter counts include the (untied) embeddings.

MODELS = {
    #        hidden layers heads kv  inter  vocab
    "1M":   dict(hidden=128, layers=4, heads=4, kv=2, inter=384, vocab=1024),      # ~0.9M, like data/sft-model
    "5M":   dict(hidden=256, layers=4, heads=4, kv=2, inter=768, vocab=4096),      # ~5M
    "35M":  dict(hidden=512, layers=8, heads=8, kv=4, inter=1536, vocab=8192),     # ~35M
    "115M": dict(hidden=768, layers=12, heads=12, kv=4, inter=2048, vocab=24576),  # ~113M, 453 MB of fp32 weights
    "350M": dict(hidden=1024, layers=24, heads=16, kv=8, inter=2816, vocab=32000),  # GPU only
}


def build_llama(name_or_spec, seed: int = 0, max_positions: int = 2048, vocab: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = MODELS[name_or_spec] if isinstance(name_or_spec, str) else name_or_spec
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab or s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def word_tokenizer(vocab: int):
    """A word-level tokenizer: '<pad>' '<s>' '</s>' then 'w3' .. 'w{vocab-1}', one token per space-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=4096)


def make_checkpoint(root: Path, name: str, seed: int = 0, spec: dict | None = None, max_positions: int = 2048) -> Path:
    """Save model `name` (MODELS[name], or `spec`) and its word tokenizer under root/model-name (reused if there)."""
    path = Path(root) / f"model-{name}"
    if not (path / "config.json").exists():
        spec = spec or MODELS[name]
        build_llama(spec, seed, max_positions).save_pretrained(path, safe_serialization=True)
        word_tokenizer(spec["vocab"]).save_pretrained(path)
    return path


# data: synthetic standard-format preference pairs with exact token lengths

def synthetic_pairs(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """n pairs whose chosen and rejected sequences (BOS + prompt + completion + EOS) hold between seq_len/2 and
    seq_len tokens: prompt and each completion are each a quarter to a half of seq_len. Words follow a Zipf-like
    law over the vocabulary, like text."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(3, vocab)
    p = 1.0 / (ranks - 2 + 10.0)
    p /= p.sum()

    def words(k):
        return " ".join(f"w{i}" for i in rng.choice(ranks, size=k, p=p))

    # Completions start with a space so that text-level concatenation (TRL tokenizes prompt + completion as one
    # string) gives the same words; refcache tokenizes the two separately and the space changes nothing.

    lo, hi = seq_len // 4, seq_len // 2 - 1
    rows = []
    for i in range(n):
        prompt = words(int(rng.integers(lo, hi + 1)))
        chosen = " " + words(int(rng.integers(lo, hi)))
        rejected = " " + words(int(rng.integers(lo, hi)))
        rows.append({"id": f"p{i:06d}", "prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def synthetic_case(work: Path, model: str, pairs: int, seq: int, seed: int, name: str = "data"):
    """(checkpoint, data file): `model` under work, `pairs` pairs of up to `seq` tokens in work/name/."""
    rows = synthetic_pairs(pairs, seq, MODELS[model]["vocab"], seed)
    return make_checkpoint(work, model), write_jsonl(Path(work) / name / "train.jsonl", rows)


def precompute(model, data, out, max_length: int | None = None, **options) -> dict:
    """precompute-ref's entry point (run_precompute), quiet, at `max_length` (None: the encoding's default)."""
    from precompute.job import PrecomputeConfig, run_precompute
    from schemas.encoding import EncodingConfig

    encoding = EncodingConfig() if max_length is None else EncodingConfig(max_length=max_length)
    return run_precompute(PrecomputeConfig(model=str(model), data=str(data), out=str(out), progress=False,
                                           encoding=encoding, **options), log=lambda m: None)


def sft_data() -> tuple[Path, Path]:
    """The embedded default: data/sft-model and data/prefs (train split)."""
    return DATA / "sft-model", DATA / "prefs"


# caches: what the parts read back from a cache precompute-ref wrote (its shards as the manifest lists them, never a
# glob: an updated cache keeps the earlier versions' shards beside the current ones)

def column_bytes(cache) -> dict:
    """Compressed bytes of each column over the cache's shards, from their Parquet footers."""
    import pyarrow.parquet as pq

    from schemas.cache import open_cache

    sizes = {}
    for path in open_cache(cache).shard_paths:
        meta = pq.ParquetFile(path).metadata
        for g in range(meta.num_row_groups):
            for c in range(meta.row_group(g).num_columns):
                col = meta.row_group(g).column(c)
                name = col.path_in_schema.split(".")[0]
                sizes[name] = sizes.get(name, 0) + col.total_compressed_size
    return sizes


def max_abs_diff(cache, reference) -> float:
    """The largest per-token log-prob difference between two caches of the same rows (matched by id)."""
    from schemas.cache import read_cache

    columns = ("id", "chosen_logps", "rejected_logps")
    a, b = (read_cache(c).select(columns).collect().sort("id") for c in (cache, reference))
    if a["id"].to_list() != b["id"].to_list():
        raise AssertionError(f"{cache} and {reference} do not hold the same rows")
    return max(float(np.abs(np.concatenate(a[c].to_list()) - np.concatenate(b[c].to_list())).max())
               for c in ("chosen_logps", "rejected_logps"))


# timing

def run_child(args: list[str], env: dict | None = None, timeout: float = 1800) -> dict:
    """Run `python <args>` and return the JSON object it prints on its last stdout line."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"child {args} printed no JSON:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def child_argv(script: str, mode: str, **options) -> list[str]:
    """The argv of `script --child MODE --name value ...` (underscores in names become dashes; None is left out)."""
    argv = [script, "--child", mode]
    for name, value in options.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def rounds(n: int, modes, argv, show=lambda r: "") -> dict:
    """Run every configuration's child process (`argv(mode)`) once per round, in turn (a, b, c, a, b, c, ...), so
    that load from other processes falls on all of them alike; {mode: [result of each round]}. A configuration whose
    child reports an "error" is not run again."""
    out = {m: [] for m in modes}
    for i in range(n):
        for mode in modes:
            if out[mode] and "error" in out[mode][-1]:
                continue
            t = time.perf_counter()
            out[mode].append(run_child(argv(mode)))
            print(f"round {i} {mode:<7} {show(out[mode][-1])} [{time.perf_counter() - t:.0f} s]", flush=True)
    return out


def run_process(cmd: list[str], log: Path) -> dict:
    """Run a command as a user would (output to `log`); its wall seconds, and its own CPU seconds and peak RSS from
    wait4 (the rusage of this child alone, not of every child so far)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({os.waitstatus_to_exitcode(status)}):\n{log.read_text()[-4000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "maxrss_mb": usage.ru_maxrss / 1024}


def has_trl() -> bool:
    try:
        import trl  # noqa: F401  (availability probe)
        return True
    except ImportError:
        return False


# machine line and results

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    import transformers

    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    dev = device()
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "device": dev.type,
        "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
        "loadavg_1min": round(os.getloadavg()[0], 2),  # other processes on the machine, at the end of the part
        "dtype": dtype_name(dev), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_line(m: dict) -> str:
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    return (f"{m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['memory_gb']} GiB{gpu}; "
            f"device {m['device']} ({m['dtype']}); python {m['python']}, torch {m['torch']}, transformers "
            f"{m['transformers']}, trl {m['trl'] or 'not installed'}; {m['date']}")


def result_path(part: str, quick: bool = False, results: Path = RESULTS) -> Path:
    """<results>/<part>-<device>[-quick].json: a --quick run never overwrites the committed full run's."""
    return Path(results) / f"{part}-{device().type}{'-quick' if quick else ''}.json"


def save(part: str, result: dict, args) -> Path:
    """Write the part's results (result_path, under args.results) and return the path."""
    result = {"part": part, "quick": args.quick, "machine": machine(), "loadavg_start": LOADAVG_START,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), **result}
    path = result_path(part, args.quick, args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    return path


@contextlib.contextmanager
def workdir(prefix: str):
    """A scratch folder for one part's models, data and caches, removed when the part ends (or fails)."""
    path = Path(tempfile.mkdtemp(prefix=f"refcache-bench-{prefix}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fmt_s(st: dict, unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    """'median (min-max)' of a stats dict."""
    return (f"{st['median'] * scale:.{digits}g} {unit} ({st['min'] * scale:.{digits}g}-{st['max'] * scale:.{digits}g})")


def parser(doc: str):
    import argparse

    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for a run in a few minutes")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON results (default bench/results)")
    return ap


def child_parser(doc: str, children, paths=("model", "data", "cache", "out"), ints=("seq", "batch", "warmup", "steps")):
    """`parser` plus what the parent starts a child with: --child NAME, path and integer size options."""
    ap = parser(doc)
    ap.add_argument("--child", choices=children)
    for name in paths:
        ap.add_argument(f"--{name}")
    for name in ints:
        ap.add_argument(f"--{name}", type=int)
    return ap
