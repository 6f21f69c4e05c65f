"""bench/gpu_check.py: its --cpu-smoke run end to end (the GPU check's code paths on CPU, so the check is known to
work before a GPU is at hand), its FLOP count and peak table against independent figures, its time limit; and the
device preparation (bench/prepare_device.py) on wheels built here: what it refuses and says."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
import time
import zipfile

import pytest

from conftest import REPO

BENCH = REPO / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, str(BENCH))  # the bench scripts import their harness (common, train_steps) by name
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def gpu_check(bench_path):
    return load("gpu_check")


@pytest.fixture(scope="module")
def figures(bench_path):
    return load("gpu_figures")


@pytest.fixture(scope="module")
def prepare(bench_path):
    return load("prepare_device")


def test_cpu_smoke_runs_end_to_end(tmp_path):
    from runtime.tolerance import probe_tolerance

    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--cpu-smoke", "--results", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for row in ("| attention | batching | tokens/s (scoring) | share of peak |", "| sdpa |",
                "| flash_attention_2 | not run: CUDA only |", "| reference | batch layout | step time (median) |",
                "| cached | padded |", "| live | padded |", "| cached | prefix_shared |",
                "not in the datasheet table: the measured torch.mm float32 rate"):
        assert row in out, f"{row!r} missing from:\n{out}"
    r = json.loads((tmp_path / "gpu_check-cpu-quick.json").read_text())
    assert r["dtype"] == "float32" and r["machine"]["device"] == "cpu" and r["complete"] is True
    assert r["packages"]["torch"] and r["packages"]["polars"] and r["packages"]["datasets"]

    def finite(*values):
        assert all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values), values

    sdpa = r["precompute"]["sdpa"]
    assert "error" not in sdpa, sdpa
    finite(sdpa["tokens_per_s"], sdpa["tokens_per_s_end_to_end"], sdpa["share_of_peak"], sdpa["flops"],
           sdpa["score_s"], sdpa["wall_s"], sdpa["peak_mb"], r["peak"]["tflops"], r["peak"]["mm_tflops"])
    assert sdpa["score_s"] <= sdpa["wall_s"]  # scoring is timed inside the job's wall; a share of a peak is timing: not asserted
    vs = sdpa["vs_fp32"]
    assert vs["pairs"] == r["size"]["truth_pairs"] and vs["tokens"] > 2 * vs["pairs"]
    assert math.isfinite(vs["max_abs_diff"]) and 0 <= vs["mean_abs_diff"] <= vs["max_abs_diff"]
    assert vs["max_abs_diff"] <= probe_tolerance("float32") == vs["tolerance"]
    for name in ("cached_padded", "live_padded", "cached_prefix_shared"):
        t = r["train"][name]
        assert "error" not in t, t
        assert len(t["step_s"]) == r["size"]["steps"]
        finite(*t["step_s"], t["peak_mb"])


def test_flops_count_every_token_and_key(figures):
    shape = {"linear_params": 1000, "layers": 3, "attn_width": 8}
    prompts, chosen, rejected = [3, 1], [2, 4], [5, 1]
    want = 0
    for p, c, r in zip(prompts, chosen, rejected):  # each token: its linear work, then one unit per key it sees
        positions = list(range(1, p + 1)) + list(range(p + 1, p + c + 1)) + list(range(p + 1, p + r + 1))
        want += sum(2 * 1000 + 4 * 3 * 8 * keys for keys in positions)
    assert figures.pairs_flops(prompts, chosen, rejected, shape) == want


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0), ("NVIDIA A10", 125.0),
    ("NVIDIA A10G", None), ("Tesla V100-SXM2-16GB", None),
])
def test_datasheet_peak_by_device_name(figures, name, tflops):
    assert figures.datasheet_peak(name) == tflops


def test_every_datasheet_peak_says_where_it_was_checked(figures):
    for pattern, _, source in figures.PEAK_BF16_TFLOPS:
        assert source.startswith("unchecked") or re.search(r"https://\S+", source), (pattern, source)
    checked = figures.datasheet_entry("NVIDIA H200")[1]
    readme = (REPO / "README.md").read_text()
    for url in re.findall(r"https://[^\s,;)]+", checked):  # the README's GPU section cites the H200's sources too
        assert url in readme, url


def test_a_child_with_too_little_time_left_is_skipped_and_says_why(gpu_check, monkeypatch):
    monkeypatch.setattr(gpu_check, "LIMIT_S", 480.0)
    monkeypatch.setattr(gpu_check, "DEADLINE", time.time() + gpu_check.SAVE_MARGIN_S + 5)
    monkeypatch.setattr(gpu_check.common, "run_child", lambda *a, **k: pytest.fail("a child was started"))
    r = gpu_check.run_child("cached_padded", model="m")
    assert r["skipped"].startswith("the time limit: ") and "GPU_CHECK_LIMIT=480" in r["skipped"]
    monkeypatch.setattr(gpu_check, "DEADLINE", math.inf)
    assert gpu_check.out_of_time() is None


def test_a_partial_result_renders_what_it_holds(figures):
    """The result as saved after the precompute stage (a run stopped at its limit leaves this): its rows, no
    training table, and the stages so far as the wall."""
    r = {"device": "cuda", "dtype": "bfloat16", "size": {"pairs": 4, "seq": 64, "batch": 2},
         "peak": {"device": "NVIDIA H200", "tflops": 989.0, "source": "datasheet, dense bf16", "mm_tflops": 780.0,
                  "mm_dtype": "bfloat16"},
         "model": {"params": 1_100_000_000, "hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "vocab": 32000},
         "stages_s": {"build": 20.0, "precompute": 95.0},
         "precompute": {"sdpa": {"mode": "packed", "tokens_per_s": 250000.0, "share_of_peak": 0.41, "score_s": 6.0,
                                 "wall_s": 60.0, "peak_mb": 9000.0},
                        "flash_attention_2": {"skipped": "flash_attn is not installed"}}}
    text = "\n".join(figures.tables(r))
    assert "Wall: 115 s (build 20 s, precompute 95 s)" in text
    assert "| sdpa | packed | 250,000 | 41.0% | 6.00 / 60.0 | 9,000 MiB | n/a | n/a | n/a |" in text
    assert "| flash_attention_2 | not run: flash_attn is not installed |" in text
    assert "train-dpo" not in text


def test_readme_gives_the_device_command_the_rehearsal_runs():
    script = (REPO / "scripts" / "rehearse-device.sh").read_text()
    command = re.search(r"^DEVICE_COMMAND='([^']+)'", script, re.M).group(1)
    readme = (REPO / "README.md").read_text()
    assert f"command: `{command}`" in readme and 'carry: `[".whl"]`' in readme
    assert "scripts/prepare-device.sh" in readme and "scripts/rehearse-device.sh" in readme


def fake_wheel(folder, name, version, *requires, tag="py3-none-any"):
    path = folder / f"{name.replace('-', '_')}-{version}-{tag}.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def test_wheels_close_over_the_image_or_say_what_is_missing(prepare, tmp_path):
    fake_wheel(tmp_path, "polars", "2.1.0", "polars-runtime-32==2.1.0", "pyarrow>=7; extra == 'pyarrow'")
    fake_wheel(tmp_path, "polars-runtime-32", "2.1.0")
    fake_wheel(tmp_path, "datasets", "5.2.0", "numpy>=1.17", "pyarrow>=24.0.0", "dill<0.4.2",
               "tomli; python_version < '3.11'")
    fake_wheel(tmp_path, "dill", "0.4.1")
    assumed = []
    assert prepare.check_closure(prepare.wheels_in(tmp_path), "3.12", assumed) == []  # extras, other Pythons left out
    assert assumed == ["pyarrow>=24.0.0 (datasets)"]  # pyarrow's version on the device was never read
    fake_wheel(tmp_path, "mystery", "1.0", "not-in-the-image>=1", "numpy>=3")
    problems = prepare.check_closure(prepare.wheels_in(tmp_path), "3.12")
    assert problems == [
        "mystery-1.0-py3-none-any.whl needs not-in-the-image>=1, neither carried nor in device-image.txt: add it to "
        "device-wheels.txt",
        "mystery-1.0-py3-none-any.whl needs numpy>=3, and numpy 2.5.2 is what the device would have"]


def test_two_versions_of_one_wheel_are_refused(prepare, tmp_path, capsys):
    fake_wheel(tmp_path, "dill", "0.4.1")
    fake_wheel(tmp_path, "dill", "0.4.0")
    with pytest.raises(SystemExit) as e:
        prepare.wheels_in(tmp_path)
    assert e.value.code == 2
    assert "two wheels of dill (dill-0.4.0-py3-none-any.whl, dill-0.4.1-py3-none-any.whl)" in capsys.readouterr().err


def test_the_wheel_list_pins_each_once_and_the_image_lacks_them(prepare):
    wheels = prepare.requirements(prepare.WHEELS)
    image = {prepare.norm(r.name) for r in prepare.requirements(prepare.IMAGE)}
    names = [prepare.norm(r.name) for r in wheels]
    assert len(names) == len(set(names)) and {"polars", "datasets", "fsspec"} <= set(names)
    assert all(str(r.specifier).startswith("==") for r in wheels)
    assert not image & {"polars", "datasets"}
    assert {"torch", "transformers", "pyarrow", "numpy"} <= image
