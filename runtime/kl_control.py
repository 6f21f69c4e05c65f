"""β over a DPO run, the rule alone: schedules, the band and proportional KL controllers, alarms and rollbacks, in
plain Python floats (float64). train-dpo applies it (dpo/kl_governor.py) and audit-ref recomputes it from the run's
metrics.jsonl and recorded settings (`replay`), operation for operation, so the two agree to the bit.

Steps are optimizer steps, counted from 0 (step s weighs the loss of the Trainer's global step s + 1).

Schedules (`--beta-schedule`, from --beta = b0 to --beta-end = b1), with W warm-up steps (the Trainer's, resolved)
and T steps in all: b(s) = b0 for s < W; then, with t = min(1, (s - W) / (T - 1 - W)) (1 when T - 1 <= W),
  constant     b0
  linear       b0 (1 - t) + b1 t
  cosine       b1 + (b0 - b1) (1 + cos(pi t)) / 2
  exponential  b0 (b1 / b0)^t
so the first step after warm-up uses b0 and the last b1.

Controllers, every N = --kl-adapt-every steps, on m = the mean of the per-token KL(policy || reference) bound over
the micro-batches of those N steps (`kl/policy_ref/chosen`, or the mean of chosen and rejected with --kl-measure
both; a top-k cache's figure, the same on every rank), acting on c = β or --kl-coef (--kl-control):
  band          m > HI: c <- c x f; m < LO: c <- c / f; else unchanged    (f = --kl-adapt-factor)
  proportional  e = clip(m / T - 1, -0.2, 0.2); c <- c (1 + e n / H)      (n = pairs in the window, H = --kl-horizon)
each then clamped to [--beta-min, --beta-max]. The proportional one is the adaptive KL controller of Ziegler et al.
2019 ("Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593, section 2.2: e_t = clip(KL_t /
KL_target - 1, -0.2, 0.2), beta_{t+1} = beta_t (1 + K_beta e_t)), as OpenRLHF (openrlhf/trainer/ppo_utils/
kl_controller.py, AdaptiveKLController.update) and verl (verl/trainer/ppo/core_algos.py, AdaptiveKLController) write
it: K_beta = n_steps / horizon, n_steps the samples since the last update; here the pairs of the window.

Alarms: at each step the Trainer logs, m' = the same KL over the micro-batches since the previous logged step; m' >
LEVEL raises the alarm. A rollback restores a checkpoint (its state, `state`) and multiplies c by f (clamped).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

SCHEDULES = ("constant", "linear", "cosine", "exponential")
CONTROLLERS = ("band", "proportional")
CONTROLLED = ("beta", "kl_coef")
MEASURES = ("chosen", "both")
ALARM_ACTIONS = ("warn", "checkpoint", "stop", "rollback")
# the recorded settings' fields that hold a word (None: no controller), and those whose number may be absent
_CHOICES = {"controlled": CONTROLLED, "schedule": SCHEDULES, "controller": (None, *CONTROLLERS),
            "measure": MEASURES, "alarm_action": ALARM_ACTIONS}
_OPTIONAL = ("end", "low", "high", "target", "horizon", "alarm_level")
PROPORTIONAL_CLIP = 0.2  # Ziegler et al.'s clip of the proportional error


def parse_target(text: str) -> tuple[float, ...]:
    """--kl-target: LO:HI (band) or T (proportional), nats per token."""
    try:
        values = tuple(float(v) for v in str(text).split(":"))
    except ValueError:
        raise ValueError(f"{text!r} is not LO:HI or T (numbers, nats per token)") from None
    if len(values) not in (1, 2) or not all(v > 0 and v < float("inf") for v in values):
        raise ValueError(f"{text!r}: give LO:HI (a band) or T (a target), each a finite KL > 0")
    return values


def parse_alarm(text: str) -> tuple[float, str]:
    """--kl-alarm: LEVEL[:warn|checkpoint|stop|rollback]."""
    level, colon, action = str(text).partition(":")
    action = action or ("" if colon else "warn")  # "2:" names no action: refused, not taken as a warning
    try:
        value = float(level)
    except ValueError:
        raise ValueError(f"{text!r}: LEVEL must be a number (nats per token)") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{text!r}: LEVEL must be a finite KL > 0")
    if action not in ALARM_ACTIONS:
        raise ValueError(f"{text!r}: the action must be one of {', '.join(ALARM_ACTIONS)}")
    return value, action


def target_text(text) -> str:
    """--kl-target's option type: the text as given, once parse_target accepts it."""
    parse_target(text)
    return str(text)


