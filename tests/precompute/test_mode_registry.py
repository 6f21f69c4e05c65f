"""The registry of batching modes: adding a mode is one new class and one registry line, and auto, the probe,
--batching (choices and help), the manifest and the README's table of modes all follow it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import build_llama, pref_rows, write_jsonl
from precompute import modes
from precompute.modes import REGISTRY, choose_mode, score_pairs
from precompute.modes.full_forward import FullForward
from schemas.encoding import EncodedPair

README = Path(__file__).resolve().parents[2] / "README.md"

# A new mode, as a module of its own would hold it: the plain padded forward under another name, estimated cheap.
TOY_MODULE = '''
from precompute.modes.full_forward import FullForward


class Toy(FullForward):
    name = "toy"
    description = "the padded forward again, estimated at almost no work"
    runs_with = "any model"
    offset = 0.0  # added to every value: a wrong mode

    def estimated_cost(self, pairs, token_budget, hidden):
        return 1.0

    def in_auto(self, attn):
        return True

    def score(self, model, pairs, batch, pad_id, top_k=0):
        order, values, counts = super().score(model, pairs, batch, pad_id, top_k)
        return order, [v.map(lambda x: x + self.offset) for v in values], counts
'''


@pytest.fixture(scope="module")
def toy_class():
    namespace: dict = {}
    exec(compile(TOY_MODULE, "toy_mode.py", "exec"), namespace)
    return namespace["Toy"]


@pytest.fixture(scope="module")
def model_and_pairs():
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(3, 250, n).tolist()
    pairs = [EncodedPair(ids(p), ids(c), ids(r)) for p, c, r in ((3, 4, 2), (7, 2, 5), (12, 6, 6), (30, 9, 4))]
    return build_llama(260), pairs


def test_a_registered_mode_is_scored_weighed_and_probed(toy_class, model_and_pairs, monkeypatch):
    model, pairs = model_and_pairs
    monkeypatch.setitem(REGISTRY, "toy", toy_class())  # the one registry line
    assert modes.candidates("sdpa")[0] == "toy" and "toy" not in modes.MODES  # MODES: those registered at import
    want, got = score_pairs(model, pairs, 0, 64, "full_forward"), score_pairs(model, pairs, 0, 64, "toy")
    assert len(got[0]) == len(got[1]) == len(want[0]) == len(pairs)  # zip below would stop at the shorter
    assert all(np.array_equal(a.logps, b.logps) for a, b in zip(want[0] + want[1], got[0] + got[1]))
    assert want[2] == got[2]
    messages = []
    assert choose_mode(model, "auto", pairs, 39, 0, 4096, messages.append) == "toy"
    assert messages[0].startswith("batching: toy (sdpa attention; estimated ")
    assert "toy: the padded forward again, estimated at almost no work." in modes.batching_help()
    assert "| `toy` | the padded forward again" in modes.readme_table()
    # A registered mode gets no trust: one that is off is turned down by the probe, like any other.
    monkeypatch.setattr(REGISTRY["toy"], "offset", 0.01, raising=False)
    messages.clear()
    assert choose_mode(model, "auto", pairs, 39, 0, 4096, messages.append) != "toy"
    assert "instead of toy: differs from the reference forward by 1.00e-02" in messages[0]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown batching mode 'toy'"):
        score_pairs(model, pairs, 0, 64, "toy")


def test_the_command_line_takes_a_registered_mode(llama_dir, tmp_path):
    """A fresh process: the new module, the registry line, then precompute-ref as it is (--help, a run)."""
    (tmp_path / "toy_mode.py").write_text(TOY_MODULE)
    launcher = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from precompute.modes import REGISTRY
        from toy_mode import Toy
        REGISTRY["toy"] = Toy()
        from precompute.cli import main
        main()
    """)
    env = {**os.environ, "COLUMNS": "200"}

    def run(*args):
        return subprocess.run([sys.executable, "-c", launcher, *map(str, args)], capture_output=True, text=True,
                              env=env, timeout=300)

    helped = run("--help")
    assert helped.returncode == 0, helped.stderr
    text = " ".join(helped.stdout.split())
    assert "[auto|full_forward|varlen|kv_cache|shared_prompt|packed|single|toy]" in text
    assert "toy: the padded forward again, estimated at almost no work." in text
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(6, seed=2))
    done = run("--model", llama_dir, "--data", data, "--out", tmp_path / "out", "--batching", "toy", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "batching: toy (sdpa attention; matches the reference forward on a probe)" in done.stderr
    computation = json.loads((tmp_path / "out" / "manifest.json").read_text())["computation"]
    assert computation["mode"] == "toy"
    assert computation["batching"] == "the padded forward again, estimated at almost no work"


def test_every_mode_has_a_description_and_its_own_name():
    assert list(REGISTRY) == list(modes.MODES) and "auto" not in REGISTRY
    for name, mode in REGISTRY.items():
        assert mode.name == name and mode.description and mode.runs_with, name
        assert type(mode).plan is not modes.BatchingMode.plan and type(mode).score is not modes.BatchingMode.score
    assert len({m.description for m in REGISTRY.values()}) == len(REGISTRY)  # the manifest tells them apart
    assert isinstance(REGISTRY["full_forward"], FullForward)


def test_the_readme_table_lists_the_registered_modes():
    """The README's table of modes is readme_table() as it stands (print it and paste it after adding a mode)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  | mode | what it does"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("  |"))
    assert "\n".join(lines[start:end]) == modes.readme_table(), modes.readme_table()
    named = [re.match(r"  \| `(\w+)` \|", line).group(1) for line in lines[start + 2 : end]]
    assert named == list(REGISTRY)
