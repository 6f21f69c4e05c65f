"""train-dpo's KL governance (issue 35): the options' checks, and the Trainer callback that applies the rule of
runtime/kl_control.py (β schedules, the band and proportional KL controllers, alarms and rollbacks) to the loss,
logs it, and keeps its state in every checkpoint (kl-control.json). Kept apart from dpo/trainer.py, which it reaches
through two generic hooks (`batch_observers`, `log_extras`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from transformers import TrainerCallback

from schemas.findings import labelled
from runtime.terminal import echo
from runtime.errors import JobError
from runtime.kl_control import Rule, Settings, State, measured, parse_alarm, parse_target
from storage.files import atomic_write

STATE_FILE = "kl-control.json"
EXIT_KL_ALARM = 4  # train-dpo's exit code when a KL alarm stops the run (3: a non-finite loss, runtime.cli.EXIT_NON_FINITE)


class KLAlarmStop(JobError):
    """A KL alarm with `stop` (or a rollback with no checkpoint or retry left): the run saved a checkpoint and ends
    with its own exit code."""

    exit_code = EXIT_KL_ALARM


def governs(cfg) -> bool:
    """Whether the options ask for anything beyond a fixed β."""
    return cfg.beta_schedule != "constant" or cfg.kl_target is not None or cfg.kl_alarm is not None


def needs_top_k(cfg) -> str | None:
    """The option that needs a top-k cache (the KL it acts on), or None."""
    return "--kl-target" if cfg.kl_target is not None else "--kl-alarm" if cfg.kl_alarm is not None else None


def check_kl_options(cfg) -> None:
    """Refuse what the options alone show is inconsistent (before any cache or model is read)."""
    if cfg.beta_min >= cfg.beta_max:
        raise JobError(f"--beta-min {cfg.beta_min:g} must be below --beta-max {cfg.beta_max:g} (they bound the "
                       "controlled coefficient)")
    if cfg.kl_adapt_factor <= 1:
        raise JobError(f"--kl-adapt-factor {cfg.kl_adapt_factor:g} must be > 1 (it multiplies above the band and "
                       "divides below it)")
    if cfg.beta_schedule != "constant" and cfg.beta_end is None:
        raise JobError(f"--beta-schedule {cfg.beta_schedule} needs --beta-end (the β of the last step)")
    if cfg.kl_target is not None:
        target = parse_target(cfg.kl_target)
        if cfg.beta_schedule != "constant":
            raise JobError(f"--kl-target and --beta-schedule {cfg.beta_schedule} both set β: one owner of β, "
                           "drop one of them")
        if cfg.kl_controller == "band" and (len(target) != 2 or target[0] >= target[1]):
            raise JobError(f"--kl-target {cfg.kl_target}: the band controller needs LO:HI with LO < HI")
        if cfg.kl_controller == "proportional" and len(target) != 1:
            raise JobError(f"--kl-target {cfg.kl_target}: the proportional controller needs one target T")
        if cfg.kl_control == "kl_coef" and not cfg.kl_coef:
            raise JobError("--kl-control kl_coef controls --kl-coef, which is 0: give its starting value "
                           "(--kl-coef C > 0)")
        start = cfg.kl_coef if cfg.kl_control == "kl_coef" else cfg.beta
        if not cfg.beta_min <= start <= cfg.beta_max:
            raise JobError(f"the controlled coefficient starts at {start:g}, outside --beta-min {cfg.beta_min:g} / "
                           f"--beta-max {cfg.beta_max:g}")
    elif cfg.kl_control != "beta":
        raise JobError("--kl-control kl_coef needs a controller (--kl-target)")
    if cfg.kl_alarm is not None:
        parse_alarm(cfg.kl_alarm)


def settings_of(cfg) -> Settings:
    """The rule's settings from the options (total and warm-up steps are the Trainer's, set when training starts)."""
    target = parse_target(cfg.kl_target) if cfg.kl_target is not None else ()
    level, action = parse_alarm(cfg.kl_alarm) if cfg.kl_alarm is not None else (None, "warn")
    band = cfg.kl_controller == "band" and len(target) == 2
    return Settings(
        start=cfg.kl_coef if cfg.kl_control == "kl_coef" else cfg.beta, controlled=cfg.kl_control,
        schedule=cfg.beta_schedule, end=cfg.beta_end,
        controller=cfg.kl_controller if target else None,
        low=target[0] if band else None, high=target[1] if band else None,
        target=target[0] if target and not band else None, horizon=cfg.kl_horizon if target and not band else None,
        every=cfg.kl_adapt_every, factor=cfg.kl_adapt_factor, vmin=cfg.beta_min, vmax=cfg.beta_max,
        measure=cfg.kl_measure, alarm_level=level, alarm_action=action, alarm_retries=cfg.kl_alarm_retries)


class KLGovernor(TrainerCallback):
    """Sets the step's coefficient before it runs, feeds the rule each training micro-batch's KL (the gathered
    means: the same on every rank), writes decisions and alarms to metrics.jsonl (`write`: rank 0's MetricsFile
    append, else None) and the console, saves its state in each checkpoint, and leaves a pending stop or rollback
    for `train` to carry out after the Trainer's loop returns."""

    def __init__(self, settings: Settings, output_dir: Path, write=None, log=echo, run_id: str | None = None):
        self.settings, self.out, self.write, self.log, self.run_id = settings, Path(output_dir), write, log, run_id
        self.rule = Rule(settings)
        self.trainer = None
        self.used = settings.start
        self.interval_kl = None
        self.events: list[dict] = []
        self.pending: dict | None = None

    def attach(self, trainer) -> None:
        self.trainer = trainer
        trainer.batch_observers.append(self.observe)
        trainer.log_extras.append(self.extras)

    # -- the rule's inputs and outputs
    def observe(self, split: str, means: dict, pairs: int) -> None:
        if split == "train" and "kl/policy_ref/chosen" in means:
            self.rule.observe(measured(means, self.settings.measure), pairs)

    def extras(self, split: str) -> dict:
        if split != "train":
            return {}
        s = self.settings
        out = {"beta": self.trainer.loss_config.beta}
        if s.controlled == "kl_coef":
            out["kl_coef"] = self.trainer.loss_config.kl_coef
        if self.interval_kl is not None:
            out["kl/measured"] = self.interval_kl
        if s.low is not None:
            out["kl/band_low"], out["kl/band_high"] = s.low, s.high
        if s.target is not None:
            out["kl/target"] = s.target
        return out

    def _emit(self, record: dict, line: str) -> None:
        if record.get("event") in ("kl_alarm", "kl_rollback"):
            self.events.append(record)
        if self.write is not None:
            self.write(record)
            self.log(line)

    # -- Trainer events
    def on_train_begin(self, args, state, control, **kwargs):
        if self.settings.schedule != "constant":
            self.settings = dataclasses.replace(self.settings, total=state.max_steps,
                                                warmup=args.get_warmup_steps(state.max_steps))
            self.rule.settings = self.settings

    def on_step_begin(self, args, state, control, **kwargs):
        self.used = self.rule.coefficient(state.global_step)
        name = "kl_coef" if self.settings.controlled == "kl_coef" else "beta"
        setattr(self.trainer.loss_config, name, self.used)

    def on_step_end(self, args, state, control, **kwargs):
        decision = self.rule.end_step(state.global_step - 1)
        if decision is not None:
            name = self.settings.controlled
            self._emit(decision, f"KL control at step {decision['step']}: KL {decision['kl']:.3g} -> {name} "
                                 f"{decision['before']:.6g} -> {decision['after']:.6g} ({decision['action']})")
        if control.should_log:
            self.interval_kl = kl = self.rule.logged()
            if self.rule.alarm(kl):
                self._alarm(state.global_step, kl, control)
        if control.should_save:  # on every rank, so that each picks the same rollback
            self.rule.saved(state.global_step)

    def _alarm(self, step: int, kl: float, control) -> None:
        s = self.settings
        action = s.alarm_action
        if action == "rollback":
            target = self._rollback_target() if self.rule.state.rollbacks < s.alarm_retries else None
            if target is None:
                action = "stop"
        record = {"event": "kl_alarm", "step": step, "kl": kl, "level": s.alarm_level, "action": action}
        if action == "checkpoint":
            control.should_save = True
        elif action == "stop":
            control.should_save = control.should_training_stop = True
            self.pending = {"action": "stop", "step": step, "kl": kl}
        elif action == "rollback":
            control.should_training_stop = True
            record["to_step"] = target[0]
            self.pending = {"action": "rollback", "step": step, "kl": kl, "folder": target[1], "to_step": target[0]}
        self._emit(record, f"KL alarm at step {step}: KL {kl:.4g} > {s.alarm_level:g} nats per token; {action}")

    def _rollback_target(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint of this run (its run id in kl-control.json) whose weights measured a KL
        at most the level (on the batches of the step after it)."""
        from .resume import resumable  # this run's complete checkpoints by their record; never a symbolic link

        own = {folder.name: folder for folder in resumable(self.out, self.run_id)}
        for step in self.rule.rollback_candidates(self.settings.alarm_level):
            folder = own.get(f"checkpoint-{step}")
            saved = read_state(folder) if folder is not None and not (folder / STATE_FILE).is_symlink() else None
            if saved is not None and saved.get("run_id") == self.run_id:
                return step, folder
        return None

    def summary(self) -> dict:
        """The run manifest's `kl_control` section: the settings, the final coefficient and every alarm."""
        return {"settings": self.settings.to_json(), "final": self.rule.coefficient(max(self.settings.total - 1, 0)),
                "rollbacks": self.rule.state.rollbacks, "alarms": self.events}

    # -- checkpoints
    def save(self, folder: Path) -> None:
        """Into each checkpoint (rank 0, before its trainer_state.json marks it complete); not the final model."""
        if not Path(folder).name.startswith("checkpoint-"):
            return
        data = json.dumps({"run_id": self.run_id, "settings": self.settings.to_json(),
                           "state": self.rule.state.to_json(), "events": self.events}, indent=1) + "\n"
        atomic_write(Path(folder) / STATE_FILE, lambda f: f.write(data.encode()))

    def restore(self, folder: Path) -> None:
        """A resume: the state the checkpoint kept, once check_resumed_rule has found its rule to be this run's."""
        saved = check_resumed_rule(Path(folder), self.settings)
        self.rule.state = State.from_json(saved["state"])
        self.events = list(saved.get("events", []))

    def roll_back(self, metrics_file) -> Path:
        """Carry out the pending rollback: the checkpoint's state, tightened; metrics.jsonl without the records the
        rolled-back steps wrote (the alarm records stay). Returns the checkpoint to resume from."""
        pending, self.pending = self.pending, None
        folder = pending["folder"]
        restored = State.from_json(read_state(folder)["state"])
        self.rule.rollback(restored)
        after = self.rule.coefficient(pending["to_step"])
        record = {"event": "kl_rollback", "step": pending["step"], "kl": pending["kl"],
                  "level": self.settings.alarm_level, "to_step": pending["to_step"], "restored": restored.to_json(),
                  "after": after, "checkpoint": folder.name, "rollback": self.rule.state.rollbacks}
        if metrics_file is not None:
            metrics_file.truncate_after(pending["to_step"])
        self._emit(record, f"KL rollback: restored {folder.name}, {self.settings.controlled} now {after:.6g} "
                           f"(rollback {self.rule.state.rollbacks} of {self.settings.alarm_retries})")
        return folder

    def stop_message(self) -> str:
        p = self.pending
        folder = self.out / f"checkpoint-{p['step']}"
        return (f"KL alarm at step {p['step']}: KL(policy || reference) {p['kl']:.4g} nats per token is above the "
                f"--kl-alarm level {self.settings.alarm_level:g}; the run stopped after saving {folder}. To go on "
                f"from there, run the same train-dpo command with --resume-from-checkpoint {folder} (and another "
                "--kl-alarm, --learning-rate or β if the KL should not be stopped there again)")


# Settings field -> the option that sets it (the total and warm-up are the Trainer's, resolved when training starts)
OPTION_OF = {"start": "--beta / --kl-coef", "controlled": "--kl-control", "schedule": "--beta-schedule",
             "end": "--beta-end", "controller": "--kl-controller", "low": "--kl-target", "high": "--kl-target",
             "target": "--kl-target", "horizon": "--kl-horizon", "every": "--kl-adapt-every",
             "factor": "--kl-adapt-factor", "vmin": "--beta-min", "vmax": "--beta-max", "measure": "--kl-measure",
             "alarm_level": "--kl-alarm", "alarm_action": "--kl-alarm", "alarm_retries": "--kl-alarm-retries"}


def check_resumed_rule(folder: Path, settings: Settings | None) -> dict | None:
    """A resumed run goes on under the β rule its checkpoint was trained with, or is refused (exit 2) naming the
    difference: a checkpoint of a KL-governed run resumed without its options (or with other values), one of a
    fixed-β run resumed with a rule, a damaged kl-control.json. Returns the checkpoint's saved rule (None: none)."""
    path = Path(folder) / STATE_FILE
    remedy = ("resume with the options the checkpoint was trained with, or start a new run with these into another "
              "--output-dir")
    if not path.exists() and not path.is_symlink():
        if settings is not None and settings.active:
            raise JobError(f"--resume-from-checkpoint {folder}: the checkpoint was trained with a fixed β (it holds "
                           f"no {STATE_FILE}), this run sets β by a rule ({describe(settings)}); {remedy}")
        return None
    saved = read_state(folder)
    if saved is None or path.is_symlink() or not isinstance(saved.get("state"), dict):
        raise JobError(f"--resume-from-checkpoint {folder}: {path} is damaged (not the β rule's state train-dpo "
                       "wrote), so the rule cannot go on from it; resume from an earlier checkpoint of this run")
    try:
        theirs = Settings.from_json(saved["settings"])
        State.from_json(saved["state"])
    except (KeyError, TypeError, ValueError):
        raise JobError(f"--resume-from-checkpoint {folder}: {path} is damaged (its settings or state do not read); "
                       "resume from an earlier checkpoint of this run") from None
    if settings is None or not settings.active:
        raise JobError(f"--resume-from-checkpoint {folder}: the checkpoint was trained under a β rule "
                       f"({describe(theirs)}), this run has a fixed β; {remedy}")
    ignore = {"total", "warmup"}
    ours, recorded = settings.to_json(), theirs.to_json()
    differ = sorted({OPTION_OF[k] for k in ours if k not in ignore and ours[k] != recorded.get(k)})
    if differ:
        sides = "\n".join(labelled(("the checkpoint", "this run"), describe(theirs), describe(settings)))
        raise JobError(f"--resume-from-checkpoint {folder}: the β rule differs in {', '.join(differ)}\n{sides}\n"
                       f"  {remedy}")
    return saved


def describe(s: Settings) -> str:
    """A β rule in the options' words, one line."""
    parts = [f"{'--kl-coef' if s.controlled == 'kl_coef' else '--beta'} {s.start:g}"]
    if s.schedule != "constant":
        parts.append(f"--beta-schedule {s.schedule} --beta-end {s.end:g}")
    if s.controller == "band":
        parts.append(f"--kl-target {s.low:g}:{s.high:g} --kl-adapt-every {s.every} --kl-adapt-factor {s.factor:g}")
    elif s.controller == "proportional":
        parts.append(f"--kl-controller proportional --kl-target {s.target:g} --kl-horizon {s.horizon:g} "
                     f"--kl-adapt-every {s.every}")
    if s.controller is not None:
        parts.append(f"--beta-min {s.vmin:g} --beta-max {s.vmax:g} --kl-measure {s.measure}")
    if s.alarm_level is not None:
        parts.append(f"--kl-alarm {s.alarm_level:g}:{s.alarm_action}"
                     + (f" --kl-alarm-retries {s.alarm_retries}" if s.alarm_action == "rollback" else ""))
    return " ".join(parts)


def read_state(folder: Path) -> dict | None:
    path = Path(folder) / STATE_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None  # a list or a number is no state of ours: damaged


def train(trainer, governor: KLGovernor | None, resume: str | None, metrics_file) -> object:
    """trainer.train (resuming the governor's state too), then any rollback the governor asked for (resume from
    the checkpoint it chose), or its stop (KLAlarmStop: exit code 4, naming the step, the KL, the level and the
    command that resumes). `resume`: the checkpoint folder (--resume-from-checkpoint, resolved)."""
    if resume:
        if governor is not None:
            governor.restore(Path(resume))
        else:
            check_resumed_rule(Path(resume), None)
        load_beta_dpo(trainer, Path(resume))
    result = trainer.train(resume_from_checkpoint=resume)
    while governor is not None and governor.pending is not None:
        if governor.pending["action"] == "stop":
            raise KLAlarmStop(governor.stop_message())
        folder = governor.roll_back(metrics_file)
        load_beta_dpo(trainer, folder)
        result = trainer.train(resume_from_checkpoint=str(folder))
    return result


BETA_DPO_FILE = "beta-dpo.json"


def save_beta_dpo(trainer, folder: Path) -> None:
    """β-DPO's moving state (dpo/losses.py BetaDPO) into a checkpoint, so a resume continues it exactly."""
    if getattr(trainer, "beta_dpo", None) is not None and Path(folder).name.startswith("checkpoint-"):
        data = json.dumps(trainer.beta_dpo.state_dict()).encode()
        atomic_write(Path(folder) / BETA_DPO_FILE, lambda f: f.write(data))


def load_beta_dpo(trainer, folder: Path) -> None:
    path = Path(folder) / BETA_DPO_FILE
    if getattr(trainer, "beta_dpo", None) is not None and path.is_file():
        trainer.beta_dpo.load_state_dict(json.loads(path.read_text()))