def alarm_text(text) -> str:
    """--kl-alarm's option type: the text as given, once parse_alarm accepts it."""
    parse_alarm(text)
    return str(text)


# Which KL option is read by what. An option given where nothing reads it is refused (train-dpo's command line and
# --config, dpo/cli.py), as an unread loss option is, so that nothing ignored is recorded as used. name -> (what reads
# it, whether the options `o` (TrainConfig's names and values) have it read); every KL option of train-dpo but the
# three that switch something on (--beta-schedule, --kl-target, --kl-alarm) is here (tests/runtime/test_kl_control.py
# enumerates them).
def _controller(o: dict) -> bool:
    return o.get("kl_target") is not None


def _watched(o: dict) -> bool:
    return o.get("kl_target") is not None or o.get("kl_alarm") is not None


def _rollback(o: dict) -> bool:
    return o.get("kl_alarm") is not None and str(o["kl_alarm"]).partition(":")[2] == "rollback"


READ_BY = {
    "beta_end": ("--beta-schedule linear, cosine or exponential", lambda o: o.get("beta_schedule", "constant")
                 != "constant"),
    "kl_controller": ("--kl-target", _controller),
    "kl_adapt_every": ("--kl-target", _controller),
    "kl_control": ("--kl-target", _controller),
    "kl_adapt_factor": ("--kl-target with --kl-controller band, or --kl-alarm LEVEL:rollback",
                        lambda o: (_controller(o) and o.get("kl_controller", "band") == "band") or _rollback(o)),
    "kl_horizon": ("--kl-target with --kl-controller proportional",
                   lambda o: _controller(o) and o.get("kl_controller") == "proportional"),
    "beta_min": ("--kl-target (the clamp of the controlled coefficient)", _controller),
    "beta_max": ("--kl-target (the clamp of the controlled coefficient)", _controller),
    "kl_measure": ("--kl-target or --kl-alarm", _watched),
    "kl_alarm_retries": ("--kl-alarm LEVEL:rollback", _rollback),
}


def unread_options(options: dict, given) -> list[tuple[str, str]]:
    """(name, what would read it) for each KL option in `given` (names) that the options `options` do not read."""
    return [(name, READ_BY[name][0]) for name in given if name in READ_BY and not READ_BY[name][1](options)]


def scheduled(schedule: str, start: float, end: float | None, step: int, total: int, warmup: int) -> float:
    """β of optimizer step `step` (0-based) under `schedule` (module docstring)."""
    if schedule == "constant" or step < warmup or end is None:
        return start
    span = total - 1 - warmup
    t = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return start * (1.0 - t) + end * t  # (not start + (end - start) t: the last step is `end` exactly)
    if schedule == "cosine":
        return end + (start - end) * (1.0 + math.cos(math.pi * t)) / 2.0
    if schedule == "exponential":
        return start * (end / start) ** t
    raise ValueError(schedule)


def clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def band_update(value: float, kl: float, low: float, high: float, factor: float, vmin: float, vmax: float):
    """(new value, action): raise above the band, lower below it, hold inside; clamped."""
    if kl > high:
        new, action = value * factor, "raise"
    elif kl < low:
        new, action = value / factor, "lower"
    else:
        new, action = value, "hold"
    return clamp(new, vmin, vmax), action


def proportional_update(value: float, kl: float, target: float, pairs: int, horizon: float, vmin: float,
                        vmax: float):
    """(new value, action) of Ziegler et al.'s proportional controller (module docstring); clamped."""
    error = clamp(kl / target - 1.0, -PROPORTIONAL_CLIP, PROPORTIONAL_CLIP)
    new = value * (1.0 + error * pairs / horizon)
    return clamp(new, vmin, vmax), "raise" if error > 0 else "lower" if error < 0 else "hold"


