"""precompute-ref --torch-compile auto (neither flag, the default; issue 39 item 1): compile where the job's estimated
eager scoring saves more than compiling costs, by precompute/compiled.py's measured figures; the cost model's inputs
are faked here, never timed: a tiny job stays eager, a long one compiles, a warm inductor cache lowers the bar, the
flags force either way, a split model stays eager, a loaded machine (the measured rate and the compile slowed alike)
decides as an idle one. The job's side (the rate measured on its first batches, the switch, the notes):
tests/precompute/test_compile_calibrated.py."""

from __future__ import annotations


import pytest

from precompute import compiled

COLD, WARM = compiled.COMPILE_SECONDS["cold"], compiled.COMPILE_SECONDS["warm"]
BREAK_EVEN = {kind: c / (1 - 1 / compiled.SPEEDUP) for kind, c in compiled.COMPILE_SECONDS.items()}


@pytest.mark.parametrize("requested, eager, split, warm, compiles, says", [
    (None, 3.0, False, False, False, "auto: eager, the job's estimated eager scoring is under"),  # data/: seconds
    (None, BREAK_EVEN["cold"] * 1.1, False, False, True, "auto: compiled, the job's estimated eager scoring is past"),
    (None, BREAK_EVEN["cold"] * 0.9, False, False, False, "under the break-even"),
    (None, BREAK_EVEN["cold"] * 0.9, False, True, True, "past the break-even"),  # the same job, compiled warm
    (None, BREAK_EVEN["warm"] * 0.9, False, True, False, "auto: eager"),
    (None, 1e9, True, False, False, "a split model scores uncompiled"),
    (None, None, False, False, False, "no measured eager rate"),
    (True, 1.0, False, False, True, "--torch-compile"),
    (False, 1e9, False, True, False, "--no-torch-compile"),
])
def test_auto_compiles_where_the_estimate_says_it_pays(requested, eager, split, warm, compiles, says):
    decided, why = compiled.compile_choice(requested, eager, split=split, warm=warm)
    assert decided is compiles and says in why


def test_on_cuda_auto_weighs_the_job_with_the_figures_measured_on_cuda():
    """The H200's measured figures (1.39x, 29.7 s cold; bench/results/gpu-compile-h200.json): a job of about two
    minutes of eager scoring compiles on CUDA and stays eager on the CPU's figures; the log names whose figures."""
    cuda_break_even = compiled.CUDA_COMPILE_SECONDS["cold"] / (1 - 1 / compiled.CUDA_SPEEDUP)
    assert 100 < cuda_break_even < 110  # by hand: 29.7 / (1 - 1/1.39) = 105.9 s
    eager = cuda_break_even * 1.2
    assert compiled.compile_choice(None, eager, device_type="cuda")[0] is True
    assert compiled.compile_choice(None, eager, device_type="cpu")[0] is False
    assert compiled.compile_choice(None, cuda_break_even * 0.8, device_type="cuda")[0] is False
    assert "at 1.39x the eager rate compiled (cuda's measured figures)" in compiled.estimate_text(eager, False, "cuda")


def test_the_break_even_is_the_measured_compile_time_over_the_saved_share():
    """E (1 - 1/SPEEDUP) = C, by hand: about 10 minutes warm and 25 cold on CPU (the help text's figures)."""
    assert 9 * 60 < BREAK_EVEN["warm"] < 11 * 60 and 24 * 60 < BREAK_EVEN["cold"] < 26 * 60


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("share", [0.001, 0.5, 0.9, 1.1, 2.0, 50.0])  # of the break-even: a tiny job to a long one
def test_a_loaded_machine_decides_as_an_idle_one(share, warm, device_type):
    """The same job on a machine 4x loaded: the probe's wall-clock estimate reads 4x long and cpu_slowdown measures
    4x, so the compile seconds are scaled alike and the choice is the idle machine's. Without the scaling (the rule
    before issue 39's fix) the loaded estimate alone compiles a job at half the break-even."""
    speedup, seconds = compiled.figures(device_type)
    eager = share * seconds["warm" if warm else "cold"] / (1 - 1 / speedup)
    idle = compiled.compile_choice(None, eager, warm=warm, device_type=device_type)
    loaded = compiled.compile_choice(None, 4 * eager, warm=warm, device_type=device_type, slowdown=4.0)
    assert loaded == idle and idle[0] is (share > 1)
    if share == 0.5:
        assert compiled.compile_choice(None, 4 * eager, warm=warm, device_type=device_type)[0] is True


@pytest.mark.parametrize("slices, expected", [
    ([1.0, 1.0, 1.0, 1.0], 1.0),  # never preempted: an idle machine
    ([1.0, 1.0, 1.0, 13.0], 4.0),  # one slice waited 12 units for a core: 16 units of wall for 4 of work
    ([2.0, 3.0, 2.0, 5.0], 1.5),  # the fastest slice is the unloaded measure
])
def test_cpu_slowdown_is_the_slices_total_over_the_fastest(monkeypatch, slices, expected):
    """cpu_slowdown's arithmetic on a faked clock (each slice's start and end), not a timing."""
    ticks = iter([t for d in slices for t in (0.0, d)])
    monkeypatch.setattr(compiled.time, "perf_counter", lambda: next(ticks))
    assert compiled.cpu_slowdown(slices=len(slices), steps=1) == pytest.approx(expected)


def test_the_estimate_names_the_slowdown_it_scaled_the_compile_by():
    text = compiled.estimate_text(600.0, False, "cpu", slowdown=4.0)
    assert f"about {COLD * 4:.0f} s of compiling with a cold inductor cache ({COLD:.0f} s measured unloaded x 4.0" in text
    assert "(unloaded: no CPU slowdown measured now)" in compiled.estimate_text(600.0, True, "cpu")
