"""audit-ref --run's run_kl_control on a run whose recorded rule or metrics.jsonl is damaged: FAIL with the reason
(the file, and the line for a metrics record), never a crash and never a SKIP."""

import json

import pytest

from audit.runs import audit_kl_control
from runtime.kl_control import Rule, Settings

SETTINGS = Settings(start=0.1, schedule="linear", end=0.2, total=3)


def _run(tmp_path, settings=None, lines=None):
    if lines is None:
        rule = Rule(SETTINGS)
        lines = [json.dumps({"step": s, "loss": 0.69, "beta": rule.coefficient(s - 1)}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    section = {"settings": SETTINGS.to_json() if settings is None else settings, "final": 0.2}
    return audit_kl_control(str(tmp_path), {"kl_control": section})


def test_an_intact_governed_run_passes(tmp_path):
    (check,) = _run(tmp_path)
    assert check.status == "PASS", check.detail


@pytest.mark.parametrize("change", [
    {"every": 0}, {"every": "2"}, {"start": float("nan")}, {"start": -0.1}, {"schedule": "sideways"},
    {"controller": "pid"}, {"alarm_action": "explode"}, {"factor": True}, {"bogus": 1}, {"total": 2.5}])
def test_damaged_recorded_settings_fail_naming_the_manifest(tmp_path, change):
    (check,) = _run(tmp_path, settings={**SETTINGS.to_json(), **change})
    assert check.status == "FAIL" and "run-manifest.json" in check.detail and "damaged" in check.detail
    assert next(iter(change)) in check.detail


@pytest.mark.parametrize("section", [{}, [], "linear", 5, {"settings": None}, {"settings": []}])
def test_a_kl_control_section_that_is_not_a_rule_fails_not_skips(tmp_path, section):
    (tmp_path / "metrics.jsonl").write_text("", encoding="utf-8")
    (check,) = audit_kl_control(str(tmp_path), {"kl_control": section})
    assert check.status == "FAIL" and "damaged" in check.detail


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", "NaN"])
def test_a_malformed_metrics_line_fails_naming_the_file_and_line(tmp_path, bad):
    rule = Rule(SETTINGS)
    lines = [json.dumps({"step": 1, "loss": 0.69, "beta": rule.coefficient(0)}), bad]
    (check,) = _run(tmp_path, lines=lines)
    assert check.status == "FAIL" and "metrics.jsonl line 2" in check.detail


@pytest.mark.parametrize("record", [{"event": "kl_alarm"}, {"event": "kl_rollback", "step": 2},
                                    {"event": "kl_rollback", "step": 2, "to_step": 1, "restored": "x"},
                                    {"step": "two", "loss": 0.69, "beta": 0.1}])
def test_a_record_the_rule_cannot_read_fails_not_crashes(tmp_path, record):
    (check,) = _run(tmp_path, lines=[json.dumps(record)])
    assert check.status == "FAIL" and "metrics.jsonl" in check.detail
