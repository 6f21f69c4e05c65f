"""Part 5: cache size on disk, per completion token and per pair, with a per-column breakdown.

Runs precompute-ref on the embedded data/ (a trained model: real log-prob entropy) and on synthetic pairs at
sequence lengths 128, 512 and 1024 (1M model, 1k vocabulary; ids follow a Zipf-like law), then reads the Parquet
footers for the compressed size of each column. Sizes are deterministic: one run per case.

    .venv/bin/python bench/bench_size.py [--quick]
"""

from __future__ import annotations

import shutil

import common

CASES = [  # (name, model, seq, pairs)
    ("data/", "data", None, None),
    ("1M@128", "1M", 128, 256),
    ("1M@512", "1M", 512, 64),
    ("1M@1024", "1M", 1024, 32),
]


def without_float_dictionary(cache_dir) -> int:
    """Bytes the same shards would take with dictionary encoding left off the float columns (a what-if: random-looking
    float32 values defeat the dictionary, and its fallback costs more than plain encoding)."""
    import io

    import pyarrow.parquet as pq

    from schemas.cache import open_cache

    total = 0
    for path in open_cache(cache_dir).shard_paths:
        table = pq.read_table(path)
        keep = [n for n in table.column_names if "logp" not in n]
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd", use_dictionary=keep)
        total += len(buf.getvalue())
    return total


def bench_case(name, model, seq, pairs, work) -> dict:
    if model == "data":
        model_dir, data = common.sft_data()
    else:
        model_dir, data = common.synthetic_case(work, model, pairs, seq, seed=3, name=f"data-{seq}")
    out = work / f"cache-{seq}"
    r = common.precompute(model_dir, data, out, seq)
    cols = common.column_bytes(out)
    no_dict = without_float_dictionary(out)
    completion = r["bytes"] / r["bytes_per_completion_token"]
    manifest = (out / "manifest.json").stat().st_size
    shutil.rmtree(out, ignore_errors=True)
    return {
        "case": name, "pairs": r["rows"], "tokens": r["tokens"], "completion_tokens": round(completion),
        "bytes": r["bytes"], "manifest_bytes": manifest,
        "bytes_per_completion_token": r["bytes_per_completion_token"], "bytes_per_pair": r["bytes"] / r["rows"],
        "columns": cols,
        "logps_bytes_per_completion_token": (cols.get("chosen_logps", 0) + cols.get("rejected_logps", 0)) / completion,
        "bytes_without_float_dictionary": no_dict,
        "bytes_per_completion_token_without_float_dictionary": no_dict / completion,
    }


def main():
    args = common.parser(__doc__).parse_args()
    common.quiet()
    results = []
    with common.workdir("size") as work:
        for case in CASES[:3] if args.quick else CASES:
            r = bench_case(*case, work)
            results.append(r)
            print(f"{r['case']:<8} {r['pairs']:>4} pairs {r['bytes'] / 1e3:8.1f} kB  "
                  f"{r['bytes_per_completion_token']:.2f} B/completion token "
                  f"(log-probs {r['logps_bytes_per_completion_token']:.2f})  {r['bytes_per_pair']:.0f} B/pair", flush=True)
    print(f"wrote {common.save('size', {'cases': results}, args)}")


if __name__ == "__main__":
    main()
