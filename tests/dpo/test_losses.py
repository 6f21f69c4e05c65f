"""dpo.losses against hand computation.

Every expected value here is computed from plain Python floats with `math.log` / `math.exp`, following the formulas in
/work/shared/notes/preference-losses.md, never by calling back into torch or dpo.losses.
"""

from __future__ import annotations

import math

import pytest
import torch

from dpo.losses import LOSS_TYPES, TOP_K_LOSSES, LossConfig, dpo_loss, token_weights

# Made-up per-token log-probs for three pairs with different completion lengths (all <= 0, as log-probs are).
# Each pair: (policy chosen, reference chosen, policy rejected, reference rejected), one value per token.
PAIRS = [
    ([-0.5, -1.25, -0.75], [-0.9, -1.5, -1.1], [-2.0, -0.25], [-1.0, -0.5]),
    ([-0.1], [-0.8], [-1.5, -2.5, -0.5, -1.0, -3.0], [-1.2, -2.0, -0.7, -0.4, -2.6]),
    ([-3.0, -0.2, -0.4, -1.0], [-1.0, -0.3, -0.6, -0.5], [-0.6], [-1.9]),
]
N = len(PAIRS)


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logsig(x: float) -> float:
    return -math.log(1.0 + math.exp(-x))


def flat(dtype=torch.float64):
    """Flat tensors in dpo_loss's layout: chosen_0..chosen_{B-1}, rejected_0..rejected_{B-1}."""
    policy = [v for p in PAIRS for v in p[0]] + [v for p in PAIRS for v in p[2]]
    ref = [v for p in PAIRS for v in p[1]] + [v for p in PAIRS for v in p[3]]
    lengths = [len(p[0]) for p in PAIRS] + [len(p[2]) for p in PAIRS]
    return torch.tensor(policy, dtype=dtype), torch.tensor(ref, dtype=dtype), torch.tensor(lengths)


def hand_sums(ld_alpha: float = 1.0):
    """Per pair: lp+, lp-, r+, r-, |y+|, |y-| with the LD-DPO weighting (alpha past the shorter completion)."""
    out = []
    for pc, rc, pr, rr in PAIRS:
        shorter = min(len(pc), len(pr))

        def weighted(values):
            return sum(v if i < shorter else ld_alpha * v for i, v in enumerate(values))

        out.append((weighted(pc), weighted(pr), weighted(rc), weighted(rr), len(pc), len(pr)))
    return out


def hand_pair_loss(loss_type, b, e, lp_pos, lp_neg, r_pos, r_neg, n_pos, n_neg) -> float:
    s_pos, s_neg = lp_pos - r_pos, lp_neg - r_neg
    d = s_pos - s_neg
    if loss_type == "sigmoid":
        return -(1 - e) * logsig(b * d) - e * logsig(-b * d)
    if loss_type == "ipo":
        d_mean = (lp_pos / n_pos - r_pos / n_pos) - (lp_neg / n_neg - r_neg / n_neg)
        return (d_mean - 1 / (2 * b)) ** 2
    if loss_type == "hinge":
        return max(0.0, 1 - b * d)
    if loss_type == "robust":
        return (-(1 - e) * logsig(b * d) + e * logsig(-b * d)) / (1 - 2 * e)
    if loss_type == "bco_pair":
        return -logsig(b * s_pos) - logsig(-b * s_neg)
    if loss_type == "sppo_hard":
        return (s_pos - 1 / (2 * b)) ** 2 + (s_neg + 1 / (2 * b)) ** 2
    if loss_type == "nca_pair":
        return -logsig(b * s_pos) - 0.5 * logsig(-b * s_pos) - 0.5 * logsig(-b * s_neg)
    if loss_type == "apo_zero":
        return (1 - sig(b * s_pos)) + sig(b * s_neg)
    if loss_type == "apo_down":
        return sig(b * s_pos) + (1 - sig(b * d))
    if loss_type == "sigmoid_norm":
        return -logsig(b * (s_pos / n_pos - s_neg / n_neg))
    raise AssertionError(loss_type)


def hand_loss(loss_type, b, e=0.0, ld_alpha=1.0, rpo_alpha=0.0) -> float:
    total = 0.0
    for (lp_pos, lp_neg, r_pos, r_neg, n_pos, n_neg), (pc, _, _, _) in zip(hand_sums(ld_alpha), PAIRS):
        loss = hand_pair_loss(loss_type, b, e, lp_pos, lp_neg, r_pos, r_neg, n_pos, n_neg)
        if rpo_alpha:
            loss += rpo_alpha * (-sum(pc) / len(pc))  # mean per-token NLL of the chosen completion, unweighted
        total += loss
    return total / N


