"""train-dpo governing β by the KL of a top-k cache (issue 35, dpo/kl_governor.py): the refusals, a band controller
end to end (β rises by exactly the factor per interval to its clamp, logged at full precision, replayed by the rule
and failed when one β is edited), a resumed run equal to the uninterrupted one, and an alarm that rolls back to the
checkpoint whose weights were under the level, tightens β, and stops with its own exit code when it fires again."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from conftest import DATA, audit_ref, records
from dpo.kl_governor import EXIT_KL_ALARM, KLAlarmStop, check_kl_options
from dpo.config import TrainConfig
from dpo.recipe import run_train
from runtime.errors import JobError
from runtime.kl_control import Settings, replay

MODEL = DATA / "sft-model"


def config(kl_pairs, out, **options) -> TrainConfig:
    data, cache = kl_pairs
    base = dict(model=str(MODEL), data=str(data), ref_cache=str(cache), output_dir=str(out), use_cpu=True,
                per_device_train_batch_size=4, max_steps=6, logging_steps=1, learning_rate=1e-4, save_steps=2,
                plot=False, seed=1)
    return TrainConfig(**(base | options))


@pytest.mark.parametrize("options, says", [
    (dict(kl_target="0.02:0.01"), "LO:HI with LO < HI"),
    (dict(kl_target="0.01:0.02", kl_adapt_factor=1.0), "--kl-adapt-factor 1 must be > 1"),
    (dict(kl_target="0.01:0.02", beta_min=0.5, beta_max=0.1), "--beta-min 0.5 must be below --beta-max 0.1"),
    (dict(kl_target="0.01:0.02", beta_schedule="linear", beta_end=0.01), "one owner of β"),
    (dict(beta_schedule="cosine"), "needs --beta-end"),
    (dict(kl_target="0.01", kl_controller="band"), "LO:HI"),
    (dict(kl_target="0.01:0.02", kl_controller="proportional"), "one target T"),
    (dict(kl_target="0.01:0.02", kl_control="kl_coef"), "--kl-coef, which is 0"),
    (dict(kl_alarm="0.5:explode"), "the action must be one of"),
])
def test_inconsistent_options_are_refused(tmp_path, options, says):
    cfg = TrainConfig(model="m", data="d", output_dir=str(tmp_path), ref_cache="c", **options)
    with pytest.raises((JobError, ValueError), match=says.replace("(", r"\(").replace(")", r"\)")):
        check_kl_options(cfg)


@pytest.mark.parametrize("option", [dict(kl_target="0.01:0.02"), dict(kl_alarm="0.5:stop")])
def test_a_controller_or_alarm_without_a_top_k_cache_is_refused_naming_precompute_ref(dpo_data, dpo_cache, llama_dir,
                                                                                      tmp_path, option):
    cfg = TrainConfig(model=str(llama_dir), data=str(dpo_data), ref_cache=str(dpo_cache), output_dir=str(tmp_path / "o"),
                      use_cpu=True, **option)
    with pytest.raises(JobError, match=r"precompute-ref .* --top-k 32"):
        run_train(cfg, log=lambda m: None)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def betas(out) -> dict[int, float]:
    return {r["step"]: r["beta"] for r in records(out) if "loss" in r}


def test_a_band_below_the_kl_raises_beta_by_the_factor_to_its_clamp_and_a_resume_equals_it(kl_pairs, tmp_path):
    out = tmp_path / "run"
    cfg = config(kl_pairs, out, kl_target="1e-9:2e-9", kl_adapt_every=2, beta=0.1, beta_max=0.15)
    run_train(cfg, log=lambda m: None)
    decisions = [r for r in records(out) if r.get("event") == "kl_control"]
    assert [d["step"] for d in decisions] == [2, 4, 6]
    assert [d["after"] for d in decisions] == [0.1 * 1.2, 0.1 * 1.2 * 1.2, 0.15]  # exactly, then the clamp
    assert betas(out) == {1: 0.1, 2: 0.1, 3: 0.1 * 1.2, 4: 0.1 * 1.2, 5: 0.1 * 1.2 * 1.2, 6: 0.1 * 1.2 * 1.2}
    first = next(r for r in records(out) if r.get("step") == 1 and "loss" in r)
    assert first["kl/band_low"] == 1e-9 and 0 <= first["kl/measured"] <= 1e-7
    manifest = json.loads((out / "run-manifest.json").read_text())
    settings = Settings.from_json(manifest["kl_control"]["settings"])
    assert manifest["kl_control"]["final"] == 0.15 and settings.controller == "band"
    assert replay(settings, records(out)) == []
    lines = (out / "metrics.jsonl").read_text().splitlines()
    edited = [json.loads(line) for line in lines]
    at = next(i for i, r in enumerate(edited) if r.get("step") == 4 and "loss" in r)
    edited[at]["beta"] = 0.1  # one step's β edited
    assert replay(settings, edited) == [f"step 4: beta logged as 0.1, the rule gives {0.1 * 1.2!r}"]
    # audit-ref --run: PASS as written, FAIL once that one β is edited in the file
    code, report, output = audit_ref(kl_pairs[1], "--run", out, json_path=tmp_path / "audit.json")
    checked = {c["name"]: c for c in report["checks"]}["run_kl_control"]
    assert code == 0 and checked["status"] == "PASS", output
    assert "band controller" in checked["detail"] and "no KL alarm" in checked["detail"]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edited))
    code, report, output = audit_ref(kl_pairs[1], "--run", out, json_path=tmp_path / "audit.json")
    checked = {c["name"]: c for c in report["checks"]}["run_kl_control"]
    assert code == 1 and checked["status"] == "FAIL" and "step 4: beta logged as 0.1" in checked["detail"], output
    # a line that is not a record, a record without the rule's fields, a damaged recorded rule: FAIL, never a crash
    damaged = {"metrics.jsonl": [("\n".join(lines[:3] + ['{"step": 4, "beta"'] + lines[4:]) + "\n", "line 4: not a "
                                  "metrics record"),
                                 ("\n".join(line if line != lines[at] else '{"step": 4, "loss": 0.6}'
                                            for line in lines) + "\n", "step 4: no beta logged")]}
    text = (out / "run-manifest.json").read_text()
    manifest["kl_control"]["settings"]["bogus"] = 1
    damaged["run-manifest.json"] = [(json.dumps(manifest), "the recorded kl_control settings are damaged")]
    for name, cases in damaged.items():
        for content, says in cases:
            (out / name).write_text(content)
            code, report, output = audit_ref(kl_pairs[1], "--run", out, json_path=tmp_path / "audit.json")
            checked = {c["name"]: c for c in report["checks"]}["run_kl_control"]
            assert code == 1 and checked["status"] == "FAIL" and says in checked["detail"], output
    (out / "run-manifest.json").write_text(text)
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    # killed after checkpoint-2 and resumed: the same β trajectory exactly, the same losses within 1e-6
    again = tmp_path / "again"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("checkpoint-4", "checkpoint-6"))
    run_train(config(kl_pairs, again, kl_target="1e-9:2e-9", kl_adapt_every=2, beta=0.1, beta_max=0.15,
                     resume_from_checkpoint=str(again / "checkpoint-2")), log=lambda m: None)
    assert betas(again) == betas(out)
    resumed = {r["step"]: r for r in records(again) if "loss" in r}
    for step, r in ((r["step"], r) for r in records(out) if "loss" in r):
        assert abs(resumed[step]["loss"] - r["loss"]) <= 1e-6, step
    assert [r for r in records(again) if r.get("event")] == [r for r in records(out) if r.get("event")]


def test_an_alarm_rolls_back_to_the_checkpoint_under_its_level_tightens_beta_then_stops(kl_pairs, tmp_path,
                                                                                         monkeypatch):
    """KL per step rises with lr 1e-4 (about 2e-4, 7e-4, 1e-3, 3e-3 at steps 2-5): the alarm at 0.002 fires at step
    5; checkpoint-4's weights measured the step-5 KL (over the level), checkpoint-2's the step-3 one (under it), so
    the run rolls back to checkpoint-2 with β x 1.2, fires again, and with no retry left stops (exit code 4)."""
    from dpo.trainer import MetricsFile

    before = {}
    original = MetricsFile.truncate_after

    def keep(self, step):
        before.update({r["step"]: r for r in records(self.path.parent) if "loss" in r})
        original(self, step)

    monkeypatch.setattr(MetricsFile, "truncate_after", keep)
    out = tmp_path / "run"
    lines = []
    with pytest.raises(KLAlarmStop) as stopped:
        run_train(config(kl_pairs, out, kl_alarm="0.002:rollback", kl_alarm_retries=1, max_steps=8), log=lines.append)
    assert stopped.value.exit_code == EXIT_KL_ALARM == 4
    message = str(stopped.value)
    events = [r for r in records(out) if r.get("event") in ("kl_alarm", "kl_rollback")]
    assert [(e["event"], e.get("action")) for e in events] == [("kl_alarm", "rollback"), ("kl_rollback", None),
                                                               ("kl_alarm", "stop")], events
    rollback, stop = events[1], events[2]
    assert rollback["to_step"] == 2 and rollback["checkpoint"] == "checkpoint-2" and events[0]["step"] == 5
    assert rollback["after"] == pytest.approx(0.12) and stop["kl"] > 0.002
    assert f"KL alarm at step {stop['step']}" in message and "0.002" in message
    assert f"--resume-from-checkpoint {out / ('checkpoint-' + str(stop['step']))}" in message
    assert (out / f"checkpoint-{stop['step']}" / "trainer_state.json").is_file()
    assert replay(Settings.from_json(json.loads((out / f"checkpoint-{stop['step']}" / "kl-control.json").read_text())
                                     ["settings"]), records(out)) == []
    logged = {r["step"]: r for r in records(out) if "loss" in r}
    # the steps after checkpoint-2 were run again from its weights: step 3 measured the same, then β is tighter
    assert logged[3]["logps/chosen"] == before[3]["logps/chosen"] and logged[3]["beta"] == pytest.approx(0.12)
    assert math.isclose(logged[3]["kl/policy_ref/chosen"], before[3]["kl/policy_ref/chosen"], rel_tol=1e-9)
    assert sum("KL alarm at step" in line for line in lines) == 2 and sum("KL rollback" in line for line in lines) == 1


def test_the_plot_shows_beta_and_the_watched_kl_with_its_band_shaded_and_alarms_marked():
    from dpo.trainer import GOVERNOR_PANELS, KL_WATCHED, PANELS, metric_panels, metrics_figure

    train = [{"step": s, "loss": 0.69, "beta": 0.1 * 1.2 ** (s // 2), "kl/measured": 1e-3 * s, "kl/band_low": 1e-3,
              "kl/band_high": 2e-3, "loss/preference": 0.69} for s in (1, 2, 3, 4)]
    records = train + [{"event": "kl_alarm", "step": 3, "kl": 3e-3, "level": 2.5e-3, "action": "warn"}]
    assert metric_panels(records) == PANELS + GOVERNOR_PANELS
    assert metric_panels([{"step": 1, "loss": 0.7}]) == PANELS
    fig = metrics_figure(records, "t")
    ax = next(a for a in fig.axes if a.get_title() == KL_WATCHED)
    assert len(ax.patches) == 1  # the band
    band = ax.patches[0].get_path().get_extents().transformed(ax.patches[0].get_patch_transform())
    assert band is not None
    alarms = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(alarms) == 1 and list(alarms[0].get_xdata()) == [3, 3]
    beta = next(a for a in fig.axes if a.get_title().startswith("β"))
    assert [line.get_gid() for line in beta.lines] == ["beta"]


def test_a_linear_schedule_after_the_warm_up_is_logged_and_replayed(llama_dir, dpo_data, dpo_cache, tmp_path):
    """4 steps, 1 of warm-up (the Trainer's --warmup-steps): β 0.1, 0.1, then half way, then --beta-end; no top-k
    cache needed for a schedule."""
    out = tmp_path / "run"
    run_train(TrainConfig(model=str(llama_dir), data=str(dpo_data), ref_cache=str(dpo_cache), output_dir=str(out),
                          use_cpu=True, per_device_train_batch_size=4, max_steps=4, logging_steps=1, warmup_steps=1,
                          save_strategy="no", plot=False, beta_schedule="linear", beta=0.1, beta_end=0.001),
              log=lambda m: None)
    assert betas(out) == {1: 0.1, 2: 0.1, 3: 0.1 * 0.5 + 0.001 * 0.5, 4: 0.001}
    manifest = json.loads((out / "run-manifest.json").read_text())
    settings = Settings.from_json(manifest["kl_control"]["settings"])
    assert (settings.total, settings.warmup, manifest["kl_control"]["final"]) == (4, 1, 0.001)
    assert replay(settings, records(out)) == []
    card = (out / "README.md").read_text()
    assert "linear schedule of beta" in card and "final beta" in card
