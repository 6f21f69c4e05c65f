"""Helpers shared by the fault-injection suite (tests/faults/test_fault_*.py): the three commands run in process, the
launcher for real subprocesses (tests/helpers/fault_launcher.py), and the tools a forger would use on a cache
(rewrite a shard, restamp the manifest).

Not a conftest (that name belongs to tests/conftest.py): the test modules import it by name, which works because
pytest puts this folder on sys.path when it collects them.

The fault matrix is cross-cutting (each case drives precompute-ref, train-dpo and audit-ref end to end and checks
what all three do with the same damage), so it has its own folder rather than a room.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from schemas import format as fmt
from schemas.encoding import EncodingConfig
from schemas.stamps import combined_mask_checksum, ids_checksum
from storage.reads import file_sha256
from support import forge_manifest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BIN = Path(sys.executable).parent
LAUNCHER = REPO / "tests" / "helpers" / "fault_launcher.py"
EXIT_REFUSED = 2

# train-dpo options that make a run tiny; refusals happen before any of them matter
TRAIN = ["--use-cpu", "--max-steps", "1", "--per-device-train-batch-size", "4", "--learning-rate", "1e-3",
         "--logging-steps", "1", "--no-plot"]


# ---------------------------------------------------------------------------------------------------------------
# the commands, in process


def invoke(main, args):
    """Run a click command in process; returns click's Result (exit_code, output = stdout + stderr, stderr)."""
    return CliRunner().invoke(main, [str(a) for a in args])


def precompute(*args):
    from precompute.cli import main

    return invoke(main, [*args, "--no-progress"])


def train(*args):
    from dpo.cli import main

    return invoke(main, args)


def audit(cache, *args, json_path=None):
    """audit-ref in process: (exit code, JSON report or None, output)."""
    from audit.cli import main

    json_path = Path(json_path or Path(cache).parent / f"audit-{Path(cache).name}.json")
    json_path.unlink(missing_ok=True)
    result = invoke(main, [cache, *args, "--json", json_path])
    report = json.loads(json_path.read_text()) if json_path.exists() else None
    return result.exit_code, report, result.output


def failed_checks(report) -> set[str]:
    return {c["name"] for c in report["checks"] if c["status"] == "FAIL"}


def check_of(report, name) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def assert_one_paragraph(output: str):
    """The refusal is one error paragraph: starts with 'error:', no traceback, no blank line inside it."""
    assert "Traceback" not in output, output
    text = output[output.index("error:"):].strip() if "error:" in output else output.strip()
    assert "\n\n" not in text, output


# ---------------------------------------------------------------------------------------------------------------
# real processes


def env(**extra) -> dict:
    e = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    e.update({k: str(v) for k, v in extra.items()})
    return e


def launch(command: str, args, **fault) -> subprocess.Popen:
    """Start `fault_launcher.py COMMAND ARGS` with the fault described by FAULT_* variables."""
    return subprocess.Popen([sys.executable, str(LAUNCHER), command, *map(str, args)], cwd=REPO,
                            env=env(**{f"FAULT_{k.upper()}": v for k, v in fault.items()}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Zygote:
    """Real processes, forked from one interpreter that imported the commands once (fault_launcher.py --zygote).

    `runs` maps a name to (command, args, fault), fault being FAULT_* settings in lower case without the prefix."""

    def __init__(self, workdir: Path, runs: dict):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = []
        for name, (command, args, fault) in runs.items():
            spec.append({"name": name, "command": command, "args": [str(a) for a in args],
                         "env": {f"FAULT_{k.upper()}": str(v) for k, v in fault.items()},
                         **{k: str(self.dir / f"{name}.{k}") for k in ("stdout", "stderr", "status")}})
        (self.dir / "runs.json").write_text(json.dumps(spec))
        self.proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--zygote", str(self.dir / "runs.json")],
                                     cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)  # its own process group: close() ends the children too

    def result(self, name: str, timeout=300) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of a run, once it has ended."""
        status = self.dir / f"{name}.status"
        deadline = time.monotonic() + timeout
        while not status.exists():
            if self.proc.poll() is not None and not status.exists():
                raise AssertionError(f"the zygote ended ({self.proc.returncode}) without {name}:\n"
                                     f"{self.proc.stderr.read()}")
            assert time.monotonic() < deadline, f"{name} did not end within {timeout} s"
            time.sleep(0.05)
        return (int(status.read_text()), (self.dir / f"{name}.stdout").read_text(),
                (self.dir / f"{name}.stderr").read_text())

    def close(self):
        """End the zygote and any child still running (a test that failed half way)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.communicate()


def wait_for(path: Path, proc: subprocess.Popen, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended ({proc.returncode}) before {path.name}:\n{proc.stderr.read()}")
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------------------
# looking at a cache directory


def file_hashes(out: Path, pattern="*") -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(out).glob(pattern)) if p.is_file()}


def manifest_of(root: Path) -> dict:
    return json.loads((Path(root) / fmt.MANIFEST).read_text())


def copy_tree(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst, symlinks=True))


# ---------------------------------------------------------------------------------------------------------------
# forging: what someone who knows FORMAT.md can do to a cache


def write_manifest(root: Path, manifest: dict):
    forge_manifest(Path(root), manifest)  # with the dataset card rendered again, as a forger would


def edit_manifest(root: Path, edit):
    m = manifest_of(root)
    edit(m)
    write_manifest(root, m)


def restamp(root: Path, *names, rows=False, checksums=False):
    """Rewrite the manifest entries of shards to match their files: size and sha256, and optionally the row count and
    the shard mask and ids checksums (from the shard's own mask_checksum and id columns)."""
    root = Path(root)
    m = manifest_of(root)
    enc = EncodingConfig.from_dict(m["encoding"]).to_json()
    for entry in m["shards"]:
        if entry["file"] in names:
            path = root / entry["file"]
            entry.update(bytes=path.stat().st_size, sha256=file_sha256(path))
            if rows:
                entry["rows"] = pq.ParquetFile(path).metadata.num_rows
            if checksums:
                table = pq.read_table(path, columns=["id", "mask_checksum"])
                entry["mask_checksum"] = combined_mask_checksum(table.column("mask_checksum").to_pylist(), enc)
                entry["ids_checksum"] = ids_checksum(table.column("id").to_pylist())
    write_manifest(root, m)


def rewrite_rows(root: Path, name: str, edit, *, metadata_edit=None):
    """Rewrite a shard's rows (list of dicts) keeping its schema and refcache metadata (or editing the metadata)."""
    path = Path(root) / name
    table = pq.read_table(path)
    rows = table.to_pylist()
    rows = edit(rows) or rows
    meta = dict(table.schema.metadata or {})
    if metadata_edit:
        metadata_edit(meta)
    new = pa.Table.from_pylist(rows, schema=table.schema.remove_metadata()).replace_schema_metadata(meta)
    pq.write_table(new, path, compression="zstd")


def set_metadata(root: Path, name: str, key: str, value: str):
    rewrite_rows(root, name, lambda rows: rows,
                 metadata_edit=lambda meta: meta.__setitem__((fmt.META_PREFIX + key).encode(), value.encode()))