def run(loss_type="sigmoid", beta=0.1, label_smoothing=0.0, ld_alpha=1.0, rpo_alpha=0.0, dtype=torch.float64):
    policy, ref, lengths = flat(dtype)
    cfg = LossConfig(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, rpo_alpha=rpo_alpha,
                     ld_alpha=ld_alpha)
    loss, metrics = dpo_loss(policy, ref, lengths, cfg)
    return loss, metrics


def test_made_up_data_exercises_both_sides_of_every_branch():
    """The batch has pairs the policy prefers and pairs it does not, and hinge's max(0, .) is active and inactive."""
    ds = [(lp_pos - r_pos) - (lp_neg - r_neg) for lp_pos, lp_neg, r_pos, r_neg, _, _ in hand_sums()]
    assert any(d > 0 for d in ds) and any(d < 0 for d in ds)
    assert any(1 - 1.0 * d < 0 for d in ds) and any(1 - 1.0 * d > 0 for d in ds)  # hinge with beta 1.0
    assert len({len(p[0]) for p in PAIRS} | {len(p[2]) for p in PAIRS}) >= 4  # various lengths


CASES = [
    ("sigmoid", 0.1, 0.0),
    ("sigmoid", 0.5, 0.2),  # conservative DPO (cDPO)
    ("ipo", 0.1, 0.0),
    ("ipo", 0.7, 0.0),
    ("hinge", 1.0, 0.0),
    ("robust", 0.3, 0.1),
    ("robust", 0.3, 0.0),
    ("bco_pair", 0.4, 0.0),
    ("sppo_hard", 0.2, 0.0),
    ("nca_pair", 0.6, 0.0),
    ("apo_zero", 0.8, 0.0),
    ("apo_down", 0.8, 0.0),
    ("sigmoid_norm", 0.9, 0.0),
]


def test_cases_cover_every_loss_type():
    # the losses that need the reference's distribution: tests/dpo/test_topk_train.py
    # beta_dpo is sigmoid at its batch's β, with a state: tests/dpo/test_beta_dpo.py
    assert {c[0] for c in CASES} == set(LOSS_TYPES) - set(TOP_K_LOSSES) - {"beta_dpo"}


@pytest.mark.parametrize("loss_type,beta,e", CASES, ids=[f"{c[0]}-b{c[1]}-e{c[2]}" for c in CASES])
def test_loss_matches_hand_computation(loss_type, beta, e):
    loss, _ = run(loss_type, beta, e)
    expected = hand_loss(loss_type, beta, e)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("loss_type,beta,e", CASES, ids=[f"{c[0]}-b{c[1]}-e{c[2]}" for c in CASES])
def test_loss_in_float32(loss_type, beta, e):
    """Training feeds float32 per-token values; the result agrees with the float64 hand value to float32 precision."""
    loss, _ = run(loss_type, beta, e, dtype=torch.float32)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(hand_loss(loss_type, beta, e), rel=1e-5, abs=1e-6)


def test_label_smoothing_changes_sigmoid_and_robust():
    """cDPO and robust DPO are not silently plain DPO: e moves the loss by the hand-computed amount."""
    plain = hand_loss("sigmoid", 0.5)
    assert run("sigmoid", 0.5, 0.2)[0].item() != pytest.approx(plain, rel=1e-6)
    assert run("robust", 0.5, 0.2)[0].item() != pytest.approx(run("sigmoid", 0.5, 0.2)[0].item(), rel=1e-6)
    # robust with e = 0 is plain DPO
    assert run("robust", 0.5, 0.0)[0].item() == pytest.approx(plain, rel=1e-12)


def test_rpo_term_is_mean_per_token_nll_of_chosen():
    b, w = 0.1, 0.5
    loss, _ = run("sigmoid", b, rpo_alpha=w)
    nll = [-sum(pc) / len(pc) for pc, _, _, _ in PAIRS]  # pair 0: (0.5+1.25+0.75)/3, pair 1: 0.1, pair 2: 4.6/4
    assert nll == pytest.approx([2.5 / 3, 0.1, 4.6 / 4])
    expected = hand_loss("sigmoid", b) + w * sum(nll) / N
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert loss.item() == pytest.approx(hand_loss("sigmoid", b, rpo_alpha=w), rel=1e-12)


