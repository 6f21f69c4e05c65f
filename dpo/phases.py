"""Where a train-dpo process spends its time: wall and CPU seconds per phase (start-up before run_train, checks,
verification, model load, layout, training, save, plot), recorded in the run manifest's result so that the fixed
cost of a run can be read without a profiler. CPU time is the process's own (it counts from process start, so the
start-up phase includes the interpreter and every import), which stays meaningful on a shared machine."""

from __future__ import annotations

import os
import time


def _process_age_s() -> float | None:
    """Wall seconds since this process started (Linux /proc), or None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _memory_mb() -> dict:
    """Resident memory now and its peak so far (Linux /proc; empty elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        return {"rss_mb": int(fields["VmRSS"].split()[0]) // 1024, "peak_rss_mb": int(fields["VmHWM"].split()[0]) // 1024}
    except (OSError, KeyError, ValueError):
        return {}


class PhaseTimer:
    """`mark(name)` closes the phase that ran since the previous mark (or since the timer was made); the time
    before the timer was made is the phase `startup`. Each phase also records the resident memory at its end and the
    process's peak so far."""

    def __init__(self):
        self.phases: dict[str, dict] = {}
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        age = _process_age_s()
        self.phases["startup"] = {"wall_s": round(age, 3) if age is not None else None, "cpu_s": round(self._cpu, 3),
                                  **_memory_mb()}

    def mark(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        spent = self.phases.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0})
        spent["wall_s"] = round(spent["wall_s"] + wall - self._wall, 3)
        spent["cpu_s"] = round(spent["cpu_s"] + cpu - self._cpu, 3)
        spent.update(_memory_mb())  # at the end of the phase
        self._wall, self._cpu = wall, cpu
