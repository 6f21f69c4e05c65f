"""Part 3: cache verification time per GB and per million rows, and model-hash throughput against sha256sum.

A large synthetic cache is written with schemas.format (no model): one shard's worth of rows (64-192 tokens, Zipf-like
ids over 32k, negative float32 log-probs), reused by every shard under new row ids, which gives the verifier the work
of a real cache of that size. Timed, page cache warm: open_cache (with and without the sha256), check_rows (train-dpo's
row check), check_values (every cached log-prob read and checked) and verify (all): train-dpo's verification minus
encoding the data (see verify_and_join on data/). Model hashing in a child (`--child hash`), a few runs: a ~200 MB
safetensors checkpoint hashed by schemas.stamps.model_hash and file_sha256 and by `sha256sum` and `openssl dgst`
where present; best of `--repeat` within a run, the median over runs.

    .venv/bin/python bench/bench_verify.py [--quick]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import common
import measure
import numpy as np

ROWS_PER_SHARD = 2048


def build_cache(root: Path, shards: int, seed: int = 0) -> dict:
    """Write `shards` shards of ROWS_PER_SHARD rows and a manifest; return the expected {id: checksum}."""
    import pyarrow as pa

    from schemas import format as fmt
    from schemas.encoding import EncodingConfig
    from schemas.stamps import combined_mask_checksum

    rng = np.random.default_rng(seed)
    vocab = 32000
    ranks = np.arange(3, vocab)
    p = 1.0 / (ranks - 2 + 10.0)
    p /= p.sum()
    n = ROWS_PER_SHARD
    lens = rng.integers(64, 193, size=(n, 3))
    ids = [rng.choice(ranks, size=int(k), p=p).tolist() for k in lens.ravel()]
    prompt, chosen, rejected = ids[0::3], ids[1::3], ids[2::3]
    logps = lambda seqs: [(-rng.exponential(2.0, len(s))).astype(np.float32) for s in seqs]
    base = fmt.shard_table([f"x{i}" for i in range(n)], prompt, chosen, rejected, logps(chosen), logps(rejected))
    checks = base.column("mask_checksum").to_pylist()
    encoding = EncodingConfig()
    stamps = {"model_hash": "a" * 64, "tokenizer_hash": "b" * 64}
    computation = {"dtype": "float32", "device_type": "cpu", "mode": "full_forward", "attn_implementation": "sdpa"}
    root.mkdir(parents=True, exist_ok=True)
    entries, expected = [], {}
    for s in range(shards):
        row_ids = [f"shard{s:05d}-row{i:05d}" for i in range(n)]
        table = base.set_column(0, "id", pa.array(row_ids, pa.string()))
        entries.append(fmt.write_shard(root / f"shard-{s:05d}.parquet", table, encoding=encoding,
                                       computation=computation, **stamps))
        expected.update(zip(row_ids, checks))
    manifest = {
        "format_version": fmt.FORMAT_VERSION,
        "stamps": {**stamps, "mask_checksum": combined_mask_checksum(checks * shards, encoding.to_json())},
        "encoding": encoding.to_dict(), "rows": n * shards, "computation": computation, "shards": entries,
    }
    fmt.write_manifest(root, manifest)
    return expected


def bench_cache(shards: int, reps: int, work: Path) -> dict:
    from dpo.verify import check_values
    from schemas.cache import open_cache
    from schemas.rules import row_findings, use_findings

    root = work / f"cache-{shards}"
    t = time.perf_counter()
    expected = build_cache(root, shards)
    build_s = time.perf_counter() - t
    size = sum(p.stat().st_size for p in root.glob("*.parquet"))
    rows = len(expected)
    ids = list(expected)
    cache = open_cache(root)

    def check_rows(c):
        assert not row_findings(c.index, expected)

    def verify_all():
        c = open_cache(root)
        assert not list(use_findings(c, model_hash="a" * 64, tokenizer_hash="b" * 64, rows=lambda encoding: expected))
        check_values(c, ids)

    times = measure.interleaved({
        "open_cache": lambda: open_cache(root),
        "open_cache_fast": lambda: open_cache(root, verify_files=False),
        "check_rows": lambda: check_rows(cache),
        "check_values": lambda: check_values(cache, ids),
        "verify_all": verify_all,
    }, reps=reps, warmup=1)
    shutil.rmtree(root, ignore_errors=True)
    total = times["verify_all"]["median"]
    return {"shards": shards, "rows": rows, "bytes": size, "build_s": build_s, "times": times,
            "s_per_gb": total / (size / 1e9), "s_per_million_rows": total / (rows / 1e6),
            "per_gb": {k: v["median"] / (size / 1e9) for k, v in times.items()},
            "per_million_rows": {k: v["median"] / (rows / 1e6) for k, v in times.items()}}


def bench_data_verify(reps: int, work: Path) -> dict:
    """train-dpo's verify_and_join on the embedded data/ (400 pairs), tokenizer encoding included."""
    from dpo.verify import verify_and_join
    from runtime.checkpoint import load_tokenizer

    model_dir, data = common.sft_data()
    cache = work / "data-cache"
    common.precompute(model_dir, data, cache)
    tok = load_tokenizer(str(model_dir))
    times = measure.timeit(lambda: verify_and_join(tokenizer=tok, model_dir=str(model_dir), data=str(data),
                                                  split="train", cache_dir=str(cache), log=lambda m: None),
                          reps=reps, warmup=1)
    return {"rows": 400, "times": times}


