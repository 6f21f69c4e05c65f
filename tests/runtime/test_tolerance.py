"""runtime/tolerance.py, the one policy of "matches the plain forward": its figures per dtype, the head check's share
and the allowance across device types; that it has exactly one definition in the product (an AST scan, not a string
match); and that each of its four users (the head check, precompute-ref's probe, train-dpo's layout probe,
audit-ref's replay) goes through it: shrink the policy and each one refuses or falls back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from conftest import DATA, build_llama
from runtime import tolerance
from runtime.tolerance import head_tolerance, probe_tolerance, replay_tolerance

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("storage", "schemas", "runtime", "precompute", "dpo", "audit")
POLICY = ROOT / "runtime" / "tolerance.py"


# ---------------------------------------------------------------------------------------------------------------
# the figures


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, "float32", "float64"])
def test_full_precision_is_held_to_1e_4(dtype):
    assert probe_tolerance(dtype) == 1e-4
    assert head_tolerance(dtype) == pytest.approx(1e-5)  # a tenth: the head check is one part of every forward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16", "float16"])
def test_half_precision_is_held_to_0_25(dtype):
    assert probe_tolerance(dtype) == 0.25
    assert head_tolerance(dtype) == pytest.approx(0.025)


def test_a_dtype_the_policy_does_not_name_gets_the_low_precision_row():
    assert probe_tolerance(torch.float8_e4m3fn) == probe_tolerance("int8") == 0.25


def test_replay_widens_only_across_device_types():
    assert replay_tolerance("float32", "cpu", "cpu") == 1e-4 == probe_tolerance(torch.float32)  # the guarantee
    assert replay_tolerance("float32", None, "cuda") == replay_tolerance("float32", "", "cuda") == 1e-4  # none
    assert replay_tolerance("float32", "cuda", "cpu") == pytest.approx(1e-3)  # x10
    assert replay_tolerance("bfloat16", "cpu", "cpu") == 0.25
    assert replay_tolerance("bfloat16", "cuda", "cpu") == pytest.approx(0.5)  # x2
    assert replay_tolerance("float16", "mps", "cuda") == pytest.approx(0.5)


def test_a_nan_anywhere_fails_the_probe():
    """Python's max drops a NaN that is not first (the probe's old `max(...)` did); the probe's difference keeps it."""
    import numpy as np

    from runtime.probe import max_difference

    truth = [np.zeros(3, np.float32), np.zeros(2, np.float32)]
    assert np.isnan(max_difference([np.full(3, 1e-6), np.array([0.0, np.nan])], truth))
    assert max_difference([np.full(3, 1e-6), np.array([0.0, -2e-6])], truth) == pytest.approx(2e-6)
    assert max_difference([np.zeros(0)], [np.zeros(0)]) == 0.0


def test_the_readme_and_audit_help_quote_the_policy():
    from click.testing import CliRunner

    from audit.cli import main

    full, low = (tolerance.written(probe_tolerance(d)) for d in ("float32", "bfloat16"))
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"within {full} per token in float32 ({low} in bf16/fp16, the probe's tolerance" in readme
    assert f"(within {full} in float32, {low} in bf16/fp16, and again under the Trainer's autocast" in readme
    help_text = " ".join(CliRunner().invoke(main, ["--help"]).output.split())
    assert f"[default: {tolerance.describe_replay()}]" in help_text
    assert "[default: 1e-4 for float32, 0.25 for bfloat16/float16 (the probe's tolerance), 10x and 2x" in help_text


# ---------------------------------------------------------------------------------------------------------------
# one definition: an AST scan of the product

# Figures that are not "matches the plain forward", each with why it lives elsewhere.
NOT_THE_POLICY = {
    ("schemas/rule_rows.py", "SUM_TOLERANCE"): "a stored float64 sum against the sum of its stored float32 tokens",
    ("schemas/rule_top_k.py", "TOP_K_TOLERANCE"): "stored top-k values against each other and the token's own log-prob "
                                             "(the storage's rounding of them, issue 24)",
    ("dpo/loss_config.py", "0.5"): "the range of a loss parameter (0 <= label_smoothing < 0.5)",
    ("schemas/logp_codes.py", "mass_allowance"): "the 16-bit codes' own rounding of a decoded top-k distribution's mass "
                                             "(issue 35: where the reader normalises it), not a forward's",
    ("schemas/rule_top_k.py", "mass_allowance"): "the same codec bound, where the audit judges a stored mass",
    ("audit/cli.py", "tolerance"): "audit-ref's --tolerance option: the user's override (default None: the policy)",
}


