"""The rule of β over a run (runtime/kl_control.py): schedules, the band and proportional controllers and the replay
audit-ref runs, against values computed by hand here."""

from __future__ import annotations

import math

import pytest

from runtime.kl_control import Rule, Settings, State, band_update, proportional_update, replay, scheduled


@pytest.mark.parametrize("schedule, step, want", [
    ("constant", 7, 0.1),
    ("linear", 0, 0.1), ("linear", 5, 0.0505), ("linear", 10, 0.001),
    ("cosine", 0, 0.1), ("cosine", 2, 0.001 + 0.099 * (1 + 0.8090169943749475) / 2), ("cosine", 5, 0.0505),
    ("cosine", 10, 0.001),
    ("exponential", 0, 0.1), ("exponential", 2, 0.1 * 10 ** -0.4), ("exponential", 5, 0.01), ("exponential", 10, 0.001),
])
def test_schedules_over_11_steps_from_0_1_to_0_001(schedule, step, want):
    assert scheduled(schedule, 0.1, 0.001, step, 11, 0) == pytest.approx(want, rel=1e-12)


def test_warm_up_holds_the_start_and_the_schedule_spans_the_rest():
    # 12 steps, 2 of warm-up: steps 0-2 at 0.1, step 11 at the end, step 6 four ninths of the way
    assert [scheduled("linear", 0.1, 0.001, s, 12, 2) for s in (0, 1, 2)] == [0.1, 0.1, 0.1]
    assert scheduled("linear", 0.1, 0.001, 6, 12, 2) == pytest.approx(0.1 - 0.099 * 4 / 9, rel=1e-12)
    assert scheduled("linear", 0.1, 0.001, 11, 12, 2) == pytest.approx(0.001, rel=1e-12)
    assert scheduled("linear", 0.1, 0.001, 40, 12, 2) == pytest.approx(0.001, rel=1e-12)  # past the end: the end


def simulate(settings: Settings, kls: list[float], pairs: int = 8):
    """One micro-batch per step: the coefficient each step used and the decisions."""
    rule, used, decisions = Rule(settings), [], []
    for step, kl in enumerate(kls):
        used.append(rule.coefficient(step))
        rule.observe(kl, pairs)
        decision = rule.end_step(step)
        if decision:
            decisions.append(decision)
    return used, decisions, rule


BAND = Settings(start=0.1, controller="band", low=0.01, high=0.02, every=2, factor=1.2, vmin=0.001, vmax=0.5)


def test_band_controller_against_a_hand_simulated_kl_sequence_with_its_clamp():
    kls = [0.03, 0.05,  # mean 0.04 > 0.02: x 1.2
           0.015, 0.015,  # inside: hold
           0.001, 0.003,  # mean 0.002 < 0.01: / 1.2
           ] + [1.0] * 20  # far above: x 1.2 each interval until the clamp at 0.5
    used, decisions, _ = simulate(BAND, kls)
    assert [d["action"] for d in decisions[:3]] == ["raise", "hold", "lower"]
    values = [d["after"] for d in decisions]
    hand = [0.12, 0.12, 0.1, 0.12, 0.144, 0.1728, 0.20736, 0.248832, 0.2985984, 0.35831808, 0.429981696, 0.5, 0.5]
    assert values == pytest.approx(hand, rel=1e-12)
    assert [d["kl"] for d in decisions[:3]] == pytest.approx([0.04, 0.015, 0.002])
    assert used[:6] == pytest.approx([0.1, 0.1, 0.12, 0.12, 0.12, 0.12])  # a decision acts from the next step
    # and below the band to the lower clamp
    low = Settings(start=0.0012, controller="band", low=0.01, high=0.02, every=1, factor=1.2, vmin=0.001, vmax=0.5)
    assert [d["after"] for d in simulate(low, [0.0] * 2)[1]] == pytest.approx([0.001, 0.001])


def test_proportional_controller_is_ziegler_et_al_against_a_hand_simulated_sequence():
    settings = Settings(start=0.1, controller="proportional", target=0.01, horizon=100.0, every=1, vmin=0.001,
                        vmax=0.5)
    _, decisions, _ = simulate(settings, [0.02, 0.009, 0.0, 0.01], pairs=8)
    hand, value = [], 0.1
    for error in (0.2, -0.1, -0.2, 0.0):  # clip(KL / 0.01 - 1, -0.2, 0.2)
        value *= 1 + error * 8 / 100
        hand.append(value)
    assert [d["after"] for d in decisions] == pytest.approx(hand, rel=1e-12)
    assert proportional_update(0.49, 1.0, 0.01, 10000, 100.0, 0.001, 0.5) == (0.5, "raise")  # clamped
    assert band_update(0.1, 0.015, 0.01, 0.02, 1.2, 0.001, 0.5) == (0.1, "hold")


def records_of(settings: Settings, kls: list[float]) -> list[dict]:
    """metrics.jsonl as train-dpo writes it for one micro-batch per step, logged every step."""
    rule, out = Rule(settings), []
    key = "beta" if settings.controlled == "beta" else "kl_coef"
    for step, kl in enumerate(kls):
        used = rule.coefficient(step)
        rule.observe(kl, 8)
        decision = rule.end_step(step)
        if decision:
            out.append(decision)
        out.append({"step": step + 1, "loss": 0.69, key: used, "kl/policy_ref/chosen": kl})
    return out


@pytest.mark.parametrize("settings", [BAND, Settings(start=0.1, schedule="cosine", end=0.01, total=8),
                                      Settings(start=0.1, controller="proportional", target=0.02, horizon=50.0)],
                         ids=["band", "cosine", "proportional"])
def test_the_replay_follows_a_run_and_fails_one_edited_beta(settings):
    records = records_of(settings, [0.03, 0.05, 0.015, 0.015, 0.001, 0.003, 0.5, 0.5])
    assert replay(settings, records) == []
    edited = [dict(r) for r in records]
    at = next(i for i, r in enumerate(edited) if r.get("step") == 5 and "loss" in r)
    edited[at]["beta"] = math.nextafter(edited[at]["beta"], 1.0)  # one ulp
    problems = replay(settings, edited)
    assert len(problems) == 1 and problems[0].startswith("step 5: beta logged as")


def test_the_replay_follows_a_rollback_and_names_a_wrong_tightening():
    rule = Rule(BAND)
    restored = State(value=0.144)
    rule.rollback(restored)
    assert rule.state.value == pytest.approx(0.1728) and rule.state.rollbacks == 1
    records = [{"event": "kl_control", "step": 2, "kl_window": [0.03, 0.05], "kl": 0.04, "pairs": 16,
                "before": 0.1, "after": 0.12},
               {"event": "kl_control", "step": 4, "kl_window": [0.03, 0.05], "kl": 0.04, "pairs": 16,
                "before": 0.12, "after": 0.144},
               {"event": "kl_control", "step": 6, "kl_window": [0.5, 0.5], "kl": 0.5, "pairs": 16,
                "before": 0.144, "after": 0.144 * 1.2},
               {"event": "kl_rollback", "step": 6, "to_step": 4,
                "restored": State(value=0.144).to_json(), "after": 0.144 * 1.2},
               {"step": 5, "loss": 0.6, "beta": 0.144 * 1.2}]
    assert replay(BAND, records) == []
    records[-1]["beta"] = 0.144  # as if the rollback had not tightened it
    assert replay(BAND, records) == [f"step 5: beta logged as 0.144, the rule gives {0.144 * 1.2!r}"]
