"""train-dpo's fixed cost: the per-phase record in the run manifest (dpo/phases.py), the plot drawn without pyplot,
and model hashing that does not keep the hashed file resident."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dpo.phases import PhaseTimer
from dpo.config import TrainConfig
from dpo.recipe import run_train
from schemas.stamps import model_hash

PHASES = ("startup", "imports", "checks", "verify", "load", "layout", "setup", "train", "save", "plot", "final_hash")


def test_phase_timer_adds_up_wall_and_cpu_time():
    timer = PhaseTimer()
    assert timer.phases["startup"]["cpu_s"] > 0  # the interpreter and imports before the timer
    x = 0
    for i in range(2_000_000):  # CPU work in phase "work"
        x += i
    timer.mark("work")
    timer.mark("idle")
    work, idle = timer.phases["work"], timer.phases["idle"]
    assert work["cpu_s"] > 0.01 and work["wall_s"] >= work["cpu_s"] * 0.5
    assert idle["cpu_s"] < work["cpu_s"]
    first = dict(work)  # a copy: mark() updates the phase's dict in place
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(2_000_000):  # more CPU work, in phase "work" again
        x += i
    cpu1, wall1 = time.process_time(), time.perf_counter()
    timer.mark("work")  # a phase marked twice accumulates: the first time plus the second
    again = timer.phases["work"]
    assert cpu1 - cpu0 > 0.01
    assert again["cpu_s"] == pytest.approx(first["cpu_s"] + (cpu1 - cpu0), abs=0.01)
    assert again["wall_s"] >= first["wall_s"] + (wall1 - wall0) - 0.002  # (each figure rounded to the ms)


def test_run_manifest_records_every_phase(tmp_path, llama_dir, dpo_data, dpo_cache):
    out = tmp_path / "run"
    summary = run_train(TrainConfig(model=str(llama_dir), data=str(dpo_data), output_dir=str(out),
                                    ref_cache=str(dpo_cache), max_steps=2, per_device_train_batch_size=4,
                                    use_cpu=True, plot=True), log=lambda m: None)
    phases = json.loads((out / "run-manifest.json").read_text())["result"]["phases"]
    assert set(PHASES) <= set(phases)
    for name in PHASES:
        assert phases[name]["cpu_s"] >= 0 and phases[name]["rss_mb"] > 0, name
        assert phases[name]["peak_rss_mb"] >= phases[name]["rss_mb"], name
    # the train phase is the Trainer's loop (train_s) and little else
    assert phases["train"]["wall_s"] == pytest.approx(summary["train_s"], abs=0.5)
    assert (out / "metrics.png").stat().st_size > 10_000
    assert summary["phases"]["manifest"]["wall_s"] >= 0  # after the manifest: in the summary only


def _peak_kb() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def test_model_hash_does_not_keep_the_file_resident(tmp_path):
    clear = Path("/proc/self/clear_refs")
    try:
        clear.write_text("5")  # reset the peak RSS
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    folder = tmp_path / "m"
    folder.mkdir()
    tensors = {f"layer{i}.weight": torch.full((1024, 1024), float(i)) for i in range(24)}  # 24 x 4 MiB
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 1024}))
    del tensors
    clear.write_text("5")
    before = _peak_kb()
    digest = model_hash(folder)
    grown_mb = (_peak_kb() - before) / 1024
    assert grown_mb < 40, f"hashing a 96 MiB file grew the peak RSS by {grown_mb:.0f} MiB"
    assert digest == model_hash(folder)  # stable
    assert len(digest) == 64 and digest != hashlib.sha256(b"").hexdigest()


TOY = '''
import atexit, sys, click
from runtime.cli import exit_without_teardown

@click.command()
@click.option("--code", default="0")
@click.argument("marker")
def main(code, marker):
    atexit.register(lambda: open(marker, "w").write("atexit ran"))
    sys.stdout.write("buffered, no newline")
    if code == "message":
        sys.exit("refused: because")
    if code == "raise":
        raise RuntimeError("boom")
    sys.exit(int(code))

exit_without_teardown(main)
'''


@pytest.mark.parametrize("code, status", [("0", 0), ("2", 2), ("message", 1), ("raise", 1)])
def test_exit_without_teardown_keeps_exit_status_output_and_atexit(tmp_path, code, status):
    import os
    import subprocess
    import sys

    marker = tmp_path / "marker"
    script = tmp_path / "toy.py"
    script.write_text(TOY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), "--code", code, str(marker)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert marker.read_text() == "atexit ran"
    if code == "message":
        assert "refused: because" in proc.stderr
    if code == "raise":
        assert "RuntimeError: boom" in proc.stderr


HEAP_TOY = '''
import gc, sys, click
from runtime.cli import exit_without_teardown, heap_settled

ORIGINAL = gc.get_threshold()


class Cycle:
    """Unreachable only as a whole (it refers to itself): only the cyclic collector finalizes it."""

    def __init__(self, log, name):
        self.log, self.name, self.me = log, name, self

    def __del__(self):
        open(self.log, "a").write(f"finalized {self.name}\\n")


@click.command()
@click.argument("log")
def main(log):
    def note(text):
        open(log, "a").write(text + "\\n")

    note(f"postponed {gc.get_threshold()[2] > 10**6}")
    Cycle(log, "before")  # garbage of the start-up, still young: collected when the heap settles
    heap_settled()
    note(f"frozen {gc.get_freeze_count() > 0} restored {gc.get_threshold() == ORIGINAL}")
    heap_settled()  # a second call changes nothing
    note(f"restored {gc.get_threshold() == ORIGINAL}")
    Cycle(log, "after")  # garbage made after the freeze: finalized at exit

exit_without_teardown(main)
'''


def test_full_collections_wait_for_the_heap_to_settle_and_exit_still_finalizes(tmp_path):
    """A process run by exit_without_teardown postpones full collections until heap_settled, which collects the young
    garbage, freezes what is alive and restores the thresholds; garbage made later is still finalized at exit."""
    import os
    import subprocess
    import sys

    log = tmp_path / "log"
    script = tmp_path / "toy.py"
    script.write_text(HEAP_TOY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == ["postponed True", "finalized before", "frozen True restored True",
                                            "restored True", "finalized after"]


def test_heap_settled_is_a_no_op_outside_exit_without_teardown():
    import gc

    from runtime.cli import heap_settled

    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    heap_settled()
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