def product_modules():
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def is_figure(node) -> bool:
    """A float literal strictly between 0 and 1: what a per-token tolerance is written as."""
    return isinstance(node, ast.Constant) and type(node.value) is float and 0 < node.value < 1


def name_of(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Call):  # a bound computed by a named function: judged by that name
        return name_of(node.func)
    return None


def figure_names(modules) -> set[str]:
    """Names outside the policy that hold or return a figure: a variable, attribute or constant assigned a figure,
    a function returning one. Grown to a fixpoint, so a figure passed through a constant, a local or a helper is
    still found."""
    found: set[str] = set()
    while True:
        before = len(found)
        for _, tree in modules:
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    if is_figure_expression(node.value, found):
                        found.update(filter(None, map(name_of, getattr(node, "targets", None) or [node.target])))
                elif isinstance(node, ast.FunctionDef):
                    if any(isinstance(r, ast.Return) and r.value is not None and is_figure_expression(r.value, found)
                           for r in ast.walk(node)):
                        found.add(node.name)
        if len(found) == before:
            return found


def is_figure_expression(node, names: set[str]) -> bool:
    """A figure, a name or call of `names`, or arithmetic or a choice (x if c else y) with one of those in it."""
    if isinstance(node, ast.IfExp):
        return is_figure_expression(node.body, names) or is_figure_expression(node.orelse, names)
    if isinstance(node, ast.BinOp):
        return is_figure_expression(node.left, names) or is_figure_expression(node.right, names)
    if isinstance(node, ast.UnaryOp):
        return is_figure_expression(node.operand, names)
    if isinstance(node, ast.Call):
        return name_of(node.func) in names
    return is_figure(node) or (isinstance(node, (ast.Name, ast.Attribute)) and name_of(node) in names)


def figure_comparisons(modules) -> list[str]:
    """Ordering comparisons outside the policy of a value with a figure expression, the other side neither a
    constant nor a figure (`beta <= 0`, a parameter's check)."""
    names = figure_names(modules)
    found = []
    for module, tree in modules:
        allowed = {name for (where, name) in NOT_THE_POLICY if where == module}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, sides, sides[1:]):
                if not isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
                    continue
                for x, y in ((a, b), (b, a)):
                    if is_figure_expression(x, names) and not is_figure_expression(y, names) and \
                            not isinstance(y, ast.Constant) and (name_of(x) or ast.unparse(x)) not in allowed:
                        found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def tolerance_definitions(modules) -> list[str]:
    """Every function, class or assigned name spelled like a tolerance."""
    found = []
    for module, tree in modules:
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [node]
                       if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [])
            for name in filter(None, map(name_of, targets)):
                if "toleran" in name.lower() and (module, name) not in NOT_THE_POLICY:
                    found.append(f"{module}:{node.lineno} {name}")
    return found


def test_the_tolerance_policy_has_one_definition():
    modules = list(product_modules())
    outside = [(m, t) for m, t in modules if m != "runtime/tolerance.py"]
    assert [d.split(" ")[1] for d in tolerance_definitions(modules)] == \
        ["probe_tolerance", "head_tolerance", "truth_tolerance", "replay_tolerance"]
    assert all(d.startswith("runtime/tolerance.py:") for d in tolerance_definitions(modules))
    assert figure_comparisons(outside) == []