@dataclass(frozen=True)
class Settings:
    """Everything the rule needs; recorded in run-manifest.json (`kl_control`) and read back by audit-ref."""

    start: float  # the controlled coefficient's first value (--beta, or --kl-coef with --kl-control kl_coef)
    controlled: str = "beta"
    schedule: str = "constant"
    end: float | None = None
    total: int = 0
    warmup: int = 0
    controller: str | None = None
    low: float | None = None
    high: float | None = None
    target: float | None = None
    horizon: float | None = None
    every: int = 1
    factor: float = 1.2
    vmin: float = 0.001
    vmax: float = 0.5
    measure: str = "chosen"
    alarm_level: float | None = None
    alarm_action: str = "warn"
    alarm_retries: int = 2

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Settings:
        """The recorded settings, or ValueError naming the first field that no train-dpo run could have written (a
        damaged record is refused here, not met as a crash half-way through a replay)."""
        if not isinstance(data, dict):
            raise ValueError(f"not an object of settings ({type(data).__name__})")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown or "start" not in data:
            raise ValueError(f"unknown field {unknown[0]!r}" if unknown else "no 'start'")
        for name, value in data.items():
            choices = _CHOICES.get(name)
            if choices is not None:
                if value not in choices:
                    raise ValueError(f"{name} {value!r} is not one of {', '.join(str(c) for c in choices)}")
                continue
            if value is None and name in _OPTIONAL:
                continue
            kind = int if name in ("total", "warmup", "every", "alarm_retries") else float
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and
                                                                                   not isinstance(value, int)):
                raise ValueError(f"{name} {value!r} is not {'a whole number' if kind is int else 'a number'}")
            low = 1 if name == "every" else 0
            if not math.isfinite(value) or value < low or (kind is float and value <= 0):
                raise ValueError(f"{name} {value!r} is out of range")
        return cls(**data)

    @property
    def active(self) -> bool:
        """Whether anything here moves the coefficient or watches the KL (else a plain run)."""
        return self.schedule != "constant" or self.controller is not None or self.alarm_level is not None


def measured(figures: dict, measure: str) -> float:
    """The KL the rule watches, from one micro-batch's logged means."""
    if measure == "both":
        return (figures["kl/policy_ref/chosen"] + figures["kl/policy_ref/rejected"]) / 2.0
    return figures["kl/policy_ref/chosen"]


@dataclass
class State:
    """What a checkpoint keeps (kl-control.json): the coefficient, the scale rollbacks put on a schedule, the
    open window and alarm interval, the rollbacks done and the KL logged at the last logged step."""

    value: float
    scale: float = 1.0
    window: list = field(default_factory=list)  # micro-batch KLs of the open controller window
    window_steps: int = 0
    window_pairs: int = 0
    interval: list = field(default_factory=list)  # micro-batch KLs since the last logged step
    rollbacks: int = 0
    logged_kl: float | None = None
    step_kl: list = field(default_factory=list)  # micro-batch KLs of the step running
    checkpoint_kls: dict = field(default_factory=dict)  # str(step of a checkpoint) -> KL its weights measured

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> State:
        return cls(**data)


class Rule:
    """The coefficient over a run: `coefficient(step)` for the step about to run; `end_step` after each optimizer
    step (returns the controller's decision record, or None); `logged` at each logged step (returns the KL of the
    interval); `rollback(state)` after an alarm."""

    def __init__(self, settings: Settings, state: State | None = None):
        self.settings = settings
        self.state = state or State(settings.start)

    def coefficient(self, step: int) -> float:
        s = self.settings
        if s.controller is not None:
            return self.state.value
        return self.state.scale * scheduled(s.schedule, s.start, s.end, step, s.total, s.warmup)

    def observe(self, kl: float, pairs: int) -> None:
        """One training micro-batch's measured KL and its pairs (all ranks')."""
        self.state.window.append(kl)
        self.state.window_pairs += pairs
        self.state.interval.append(kl)
        self.state.step_kl.append(kl)

    def end_step(self, step: int) -> dict | None:
        """After optimizer step `step` (0-based): every N steps, the controller's decision."""
        s, st = self.settings, self.state
        if str(step) in st.checkpoint_kls and st.checkpoint_kls[str(step)] is None and st.step_kl:
            # the weights checkpoint `step` holds (saved after step - 1) measured on this step's batches
            st.checkpoint_kls[str(step)] = sum(st.step_kl) / len(st.step_kl)
        st.step_kl = []
        if s.controller is None:
            return None
        st.window_steps += 1
        if st.window_steps < s.every:
            return None
        kl = sum(st.window) / len(st.window) if st.window else 0.0
        before = st.value
        if s.controller == "band":
            st.value, action = band_update(before, kl, s.low, s.high, s.factor, s.vmin, s.vmax)
        else:
            st.value, action = proportional_update(before, kl, s.target, st.window_pairs, s.horizon, s.vmin, s.vmax)
        record = {"event": "kl_control", "step": step + 1, "kl_window": list(st.window), "kl": kl,
                  "pairs": st.window_pairs, "before": before, "after": st.value, "action": action}
        st.window, st.window_steps, st.window_pairs = [], 0, 0
        return record

    def logged(self) -> float | None:
        """At a logged step: the KL of the interval since the previous one (None without a measured batch)."""
        st = self.state
        kl = sum(st.interval) / len(st.interval) if st.interval else None
        st.interval = []
        st.logged_kl = kl
        return kl

    def saved(self, step: int) -> None:
        """A checkpoint of global step `step`: its weights' KL is measured on the next step's batches."""
        self.state.checkpoint_kls.setdefault(str(step), None)

    def rollback_candidates(self, level: float) -> list[int]:
        """Checkpoint steps whose weights measured a KL at most `level`, newest first."""
        good = [int(k) for k, v in self.state.checkpoint_kls.items() if v is not None and v <= level]
        return sorted(good, reverse=True)

    def alarm(self, kl: float | None) -> bool:
        level = self.settings.alarm_level
        return level is not None and kl is not None and kl > level

    def rollback(self, restored: State) -> None:
        """Back to a checkpoint's state, the coefficient tightened by the factor (clamped)."""
        s = self.settings
        rollbacks = self.state.rollbacks + 1
        self.state = State.from_json(restored.to_json())
        self.state.rollbacks = rollbacks
        if s.controller is not None:
            self.state.value = clamp(self.state.value * s.factor, s.vmin, s.vmax)
        else:
            self.state.scale *= s.factor


