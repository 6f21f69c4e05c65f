"""A pytest plugin that records, per test id, the first line of every refusal a test sees: each JobError, CacheError,
DataError, WeightsError, BadRowError or RunManifestError constructed, and each 'error:' or FAIL line a command run
in process (click's CliRunner) prints. Used to show that a refactoring leaves the messages as they were:

    REFCACHE_SNAPSHOT=/tmp/before.json python -m pytest -p helpers.snapshot --basetemp=/tmp/snap tests/faults ...

(with tests/ on PYTHONPATH), once before and once after, then `python tests/helpers/snapshot.py before after`.
Paths under the temporary folders are replaced by <tmp> so two runs compare."""

from __future__ import annotations

import json
import os
import re
import sys

TMP = re.compile(r"(/private)?/tmp/[^\s'\",;:)]*")
_current = {"id": None}
_seen: dict[str, list[str]] = {}


SECONDS = re.compile(r"\b\d+\.\d+ s\b")
PID = re.compile(r"\bpid \d+")
SHA = re.compile(r"\b[0-9a-f]{64}\b")  # e.g. a manifest's sha256: the manifest records when it was written


def _norm(line: str) -> str:
    """Temporary paths, durations and process ids differ from run to run."""
    return SHA.sub("<sha256>", PID.sub("pid <n>", SECONDS.sub("<t> s", TMP.sub("<tmp>", line))))


def template(line: str) -> str:
    """A message with its data left out (numbers, quoted values, what follows a parenthesis or a colon-space after
    the kind): two runs of a property-based test draw other examples, so only the forms of their messages compare."""
    line = re.sub(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{.*\}", "<v>", line)
    line = re.sub(r"\(.*", "(…", line)
    return re.sub(r"\d+", "<n>", line)


def _record(kind: str, text: str) -> None:
    if _current["id"] is None or not text:
        return
    line = f"{kind}: {_norm(text.splitlines()[0] if text.splitlines() else text)}"
    lines = _seen.setdefault(_current["id"], [])
    if line not in lines:
        lines.append(line)


def _wrap(cls) -> None:
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _record(type(self).__name__, str(self))

    cls.__init__ = __init__


def pytest_configure(config):
    if not os.environ.get("REFCACHE_SNAPSHOT"):
        return
    from click.testing import CliRunner

    from runtime.data import DataError
    from runtime.errors import JobError
    from schemas.encoding import BadRowError
    from schemas.findings import CacheError
    from schemas.run_manifest import RunManifestError
    from schemas.stamps import WeightsError

    for cls in (JobError, CacheError, DataError, WeightsError, BadRowError, RunManifestError):
        _wrap(cls)
    invoke = CliRunner.invoke

    def recording_invoke(self, *args, **kwargs):
        result = invoke(self, *args, **kwargs)
        try:
            out = result.output
        except Exception:
            out = ""
        for line in out.splitlines():
            if line.startswith("error:") or re.search(r"\bFAIL\b", line):
                _record("cli", line.strip())
        _record("exit", str(result.exit_code))
        return result

    CliRunner.invoke = recording_invoke


def pytest_runtest_setup(item):
    _current["id"] = item.nodeid


def pytest_runtest_teardown(item):
    _current["id"] = None


def pytest_unconfigure(config):
    path = os.environ.get("REFCACHE_SNAPSHOT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_seen, f, indent=1, sort_keys=True)


RANDOM = ("tests/faults/test_fault_fuzz.py",)  # hypothesis: compared by the forms of their messages, after within before


def compare(before: str, after: str) -> int:
    a, b = ({t: [_norm(line) for line in lines] for t, lines in json.load(open(p, encoding="utf-8")).items()}
            for p in (before, after))
    differ = 0
    for test in sorted(set(a) | set(b)):
        if test in a and test in b and any(f in test for f in RANDOM):
            a[test], b[test] = sorted({template(x) for x in a[test]}), sorted({template(x) for x in b[test]})
            if set(b[test]) <= set(a[test]):
                continue
        if a.get(test) != b.get(test):
            differ += 1
            print(f"== {test}")
            for line in a.get(test) or []:
                if line not in (b.get(test) or []):
                    print(f"  - {line}")
            for line in b.get(test) or []:
                if line not in (a.get(test) or []):
                    print(f"  + {line}")
    print(f"{differ} of {len(set(a) | set(b))} tests differ")
    return differ


if __name__ == "__main__":
    sys.exit(1 if compare(sys.argv[1], sys.argv[2]) else 0)