def test_the_scan_finds_a_differently_spelled_twin():
    """The scan is not vacuous: the twins the review found, and neighbours spelled otherwise, are caught."""
    twins = {
        "a constant": "LIMIT = 2e-2\ndef ok(d): return d <= LIMIT\n",
        "a helper": "def allowed(dtype):\n    return 1e-4 if dtype else 0.25\ndef ok(d, t): return d <= allowed(t)\n",
        "a local": "def ok(d, exact):\n    bound = 1e-4 if exact else 3.0\n    return not d > bound\n",
        "an attribute": ("class C:\n    def __init__(self):\n        self.tol = 5e-2\n"
                         "    def ok(self, d): return d < self.tol\n"),
        "a literal": "def ok(d): return abs(d) <= 1e-5\n",
    }
    for what, source in twins.items():
        assert figure_comparisons([("dpo/twin.py", ast.parse(source))]), what
    not_figures = "def ok(x, ratio, s):\n    return 0 <= x and ratio <= 1.0 and s > 1e5 and 0.5 < 1\n"
    assert figure_comparisons([("dpo/twin.py", ast.parse(not_figures))]) == []
    named = ast.parse("def default_tolerance(dtype): return 1\nPROBE_TOLERANCE = 3\n")
    assert len(tolerance_definitions([("audit/twin.py", named)])) == 2


# ---------------------------------------------------------------------------------------------------------------
# each user goes through the policy


def strict(monkeypatch) -> None:
    """A float32 row nothing can meet (even a difference of 0 fails): each user of the policy must refuse or fall
    back, which it only does if it reads the policy."""
    monkeypatch.setattr(tolerance, "PRECISION", {**tolerance.PRECISION, "float32": tolerance.Precision(-1.0, 1)})


def test_the_head_check_reads_the_policy(tokenizer, monkeypatch):
    from runtime.logprobs import verified_head

    assert verified_head(build_llama(len(tokenizer))) == "hook"
    strict(monkeypatch)
    assert verified_head(build_llama(len(tokenizer))) == "logits"  # the model's own output needs no check


@pytest.fixture
def pairs():
    import random

    from schemas.encoding import EncodedPair

    rng = random.Random(0)
    ids = lambda a, b: [rng.randrange(3, 300) for _ in range(rng.randint(a, b))]
    return [EncodedPair(ids(4, 40), ids(2, 12), ids(2, 12)) for _ in range(6)]


def test_precompute_probe_reads_the_policy(tokenizer, pairs, monkeypatch):
    from precompute import modes
    from runtime.errors import JobError

    model = build_llama(len(tokenizer))
    assert modes.choose_mode(model, "packed", pairs, 60, 0, 4096, lambda line: None) == "packed"
    strict(monkeypatch)
    with pytest.raises(JobError, match="no batching mode reproduces this model's own forward .packed: differs from "
                                       "the reference forward by .* on this model; full_forward: differs"):
        modes.choose_mode(model, "packed", pairs, 60, 0, 4096, lambda line: None)


def test_train_dpo_layout_probe_reads_the_policy(tokenizer, pairs, monkeypatch):
    import pyarrow as pa

    from dpo.layout import choose_layout

    table = pa.table({k: [getattr(p, k) for p in pairs] for k in ("prompt_ids", "chosen_ids", "rejected_ids")})
    model = build_llama(len(tokenizer))
    logs: list[str] = []
    assert choose_layout("prefix_shared", [model], table, 4, 0, logs.append) == "prefix_shared", logs
    strict(monkeypatch)
    assert choose_layout("prefix_shared", [model], table, 4, 0, logs.append) == "padded"
    assert "(differs from the reference forward by" in logs[1] and logs[1].endswith(" on this model)")


def test_audit_replay_reads_the_policy(tmp_path, monkeypatch):
    from conftest import audit_ref, check_of, precompute_in_process

    lines = (DATA / "prefs" / "train.jsonl").read_text().splitlines(keepends=True)[:4]
    (tmp_path / "train.jsonl").write_text("".join(lines))
    cache = precompute_in_process(DATA / "sft-model", tmp_path / "train.jsonl", tmp_path / "cache")
    code, report, output = audit_ref(cache, "--model", DATA / "sft-model", "--all")
    assert code == 0 and check_of(report, "replay")["info"]["tolerance"] == 1e-4, output
    strict(monkeypatch)
    code, report, output = audit_ref(cache, "--model", DATA / "sft-model", "--all")
    replay = check_of(report, "replay")
    assert code == 1 and replay["status"] == "FAIL" and replay["info"]["tolerance"] == -1.0, output
