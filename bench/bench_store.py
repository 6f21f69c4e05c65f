"""Named-only part: a cache on an object store (s3://, a moto S3 server on 127.0.0.1 started here) against the same
cache on local disk, round-robin (median of reps after a warm-up):
  precompute   run_precompute --out DIR vs --out s3://bucket/prefix
  verify       open_cache (manifest, every shard's size and sha256, footers, index columns)
  train        run_train --ref-cache DIR vs s3://... (verification, the columns it trains on, a few steps)
The server runs in this process (ThreadedMotoServer), sharing the cores with the job: the ratio is an upper bound of
what the storage layer adds (HTTP, hashing while streaming, one object per request), not a network. Both caches are
compared value by value.

    .venv/bin/python bench/bench_store.py [--quick]
"""

from __future__ import annotations

import os
import shutil
import socket

import common
import measure

QUICK = dict(model="1M", seq=128, pairs=64, rows_per_shard=16, steps=2, reps=3)
FULL = dict(model="5M", seq=256, pairs=256, rows_per_shard=32, steps=4, reps=3)
BUCKET = "refcache-bench"


def start_server():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    return server, fs


def main():
    args = common.parser(__doc__).parse_args()
    common.quiet()
    size = QUICK if args.quick else FULL
    server, fs = start_server()
    try:
        with common.workdir("store") as work:
            result = time_store(work, size, fs)
    finally:
        server.stop()
    t = result["wall"]
    for what in ("precompute", "verify", "train"):
        print(f"{what:>10}: local {common.fmt_s(t[f'{what}-local'])}  s3 {common.fmt_s(t[f'{what}-s3'])}  "
              f"s3 / local x{result['ratio_s3_vs_local'][what]:.2f}")
    print(f"wrote {common.save('store', {'size': size, **result}, args)}")


def time_store(work, size: dict, fs) -> dict:
    from dpo.config import TrainConfig
    from dpo.recipe import run_train
    from schemas.cache import open_cache, read_cache

    model_dir, data = common.synthetic_case(work, size["model"], size["pairs"], size["seq"], seed=8)
    caches = {"local": work / "cache", "s3": f"s3://{BUCKET}/bench/cache"}

    def clear(where):
        if where == "s3":
            fs.invalidate_cache()
            if fs.exists(caches["s3"].removeprefix("s3://")):
                fs.rm(caches["s3"].removeprefix("s3://"), recursive=True)
        else:
            shutil.rmtree(caches["local"], ignore_errors=True)

    def precompute(where):
        clear(where)
        common.precompute(model_dir, data, caches[where], size["seq"], rows_per_shard=size["rows_per_shard"])

    def train(where):
        out = work / f"run-{where}"
        shutil.rmtree(out, ignore_errors=True)
        cfg = TrainConfig(model=str(model_dir), data=str(data), output_dir=str(out), ref_cache=str(caches[where]),
                          max_steps=size["steps"], save_strategy="no", plot=False, learning_rate=1e-3,
                          per_device_train_batch_size=4, logging_steps=1, seed=42, use_cpu=True, report_to="none")
        run_train(cfg, log=lambda m: None)

    fns = {f"{what}-{where}": (lambda what=what, where=where: {"precompute": precompute, "train": train,
                                                               "verify": lambda w: open_cache(caches[w])}[what](where))
           for what in ("precompute", "verify", "train") for where in ("local", "s3")}
    times = measure.interleaved(fns, reps=size["reps"], warmup=1)
    same = read_cache(caches["s3"]).collect().equals(read_cache(caches["local"]).collect())
    assert same, "the s3 cache's values differ from the local cache's"
    manifest = open_cache(caches["local"]).manifest
    return {"wall": times, "ratio_s3_vs_local": {w: measure.ratio(times[f"{w}-s3"], times[f"{w}-local"])
                                                 for w in ("precompute", "verify", "train")},
            "cache_bytes": sum(e["bytes"] for e in manifest["shards"]), "shards": len(manifest["shards"]),
            "same_values": same}


if __name__ == "__main__":
    main()
