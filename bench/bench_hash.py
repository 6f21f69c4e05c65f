"""model_hash throughput against `sha256sum` on the same file.

Writes a ~200 MB safetensors checkpoint (a few float32 tensors of torch.randn plus a config.json) into a temp dir,
then times, each `--repeat` times with the file in the page cache (the last line of output: the figures as JSON):
  - schemas.stamps.model_hash (mmap + hashlib over every tensor, plus the header and config),
  - storage.reads.file_sha256 (plain chunked read of the whole file),
  - the `sha256sum` command line tool, and `openssl dgst -sha256` where present.

    .venv/bin/python bench/bench_hash.py [--mb 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def best_of(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="checkpoint size in MB (10^6 bytes)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=8, help="split the weights over this many tensors")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    from schemas.stamps import model_hash
    from storage.reads import file_sha256

    tmp = Path(tempfile.mkdtemp(prefix="refcache-bench-hash-"))
    try:
        per = args.mb * 10**6 // 4 // args.tensors
        torch.manual_seed(0)
        tensors = {f"model.layers.{i}.weight": torch.randn(per) for i in range(args.tensors)}
        path = tmp / "model.safetensors"
        save_file(tensors, path, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 1024}))
        del tensors
        size_mb = path.stat().st_size / 1e6
        path.read_bytes()  # warm the page cache so every tool reads from memory

        rows = []
        t, digest = best_of(lambda: model_hash(tmp), args.repeat)
        rows.append(("model_hash", t, digest))
        t, digest = best_of(lambda: file_sha256(path), args.repeat)
        rows.append(("file_sha256", t, digest))
        if shutil.which("sha256sum"):
            def sha256sum():
                out = subprocess.run(["sha256sum", str(path)], check=True, capture_output=True, text=True)
                return out.stdout.split()[0]

            t, digest = best_of(sha256sum, args.repeat)
            rows.append(("sha256sum", t, digest))
            assert digest == rows[1][2], "file_sha256 and sha256sum disagree"
        if shutil.which("openssl"):  # coreutils may be built without OpenSSL's SHA-NI code; show both
            def openssl():
                out = subprocess.run(["openssl", "dgst", "-sha256", "-r", str(path)], check=True, capture_output=True,
                                     text=True)
                return out.stdout.split()[0]

            t, digest = best_of(openssl, args.repeat)
            rows.append(("openssl dgst", t, digest))
            assert digest == rows[1][2], "file_sha256 and openssl disagree"

        lines = [f"file: {size_mb:.1f} MB in {args.tensors} tensors, best of {args.repeat} (page cache warm)"]
        base = dict((name, t) for name, t, _ in rows).get("sha256sum")
        for name, t, digest in rows:
            rel = f"  {base / t:.2f}x sha256sum speed" if base else ""
            lines.append(f"  {name:<12} {t * 1000:8.1f} ms  {size_mb / t:8.1f} MB/s{rel}  {digest[:16]}")
        print("\n".join(lines))
        print(json.dumps({"mb_per_s": {name: size_mb / t for name, t, _ in rows}, "output": "\n".join(lines) + "\n"}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
