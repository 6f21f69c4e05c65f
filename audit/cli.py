"""audit-ref: check a reference cache end to end, without training, and report what is in it.

Without extras the cache is checked against itself: manifest, every shard file (size, sha256, schema), each shard's
metadata stamps, every row's mask checksum recomputed from its stored ids, the shard and cache checksums, unique ids,
one log-prob per completion token, sums, value ranges and skipped-row counts. `--model` compares the model and
tokenizer hashes with a checkpoint and replays the reference on a sample of rows; `--data` re-encodes the data and
compares every row; `--run` checks that a train-dpo output names this cache and holds the weights it recorded.

Every check is a named result (PASS, FAIL or SKIP) and all of them run. A check whose input is already known to be
wrong is not run on it: a shard that fails `shard_files` is left out of the row checks (its content may not even
parse), the cache checksum waits for the shard checksums, the replay for the model hash and the data comparison for
the tokenizer hash. So each corruption is reported once, by the check that owns it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import click

from runtime.cli import quiet_libraries, run_cli
from runtime.paths import check_apart
from schemas import format as fmt
from schemas.files import atomic_write, check_destination

from .cache import audit_cache
from .checks import FAIL, PASS, SECTIONS, SKIP, Check
from .replay import audit_model
from .report import _jsonable, render, token_stats
from .runs import audit_data, audit_run

EXIT_OK, EXIT_CHECK_FAILED = 0, 1
DEFAULT_SAMPLE = 100


def run_audit(cache_dir, *, model=None, data=None, run=None, sample=DEFAULT_SAMPLE, seed=0, tolerance=None,
              trust_remote_code=False) -> dict:
    """The whole audit as a JSON-ready report. A missing or unreadable manifest raises CacheError."""
    t0 = time.perf_counter()
    root = Path(cache_dir)
    manifest = fmt.read_manifest(root)
    timing = {}
    scan = audit_cache(root, manifest)
    checks = list(scan.checks)
    timing["cache_s"] = time.perf_counter() - t0
    tokenizer, tokenizer_ok = None, False
    if model:
        t = time.perf_counter()
        more, tokenizer, tokenizer_ok = audit_model(root, manifest, scan, model, sample=sample, seed=seed,
                                                    tolerance=tolerance, trust_remote_code=trust_remote_code)
        checks += more
        timing["model_s"] = time.perf_counter() - t
    else:
        checks += [Check(n, SKIP, "not requested (--model)") for n in SECTIONS["model"]]
    if not data:
        checks.append(Check("data_rows", SKIP, "not requested (--data)"))
    elif not tokenizer_ok:
        checks.append(Check("data_rows", SKIP, "needs the tokenizer the cache was made with (tokenizer_hash)"))
    elif scan.unverified:
        checks.append(Check("data_rows", SKIP, "needs every shard to pass shard_files"))
    else:
        t = time.perf_counter()
        checks.append(audit_data(manifest, scan, data, tokenizer))
        timing["data_s"] = time.perf_counter() - t
    if run:
        t = time.perf_counter()
        checks += audit_run(root, manifest, run)
        timing["run_s"] = time.perf_counter() - t
    else:
        checks += [Check(n, SKIP, "not requested (--run)") for n in SECTIONS["run"]]
    failed = [c.name for c in checks if c.status == FAIL]
    timing["total_s"] = time.perf_counter() - t0
    return {
        "cache": str(root.resolve()),
        "result": FAIL if failed else PASS,
        "failed": failed,
        "checks": [asdict(c) for c in checks],
        "stats": {"rows": scan.index.height, "bytes": sum(e["bytes"] for e in manifest["shards"]),
                  "tokens": token_stats(scan.index), "logprobs_per_shard": scan.logprob_stats},
        "made": {k: manifest.get(k) for k in ("created_at", "software", "model", "tokenizer", "computation", "source")}
        | {"encoding": manifest["encoding"], "stamps": manifest["stamps"]},
        "options": {"model": model, "data": data, "run": run, "sample": sample, "seed": seed, "tolerance": tolerance},
        "timing": {k: round(v, 3) for k, v in timing.items()},
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.option("--model", type=click.Path(exists=True, file_okay=False),
              help="Reference checkpoint: compare model and tokenizer hashes, and replay the reference on a sample.")
@click.option("--data", type=click.Path(exists=True),
              help="Preference data: re-encode every row (needs --model for the tokenizer) and compare.")
@click.option("--run", "run_dir", type=click.Path(exists=True, file_okay=False),
              help="A train-dpo --output-dir: check that its run-manifest.json names this cache and its weights.")
@click.option("--sample", type=click.IntRange(min=0), default=None,
              help=f"Rows to replay with --model, drawn at random (0: no replay). [default: {DEFAULT_SAMPLE}]")
@click.option("--all", "replay_all", is_flag=True, help="Replay every row.")
@click.option("--seed", default=0, help="Seed of the replay sample.")
@click.option("--tolerance", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Per-token replay tolerance. [default: 1e-4 for float32, 5e-2 for bfloat16/float16, wider when "
                   "the recorded device type differs]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report as JSON here.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom model code from the checkpoint folder.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(cache, model, data, run_dir, sample, replay_all, seed, tolerance, json_path, trust_remote_code, debug):
    """Audit a precompute-ref cache: integrity, stamps, values, and optionally the model (replay), data and a
    training run that used it. Exit 0 when every check passes, 1 when any fails, 2 on a usage error or an
    unreadable cache."""
    if replay_all and sample is not None:
        raise click.UsageError("give --sample N or --all, not both")
    if data and not model:
        raise click.UsageError("--data needs --model: the rows are re-encoded with the cache's tokenizer")

    if json_path and not Path(json_path).resolve().parent.is_dir():
        raise click.UsageError(f"--json {json_path}: its folder does not exist")

    def body():
        if json_path:  # the report is an output like any other: apart from every input, the cache's files included
            check_apart(json_path, "--json", {"CACHE": cache, "--model": model, "--data": data, "--run": run_dir})
            check_destination(json_path)  # a link there is refused now, not after the audit
        if model or data:
            quiet_libraries()
        report = run_audit(cache, model=model, data=data, run=run_dir, sample=None if replay_all else
                           (DEFAULT_SAMPLE if sample is None else sample), seed=seed, tolerance=tolerance,
                           trust_remote_code=trust_remote_code)
        click.echo(render(report))
        if json_path:
            text = json.dumps(_jsonable(report), indent=2) + "\n"
            atomic_write(Path(json_path), lambda f: f.write(text.encode("utf-8")))
        sys.exit(EXIT_CHECK_FAILED if report["failed"] else EXIT_OK)

    run_cli(body, debug)


if __name__ == "__main__":
    main()