def replay(settings: Settings, records: list[dict]) -> list[str]:
    """Recompute the coefficient from a run's metrics.jsonl records (file order) and its settings; the differences
    found, each a sentence (none: the logged coefficient follows its rule exactly). Every controller decision is
    the rule applied to the KLs it lists, starting from the value the rule holds there; every train record's
    coefficient is the one in effect for its step (a controller's from the last decision before it); each rollback
    restores the checkpoint's value and tightens it by the factor."""
    key = "beta" if settings.controlled == "beta" else "kl_coef"
    rule = Rule(settings)
    changes = [(0, settings.start)]  # (after step, the controller's value from then on)
    problems: list[str] = []

    def in_effect(step: int) -> float:
        if settings.controller is None:
            return rule.coefficient(step - 1)
        return next(v for s, v in reversed(changes) if s < step)

    for r in records:
        event, step = r.get("event"), r.get("step", 0)
        if event == "kl_control" and settings.controller is not None:
            window = list(r.get("kl_window") or [])
            if r.get("before") != rule.state.value:
                problems.append(f"step {step}: the controller started from {key} {r.get('before')!r}, the rule holds "
                                f"{rule.state.value!r}")
            rule.state.window, rule.state.window_pairs, rule.state.window_steps = window, r.get("pairs", 0), \
                settings.every - 1
            decision = rule.end_step(step - 1)
            if decision["kl"] != r.get("kl"):
                problems.append(f"step {step}: the controller's KL {r.get('kl')!r} is not the mean of the KLs it "
                                f"lists ({decision['kl']!r})")
            if decision["after"] != r.get("after"):
                problems.append(f"step {step}: {key} after the decision is logged as {r.get('after')!r}, the rule "
                                f"gives {decision['after']!r} ({decision['action']} on KL {decision['kl']!r})")
            changes.append((step, rule.state.value))
        elif event == "kl_rollback":
            to = r["to_step"]
            changes[:] = [c for c in changes if c[0] <= to]
            if settings.controller is not None and r["restored"].get("value") != changes[-1][1]:
                problems.append(f"rollback at step {step}: the restored {key} {r['restored'].get('value')!r} is not "
                                f"the rule's after step {to} ({changes[-1][1]!r})")
            rule.rollback(State.from_json(r["restored"]))
            changes.append((to, rule.state.value))
            if r.get("after") != rule.coefficient(to):
                problems.append(f"rollback at step {step}: {key} logged as {r.get('after')!r}, the rule gives "
                                f"{rule.coefficient(to)!r}")
        elif event is None and "loss" in r:  # a training step's record: it must say the coefficient it used
            want = in_effect(step)
            if key not in r:
                problems.append(f"step {step}: no {key} logged, the rule gives {want!r}")
            elif r[key] != want:
                problems.append(f"step {step}: {key} logged as {r[key]!r}, the rule gives {want!r}")
    return problems