@pytest.mark.parametrize("ld_alpha", [0.5, 0.25, 0.0])
def test_ld_dpo_weights_tokens_past_the_shorter_completion(ld_alpha):
    b = 0.3
    loss, metrics = run("sigmoid", b, ld_alpha=ld_alpha)
    # Written out for pair 1 (chosen 1 token, rejected 5): only the rejected's first token counts fully.
    pr, rr = PAIRS[1][2], PAIRS[1][3]
    lp_neg = pr[0] + ld_alpha * sum(pr[1:])
    r_neg = rr[0] + ld_alpha * sum(rr[1:])
    s_pos = PAIRS[1][0][0] - PAIRS[1][1][0]
    assert metrics["rewards/rejected"][1].item() == pytest.approx(b * (lp_neg - r_neg), rel=1e-12, abs=1e-15)
    assert metrics["rewards/chosen"][1].item() == pytest.approx(b * s_pos, rel=1e-12)
    assert metrics["logps/rejected"][1].item() == pytest.approx(lp_neg, rel=1e-12)
    assert loss.item() == pytest.approx(hand_loss("sigmoid", b, ld_alpha=ld_alpha), rel=1e-12)
    assert loss.item() != pytest.approx(hand_loss("sigmoid", b), rel=1e-6)  # the weighting did something


def test_ld_alpha_one_is_plain_dpo_and_composes_with_rpo():
    assert run("sigmoid", 0.3, ld_alpha=1.0)[0].item() == pytest.approx(hand_loss("sigmoid", 0.3), rel=1e-12)
    loss, _ = run("sigmoid", 0.3, ld_alpha=0.5, rpo_alpha=0.7)
    # The NLL term uses every chosen token at full weight (mean per-token NLL), not the LD-DPO weights.
    assert loss.item() == pytest.approx(hand_loss("sigmoid", 0.3, ld_alpha=0.5, rpo_alpha=0.7), rel=1e-12)


def test_token_weights_layout():
    # lengths: chosen [3, 1], rejected [2, 4] -> shorter [2, 1]
    w = token_weights(torch.tensor([3, 1, 2, 4]), 2, 0.25)
    assert w.tolist() == [1, 1, 0.25, 1, 1, 1, 1, 0.25, 0.25, 0.25]


def test_metrics_match_hand_computation():
    b = 0.4
    _, m = run("sigmoid", b)
    for i, (pc, rc, pr, rr) in enumerate(PAIRS):
        s_pos, s_neg = sum(pc) - sum(rc), sum(pr) - sum(rr)
        assert m["rewards/chosen"][i].item() == pytest.approx(b * s_pos, rel=1e-12)
        assert m["rewards/rejected"][i].item() == pytest.approx(b * s_neg, rel=1e-12)
        assert m["rewards/margins"][i].item() == pytest.approx(b * s_pos - b * s_neg, rel=1e-12)
        assert m["rewards/accuracies"][i].item() == (1.0 if b * s_pos > b * s_neg else 0.0)
        assert m["logps/chosen"][i].item() == pytest.approx(sum(pc), rel=1e-12)
        assert m["logps/rejected"][i].item() == pytest.approx(sum(pr), rel=1e-12)
        assert m["logps/accuracies"][i].item() == (1.0 if sum(pc) > sum(pr) else 0.0)
        for side, pol, ref in (("chosen", pc, rc), ("rejected", pr, rr)):
            ratios = [p - r for p, r in zip(pol, ref)]
            assert m[f"logratio/{side}"][i].item() == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)
            assert m[f"lengths/{side}"][i].item() == len(pol)
    # Both outcomes occur in this batch, so the accuracy is not trivially 0 or 1.
    assert 0 < m["rewards/accuracies"].mean().item() < 1
    assert all(v.shape == (N,) for v in m.values())
    assert not any(k.startswith("kl") for k in m)  # no KL estimate on tokens not sampled from the policy
    assert not any(v.requires_grad for v in m.values())


def test_gradient_of_sigmoid_loss_per_token():
    """d loss / d lp of each token: -b sig(-b d) / B on chosen tokens, +b sig(-b d) / B on rejected ones."""
    b = 0.5
    policy, ref, lengths = flat()
    policy.requires_grad_(True)
    loss, _ = dpo_loss(policy, ref, lengths, LossConfig(beta=b))
    loss.backward()
    expected_chosen, expected_rejected = [], []
    for pc, rc, pr, rr in PAIRS:
        d = (sum(pc) - sum(rc)) - (sum(pr) - sum(rr))
        g = b * sig(-b * d) / N
        expected_chosen += [-g] * len(pc)
        expected_rejected += [g] * len(pr)
    assert policy.grad.tolist() == pytest.approx(expected_chosen + expected_rejected, rel=1e-12)


def test_policy_equal_to_reference_gives_ln2():
    policy, _, lengths = flat()
    for dtype in (torch.float64, torch.float32):
        p = policy.to(dtype)
        loss, m = dpo_loss(p, p.clone(), lengths, LossConfig(beta=0.1))
        assert loss.item() == pytest.approx(math.log(2), abs=1e-15 if dtype == torch.float64 else 1e-7)
        assert m["rewards/margins"].abs().max().item() == 0
        assert m["logratio/chosen"].abs().max().item() == 0
        assert m["rewards/accuracies"].sum().item() == 0  # a tie is not a win
    loss64, _ = dpo_loss(policy, policy.clone(), lengths, LossConfig(beta=0.1))
    assert loss64.item() == math.log(2)