def child_hash(mb: int, repeat: int) -> dict:
    """One run of the hashing tools on a fresh checkpoint: {tool: MB/s of its best of `repeat`}."""
    from safetensors.torch import save_file

    from schemas.stamps import model_hash
    from storage.reads import file_sha256

    with common.workdir("hash") as tmp:
        path = tmp / "model.safetensors"
        common.torch.manual_seed(0)
        save_file({f"model.layers.{i}.weight": common.torch.randn(mb * 10**6 // 32) for i in range(8)}, path,
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 1024}))
        path.read_bytes()  # warm the page cache so every tool reads from memory
        tool = lambda *cmd: lambda: subprocess.run([*cmd, str(path)], check=True, capture_output=True,
                                                   text=True).stdout.split()[0]
        tools = {"model_hash": lambda: model_hash(tmp), "file_sha256": lambda: file_sha256(path)}
        if shutil.which("sha256sum"):
            tools["sha256sum"] = tool("sha256sum")
        if shutil.which("openssl"):  # coreutils may be built without OpenSSL's SHA-NI code: both are shown
            tools["openssl dgst"] = tool("openssl", "dgst", "-sha256", "-r")
        digests = {k: fn() for k, fn in tools.items() if k != "model_hash"}
        if len(set(digests.values())) != 1:
            raise AssertionError(f"the sha256 tools disagree: {digests}")
        best = {k: measure.timeit(fn, reps=repeat, warmup=0)["min"] for k, fn in tools.items()}
        return {"mb_per_s": {k: path.stat().st_size / 1e6 / t for k, t in best.items()}}


def bench_hash(mb: int, runs: int, repeat: int) -> dict:
    """child_hash in a process of its own, `runs` times; the median over the runs of each tool's best of `repeat`."""
    outs = [common.run_child(common.child_argv(__file__, "hash", mb=mb, repeat=repeat), timeout=600)
            for _ in range(runs)]
    mbps = {k: measure.stats([o["mb_per_s"][k] for o in outs]) for k in outs[0]["mb_per_s"]}
    return {"mb": mb, "runs": runs, "repeat": repeat, "mb_per_s": mbps,
            "ratio_model_hash_vs_sha256sum": measure.ratio(mbps["model_hash"], mbps["sha256sum"])}


def main():
    args = common.child_parser(__doc__, ["hash"], paths=(), ints=("mb", "repeat")).parse_args()
    if args.child:
        print(json.dumps(child_hash(args.mb, args.repeat)))
        return
    common.quiet()
    sizes = [5, 15] if args.quick else [25, 200]  # shards of 2,048 rows (~4.8 MB each): up to ~1 GB
    with common.workdir("verify") as work:
        caches = []
        for shards in sizes:
            r = bench_cache(shards, reps=3, work=work)
            caches.append(r)
            print(f"{r['rows']:>8} rows {r['bytes'] / 1e6:7.1f} MB  verify {common.fmt_s(r['times']['verify_all'])}"
                  f"  = {r['s_per_gb']:.2f} s/GB, {r['s_per_million_rows']:.2f} s/M rows  (open_cache "
                  f"{r['per_gb']['open_cache']:.2f} s/GB, check_values {r['per_gb']['check_values']:.2f} s/GB)  "
                  f"[built in {r['build_s']:.0f} s]", flush=True)
        data = bench_data_verify(reps=5, work=work)
        print(f"verify_and_join on data/ (400 pairs): {common.fmt_s(data['times'])}", flush=True)
        hashing = bench_hash(mb=100 if args.quick else 200, runs=3, repeat=3)
        print(f"model_hash {hashing['mb_per_s']['model_hash']['median']:.0f} MB/s, sha256sum "
              f"{hashing['mb_per_s']['sha256sum']['median']:.0f} MB/s: "
              f"{hashing['ratio_model_hash_vs_sha256sum']:.2f}x", flush=True)
    print(f"wrote {common.save('verify', {'caches': caches, 'data_verify': data, 'hash': hashing}, args)}")


if __name__ == "__main__":
    main()