@pytest.mark.parametrize("kwargs", [
    {"loss_type": "dpo"},
    {"beta": 0.0},
    {"beta": -1.0},
    {"label_smoothing": 0.5},
    {"label_smoothing": -0.1},
    {"ld_alpha": 1.5},
    {"ld_alpha": -0.1},
])
def test_loss_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        LossConfig(**kwargs)


# issue 16, item 14: zero-length completions and LD-DPO weights in the values' dtype


@pytest.mark.parametrize("loss_type", ["ipo", "sigmoid_norm"])
def test_zero_length_completion_does_not_divide_by_zero(loss_type):
    policy = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)  # pair 0: chosen 2 tokens, rejected 0
    ref = torch.tensor([-1.5, -2.5, -0.7], dtype=torch.float64)
    lengths = torch.tensor([2, 1, 0, 0])  # [chosen_0, chosen_1, rejected_0, rejected_1]
    policy = torch.cat([policy, torch.zeros(0, dtype=torch.float64)])
    loss, m = dpo_loss(policy, ref, lengths, LossConfig(beta=0.5, loss_type=loss_type))
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v).all() for v in m.values())


def test_ld_weights_are_built_in_the_values_dtype():
    w = token_weights(torch.tensor([3, 1, 1, 3]), 2, 0.3, torch.float64)
    assert w.dtype == torch.float64 and w.tolist() == [1.0, 0.3, 0.3, 1.0, 1.0, 1.0, 0.3, 0.3]
    policy = torch.tensor([-1.0, -2.0, -0.5, -0.2, -0.1, -0.3, -0.4, -0.6], dtype=torch.float64)
    ref = policy - 0.25
    lengths = torch.tensor([3, 1, 1, 3])
    _, m = dpo_loss(policy, ref, lengths, LossConfig(beta=1.0, ld_alpha=0.3))
    # chosen_0: 0.25 * (1 + 0.3 + 0.3) exactly in float64 (a float32 0.3 would give 0.30000001...)
    assert m["rewards/chosen"][0].item() == pytest.approx(0.25 * (1 + 0.3 + 0.3), rel=1e-13, abs=0)


@pytest.mark.parametrize("loss_type", ["sigmoid", "tdpo1", "tdpo2"])
def test_the_losss_parts_are_logged_apart_and_add_up_to_it(loss_type):
    """loss/preference + loss/kl_penalty + loss/sft is the loss, per pair; TDPO's KL term is b (alpha) (K+ - K-)."""
    from dpo.losses import TopK, coarse_kl

    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([3, 2, 4, 1])
    n_tok, k = int(lengths.sum()), 4
    policy = -torch.rand(n_tok, generator=gen, dtype=torch.float64) * 3
    ref = -torch.rand(n_tok, generator=gen, dtype=torch.float64) * 3

    def dist():
        full = torch.randn(n_tok, k + 1, generator=gen, dtype=torch.float64).log_softmax(-1)
        return full[:, :k], full[:, k]

    (pt, pr), (qt, qr) = dist(), dist()
    cfg = LossConfig(beta=0.2, loss_type=loss_type, kl_coef=0.3, rpo_alpha=0.5)
    loss, m = dpo_loss(policy, ref, lengths, cfg, TopK(pt, pr, qt, qr))
    total = m["loss/preference"] + m["loss/kl_penalty"] + m["loss/sft"]
    assert float(total.mean()) == pytest.approx(float(loss), abs=1e-12)
    kl = coarse_kl(pt, pr, qt, qr)
    chosen_kl = torch.stack([kl[:3].mean(), kl[3:5].mean()])
    assert m["loss/kl_penalty"].tolist() == pytest.approx((0.3 * chosen_kl).tolist(), abs=1e-12)
    nll = torch.stack([-policy[:3].mean(), -policy[3:5].mean()])
    assert m["loss/sft"].tolist() == pytest.approx((0.5 * nll).tolist(), abs=1e-12)
    if loss_type.startswith("tdpo"):
        seq = coarse_kl(qt, qr, pt, pr)
        sums = [seq[:3].sum(), seq[3:5].sum(), seq[5:9].sum(), seq[9:].sum()]
        weight = 0.2 * (0.5 if loss_type == "tdpo2" else 1.0)
        want = [weight * float(sums[0] - sums[2]), weight * float(sums[1] - sums[3])]
        assert m["tdpo/kl_term"].tolist() == pytest.approx(want, abs=1e-12)
    else:
        assert "tdpo/kl_term" not in m
    assert not math.isnan(float(loss))
