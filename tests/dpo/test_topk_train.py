"""train-dpo with the reference's top-k distribution (issue 24 items 4-6): the collators' generic `ref_X` columns, the
policy's log-probs of the reference's ids and its tail from the training forward, the KL lower bounds against an
independent full-vocabulary KL (plain forwards of a live policy and reference, full softmax, float64, computed here),
TDPO1/TDPO2 losses and gradients against an independent full-vocabulary implementation of the paper's formulas, and
the refusal of a loss that needs top-k without it.

Until precompute-ref writes top-k caches, the rows are built here the way train-dpo's join will carry them:
`ref_chosen_top_ids`, ... from `runtime.logprobs.reference_top_k` (the truth a top-k cache is checked against)."""

from __future__ import annotations

import json
import math
import random

import datasets
import pyarrow as pa
import pytest
import torch
from transformers import TrainingArguments

from conftest import build_llama, records
from dpo.layout import PrefixSharedCollator, pair_logps
from dpo.losses import LossConfig, TopK, coarse_kl, dpo_loss
from dpo.config import TrainConfig
from dpo.recipe import run_train
from dpo.trainer import KL_PANELS, PANELS, DPOTrainer, PairCollator, metric_panels, plot_metrics
from runtime.errors import JobError
from runtime.logprobs import reference_logps, reference_top_k, token_logps

TOL = 1e-5
KL_METRICS = ("kl/policy_ref/chosen", "kl/policy_ref/rejected", "kl/ref_policy/chosen", "kl/ref_policy/rejected",
              "ref_top_k_mass/chosen", "ref_top_k_mass/rejected")
# today's metrics (dpo/losses.py), which a batch without top-k columns logs unchanged
PLAIN_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/accuracies",
                 "logps/chosen", "logps/rejected", "logratio/chosen", "logratio/rejected", "lengths/chosen",
                 "lengths/rejected")
COLLATORS = {"padded": PairCollator, "prefix_shared": PrefixSharedCollator}


def perturbed(model, scale: float, seed: int = 7):
    """A policy near `model`: the same weights plus noise (a trained policy's distance from its reference)."""
    policy = build_llama(model.config.vocab_size)
    policy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return policy


def pair_rows(reference, n: int, k: int, seed: int = 0, with_top_k: bool = True) -> list[dict]:
    """Random pairs with their reference columns as train-dpo's join carries them (ref_chosen_X / ref_rejected_X)."""
    rng = random.Random(seed)
    vocab = reference.config.vocab_size
    ids = lambda lo, hi: [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
    rows = []
    for i in range(n):
        row = {"prompt_ids": ids(1, 12), "chosen_ids": ids(1, 7), "rejected_ids": ids(1, 7)}
        for side in ("chosen", "rejected"):
            completion = row[f"{side}_ids"]
            row[f"ref_{side}_logps"] = reference_logps(reference, row["prompt_ids"], completion).tolist()
            if with_top_k:
                top_ids, top_logps, tail = reference_top_k(reference, row["prompt_ids"], completion, k)
                row[f"ref_{side}_top_ids"] = top_ids.tolist()
                row[f"ref_{side}_top_logps"] = top_logps.tolist()
                row[f"ref_{side}_tail"] = tail.tolist()
        rows.append(row)
    return rows


@torch.no_grad()
def full_log_softmax(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Independent truth: the sequence alone and unpadded through model(ids).logits, full log_softmax in float64."""
    ids = torch.tensor([prompt + completion])
    return model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)


def full_kl_per_token(policy, reference, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion token in the batch order (chosen of every pair, then rejected): the full-vocabulary
    KL(policy||reference) and KL(reference||policy)."""
    pr, rp = [], []
    for side in ("chosen", "rejected"):
        for r in rows:
            lp = full_log_softmax(policy, r["prompt_ids"], r[f"{side}_ids"])
            lq = full_log_softmax(reference, r["prompt_ids"], r[f"{side}_ids"])
            pr.append((lp.exp() * (lp - lq)).sum(-1))
            rp.append((lq.exp() * (lq - lp)).sum(-1))
    return torch.cat(pr), torch.cat(rp)


def bounds_per_token(policy, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """What train-dpo computes: the coarsened KLs per token from the batch's top-k columns and the training forward."""
    with torch.no_grad():
        _, at_ids, rest = pair_logps(policy, batch, given=batch["ref_top_ids"])
    return (coarse_kl(at_ids, rest, batch["ref_top_logps"], batch["ref_tail"]),
            coarse_kl(batch["ref_top_logps"], batch["ref_tail"], at_ids, rest))


def trainer_for(policy, rows, tmp_path, layout="padded", batch_size=None, **options) -> DPOTrainer:
    config = {k: options.pop(k) for k in list(options) if k in ("beta", "loss_type", "tdpo_alpha", "kl_coef")}
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False,
                             per_device_train_batch_size=batch_size or len(rows),
                             per_device_eval_batch_size=batch_size or len(rows), logging_steps=1,
                             save_strategy="no", disable_tqdm=True, seed=3, data_seed=3, **options)
    table = datasets.Dataset(pa.Table.from_pylist(rows))
    return DPOTrainer(model=policy, args=args, data_collator=COLLATORS[layout](0), train_dataset=table,
                      eval_dataset=table, loss_config=LossConfig(**config))


@pytest.fixture(scope="module")
def reference(tokenizer):
    return build_llama(len(tokenizer))


@pytest.fixture(scope="module")
def policy(reference):
    return perturbed(reference, 0.05)


# ---------------------------------------------------------------------------------------------------------------
# the batch and the policy's side


def test_both_collators_carry_every_reference_column_in_the_order_of_the_log_probs(reference):
    rows = pair_rows(reference, 5, k=4)
    padded, shared = PairCollator(0)(rows), PrefixSharedCollator(0)(rows)
    n = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)
    for batch in (padded, shared):
        assert batch["ref_top_ids"].shape == (n, 4) and batch["ref_top_ids"].dtype == torch.long
        assert batch["ref_top_logps"].shape == (n, 4) and batch["ref_top_logps"].dtype == torch.float32
        assert batch["ref_tail"].shape == (n,) and batch["ref_tail"].dtype == torch.float32
        want = [t for side in ("chosen", "rejected") for r in rows for t in r[f"ref_{side}_top_ids"]]
        assert batch["ref_top_ids"].tolist() == want  # chosen of every pair, then rejected, like ref_logps
    for name in ("ref_logps", "ref_top_ids", "ref_top_logps", "ref_tail"):
        assert torch.equal(padded[name], shared[name]), name
    plain = pair_rows(reference, 5, k=4, with_top_k=False)
    assert {k for k in PairCollator(0)(plain) if k.startswith("ref_")} == {"ref_logps"}


@pytest.mark.parametrize("layout", ["padded", "prefix_shared"])
def test_policy_log_probs_of_the_references_ids_and_its_tail_equal_a_full_softmax(reference, policy, layout):
    rows = pair_rows(reference, 4, k=5, seed=1)
    batch = COLLATORS[layout](0)(rows)
    logps, at_ids, rest = pair_logps(policy, batch, given=batch["ref_top_ids"])
    assert torch.equal(logps.detach(), pair_logps(policy, batch).detach())  # today's values, unchanged
    full = torch.cat([full_log_softmax(policy, r["prompt_ids"], r[f"{s}_ids"]) for s in ("chosen", "rejected")
                      for r in rows])
    ids = batch["ref_top_ids"]
    assert float((at_ids.detach().double() - full.gather(-1, ids)).abs().max()) < TOL
    others = full.scatter(-1, ids, float("-inf")).logsumexp(-1)
    assert float((rest.detach().double() - others).abs().max()) < TOL
    (at_ids.sum() + rest.sum()).backward()  # gradients flow through both
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(float(g.abs().max()) > 0 for g in grads)
    policy.zero_grad()


@pytest.mark.parametrize("head", ["hook", "logits_to_keep", "logits"])
def test_every_head_path_in_chunks_gives_the_same_scores_and_gradients(reference, policy, head):
    """Chunks of 3 positions (the hook path recomputes each in the backward pass) against one chunk; at K = the
    vocabulary the tail is -inf and its gradient zero, not NaN."""
    vocab = reference.config.vocab_size
    for k in (6, vocab):
        batch = PairCollator(0)(pair_rows(reference, 3, k=k, seed=2))
        got = {}
        for elements in (3 * vocab, 2**25):
            seq = torch.arange(batch["input_ids"].shape[1])
            start, lens = batch["prompt_lens"][:, None], batch["completion_lens"][:, None]
            rows, cols = ((seq >= start) & (seq < start + lens)).nonzero(as_tuple=True)
            out = token_logps(policy, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
                              rows, cols - 1, batch["input_ids"][rows, cols], elements, head=head,
                              given=batch["ref_top_ids"])
            finite = torch.where(torch.isinf(out[2]), 0.0, out[2])
            (out[0].sum() + out[1].sum() + finite.sum()).backward()
            got[elements] = [o.detach() for o in out], [p.grad.clone() for p in policy.parameters()]
            policy.zero_grad()
        (a, ga), (b, gb) = got.values()
        for x, y in zip(a, b):
            assert torch.equal(torch.isinf(x), torch.isinf(y))
            assert float((torch.where(torch.isinf(x), 0.0, x) - torch.where(torch.isinf(y), 0.0, y)).abs().max()) < TOL
        assert torch.isneginf(a[2]).all() == (k == vocab)
        for x, y in zip(ga, gb):  # summed over other chunks: float32 rounding relative to the gradient's size
            assert torch.isfinite(x).all() and float((x - y).abs().max()) < TOL * max(1.0, float(y.abs().max()))


# ---------------------------------------------------------------------------------------------------------------
# the KL metrics: lower bounds of the full-vocabulary KL


def test_at_k_equal_vocabulary_the_logged_kls_equal_the_full_vocabulary_kl(reference, policy, tmp_path):
    vocab = reference.config.vocab_size
    rows = pair_rows(reference, 6, k=vocab, seed=3)
    pr, rp = full_kl_per_token(policy, reference, rows)
    batch = PairCollator(0)(rows)
    bound_pr, bound_rp = bounds_per_token(policy, batch)
    assert float((bound_pr.double() - pr).abs().max()) < TOL and float((bound_rp.double() - rp).abs().max()) < TOL
    # what eval logs: per completion the mean over its tokens, then the mean over pairs
    logged = trainer_for(policy, rows, tmp_path).evaluate()
    lens = batch["completion_lens"].tolist()
    per_seq = lambda v: torch.stack([t.mean() for t in v.split(lens)])
    n = len(rows)
    for direction, truth in (("policy_ref", pr), ("ref_policy", rp)):
        seq = per_seq(truth)
        assert abs(logged[f"eval_kl/{direction}/chosen"] - float(seq[:n].mean())) < TOL
        assert abs(logged[f"eval_kl/{direction}/rejected"] - float(seq[n:].mean())) < TOL
    assert abs(logged["eval_ref_top_k_mass/chosen"] - 1.0) < TOL and logged["eval_kl/policy_ref/chosen"] > 1e-3


def test_with_small_k_the_kls_are_lower_bounds_on_every_token_and_the_gap_shrinks_as_k_grows(reference, policy):
    vocab = reference.config.vocab_size
    truth = previous = None
    gaps = []
    for k in (1, 4, 16, 64, vocab):
        rows = pair_rows(reference, 6, k=k, seed=4)
        if truth is None:
            truth = full_kl_per_token(policy, reference, rows)
        batch = PrefixSharedCollator(0)(rows)
        bounds = bounds_per_token(policy, batch)
        # per token, never above the true KL (float32 rounding aside), and a larger K never loosens it
        for bound, full in zip(bounds, truth):
            assert bool((bound.double() <= full + 1e-6).all()), (k, float((bound.double() - full).max()))
        if previous is not None:
            for bound, before in zip(bounds, previous):
                assert bool((bound >= before - 1e-6).all()), k
        previous = bounds
        mass = batch["ref_top_logps"].logsumexp(-1).exp()
        gaps.append((float((truth[0] - bounds[0].double()).mean()), float((truth[1] - bounds[1].double()).mean()),
                     float(mass.mean())))
    for (g1, h1, m1), (g2, h2, m2) in zip(gaps, gaps[1:]):
        assert g2 < g1 and h2 < h1 and m2 > m1, gaps
    assert gaps[0][0] > 1e-3 and abs(gaps[-1][0]) < TOL and abs(gaps[-1][1]) < TOL


# ---------------------------------------------------------------------------------------------------------------
# TDPO and the KL penalty


def full_vocabulary_losses(policy, reference, rows, beta: float, alpha: float, kl_coef: float) -> dict:
    """TDPO1, TDPO2 (Zeng et al. 2024) and sigmoid + C x KL from the policy's and reference's full softmax, written
    from the paper's formulas: u = b (s+ - s-), delta = b (SeqKL(y-; ref||pi) - SeqKL(y+; ref||pi)), TDPO1 =
    -log sig(u - delta), TDPO2 = -log sig(u - alpha delta) with SeqKL(y+) stop-gradient."""
    s, seq_kl, kl_pi = {}, {}, {}
    for side in ("chosen", "rejected"):
        s[side], seq_kl[side], kl_pi[side] = [], [], []
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r[f"{side}_ids"]])
            lp = policy(input_ids=ids).logits[0, len(r["prompt_ids"]) - 1 : -1].double().log_softmax(-1)
            lq = full_log_softmax(reference, r["prompt_ids"], r[f"{side}_ids"])
            target = torch.tensor(r[f"{side}_ids"])[:, None]
            s[side].append((lp.gather(-1, target) - lq.gather(-1, target)).sum())
            seq_kl[side].append((lq.exp() * (lq - lp)).sum())
            kl_pi[side].append((lp.exp() * (lp - lq)).sum(-1).mean())
    sp, sn = torch.stack(s["chosen"]), torch.stack(s["rejected"])
    kp, kn = torch.stack(seq_kl["chosen"]), torch.stack(seq_kl["rejected"])
    u, delta = beta * (sp - sn), beta * (kn - kp)
    delta2 = beta * (kn - kp.detach())
    return {"tdpo1": -torch.nn.functional.logsigmoid(u - delta).mean(),
            "tdpo2": -torch.nn.functional.logsigmoid(u - alpha * delta2).mean(),
            "sigmoid": (-torch.nn.functional.logsigmoid(u) + kl_coef * torch.stack(kl_pi["chosen"])).mean()}


def test_tdpo_and_the_kl_penalty_match_a_hand_computation():
    """One pair, one token each, K = 2 of a larger vocabulary: the coarsened distributions (2 ids + rest) by hand."""
    p_c, q_c = [0.5, 0.2, 0.3], [0.4, 0.4, 0.2]  # chosen token: policy / reference over (id a, id b, rest)
    p_r, q_r = [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b))
    lp_c, lp_r, r_c, r_r = math.log(0.5), math.log(0.6), math.log(0.4), math.log(0.3)  # dataset tokens: a, b
    d = (lp_c - r_c) - (lp_r - r_r)
    k_c, k_r = kl(q_c, p_c), kl(q_r, p_r)
    b, alpha, c = 0.7, 0.4, 0.25
    logsig = lambda x: -math.log1p(math.exp(-x))
    want = {"tdpo1": -logsig(b * (d + k_c - k_r)), "tdpo2": -logsig(b * (d + alpha * (k_c - k_r))),
            "sigmoid": -logsig(b * d) + c * kl(p_c, q_c)}
    t = lambda rows: torch.tensor(rows, dtype=torch.float64).log()
    top_k = TopK(t([p_c[:2], p_r[:2]]), t([p_c[2], p_r[2]]), t([q_c[:2], q_r[:2]]), t([q_c[2], q_r[2]]))
    for name, expected in want.items():
        cfg = LossConfig(beta=b, loss_type=name, tdpo_alpha=alpha, kl_coef=c if name == "sigmoid" else 0.0)
        loss, metrics = dpo_loss(torch.tensor([lp_c, lp_r], dtype=torch.float64),
                                 torch.tensor([r_c, r_r], dtype=torch.float64), torch.tensor([1, 1]), cfg, top_k)
        assert loss.item() == pytest.approx(expected, rel=1e-12), name
    assert metrics["kl/policy_ref/chosen"].item() == pytest.approx(kl(p_c, q_c), rel=1e-12)
    assert metrics["kl/ref_policy/rejected"].item() == pytest.approx(kl(q_r, p_r), rel=1e-12)
    assert metrics["ref_top_k_mass/rejected"].item() == pytest.approx(0.6, rel=1e-12)
    tdpo = dpo_loss(torch.tensor([lp_c, lp_r], dtype=torch.float64), torch.tensor([r_c, r_r], dtype=torch.float64),
                    torch.tensor([1, 1]), LossConfig(beta=b, loss_type="tdpo1"), top_k)[1]
    # TDPO's implicit rewards: b (s + SeqKL(ref || pi)), as in the authors' code
    assert tdpo["rewards/chosen"].item() == pytest.approx(b * (lp_c - r_c + k_c), rel=1e-12)


@pytest.mark.parametrize("layout", ["padded", "prefix_shared"])
def test_tdpo_losses_and_gradients_equal_a_full_vocabulary_implementation(reference, policy, layout):
    vocab = reference.config.vocab_size
    rows = pair_rows(reference, 4, k=vocab, seed=5)
    batch = COLLATORS[layout](0)(rows)
    beta, alpha, kl_coef = 0.5, 0.3, 0.7
    for name in ("tdpo1", "tdpo2", "sigmoid"):
        truth = full_vocabulary_losses(policy, reference, rows, beta, alpha, kl_coef)[name]
        truth.backward()
        want = [p.grad.clone() for p in policy.parameters()]
        policy.zero_grad()
        logps, at_ids, rest = pair_logps(policy, batch, given=batch["ref_top_ids"])
        cfg = LossConfig(beta=beta, loss_type=name, tdpo_alpha=alpha, kl_coef=kl_coef if name == "sigmoid" else 0.0)
        loss, _ = dpo_loss(logps, batch["ref_logps"], batch["completion_lens"], cfg,
                           TopK(at_ids, rest, batch["ref_top_logps"], batch["ref_tail"]))
        loss.backward()
        got = [p.grad.clone() for p in policy.parameters()]
        policy.zero_grad()
        assert abs(loss.item() - truth.item()) < TOL, name
        scale = max(float(g.abs().max()) for g in want)
        assert scale > 1e-4  # a gradient that could be wrong
        for g, w in zip(got, want):
            assert float((g - w).abs().max()) < TOL * max(1.0, scale), name


def test_at_step_0_tdpo_loss_is_ln_2_and_kls_are_0(reference, tmp_path):
    rows = pair_rows(reference, 6, k=8, seed=6)
    same = perturbed(reference, 0.0)
    for loss_type in ("tdpo1", "tdpo2"):
        logged = trainer_for(same, rows, tmp_path, loss_type=loss_type, beta=0.1).evaluate()
        assert abs(logged["eval_loss"] - math.log(2)) < 1e-6, loss_type
        for name in KL_METRICS[:4]:
            assert abs(logged[f"eval_{name}"]) < 1e-6, name


def test_tdpo_trains_with_gradient_accumulation_in_both_layouts_to_the_same_metrics(reference, tmp_path):
    rows = pair_rows(reference, 8, k=16, seed=7)
    history = {}
    for layout in COLLATORS:
        trainer = trainer_for(perturbed(reference, 0.0), rows, tmp_path / layout, layout=layout, batch_size=2,
                              loss_type="tdpo2", kl_coef=0.1, learning_rate=1e-3, max_steps=3,
                              gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=3)
        trainer.train()
        history[layout] = trainer.state.log_history
    a, b = history.values()
    assert len(a) == len(b)
    train = [r for r in a if "kl/policy_ref/chosen" in r]
    assert train and all(set(KL_METRICS) <= set(r) for r in train)
    assert any("eval_kl/ref_policy/rejected" in r for r in a)
    assert train[-1]["kl/policy_ref/chosen"] > 1e-6  # the policy moved away from the reference
    for x, y in zip(a, b):
        for key in x:
            # at the reference every reward is 0 up to rounding (1e-8): which side of a tie that lands on is no metric
            tie = key.endswith("accuracies") and abs(x.get(key.replace("accuracies", "margins"), 1.0)) < 1e-6
            if isinstance(x[key], float) and not tie and not any(t in key for t in ("runtime", "per_second", "flos",
                                                                                   "epoch")):
                assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])


def test_tdpo_with_lora_starts_at_ln_2_and_trains(reference, tmp_path):
    peft = pytest.importorskip("peft")
    rows = pair_rows(reference, 4, k=8, seed=8)
    model = peft.get_peft_model(perturbed(reference, 0.0), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = trainer_for(model, rows, tmp_path, loss_type="tdpo1", learning_rate=1e-2, max_steps=3)
    assert abs(trainer.evaluate()["eval_loss"] - math.log(2)) < 1e-6  # LoRA's B = 0: the policy is the reference
    trainer.train()
    assert trainer.evaluate()["eval_kl/ref_policy/chosen"] > 1e-7


# ---------------------------------------------------------------------------------------------------------------
# without top-k nothing changes; what needs top-k is refused without it


def test_without_top_k_columns_the_metrics_are_todays(reference, policy, tmp_path):
    with_k = pair_rows(reference, 5, k=8, seed=9)
    without = pair_rows(reference, 5, k=8, seed=9, with_top_k=False)
    plain = trainer_for(policy, without, tmp_path / "a").evaluate()
    topk = trainer_for(policy, with_k, tmp_path / "b").evaluate()
    assert {k.removeprefix("eval_") for k in plain if k.removeprefix("eval_") in PLAIN_METRICS} == set(PLAIN_METRICS)
    assert not any("kl/" in k or "top_k" in k for k in plain)
    assert set(topk) - set(plain) == {f"eval_{m}" for m in KL_METRICS}
    for key in PLAIN_METRICS + ("loss",):
        assert plain[f"eval_{key}"] == topk[f"eval_{key}"], key  # the same forward, the same numbers
    batch = PairCollator(0)(without)
    _, metrics = dpo_loss(pair_logps(policy, batch), batch["ref_logps"], batch["completion_lens"], LossConfig())
    assert tuple(metrics) == PLAIN_METRICS + ("loss/preference",)  # and the loss's parts apart (issue 35)


def test_a_loss_that_needs_top_k_refuses_rows_without_it(reference, policy, llama_dir, dpo_data, dpo_cache, tmp_path):
    batch = PairCollator(0)(pair_rows(reference, 2, k=4, with_top_k=False))
    for cfg in (LossConfig(loss_type="tdpo1"), LossConfig(loss_type="tdpo2"), LossConfig(kl_coef=0.1)):
        with pytest.raises(ValueError, match="top-k"):
            dpo_loss(pair_logps(policy, batch), batch["ref_logps"], batch["completion_lens"], cfg)
    for options, first in (({"loss_type": "tdpo2"}, "--loss-type tdpo2 needs"), ({"kl_coef": 0.1}, "--kl-coef needs")):
        for reference_options, held in (({"ref_cache": str(dpo_cache)}, f"the cache {dpo_cache} holds only"),
                                        ({"ref_model": str(llama_dir)}, "a live reference is scored")):
            out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
            cfg = TrainConfig(model=str(llama_dir), data=str(dpo_data), output_dir=str(out), use_cpu=True,
                              **options, **reference_options)
            with pytest.raises(JobError) as refused:
                run_train(cfg, log=lambda m: None)
            message = str(refused.value)
            assert message.startswith(first) and held in message, message
            assert f"precompute-ref --model {llama_dir} --data {dpo_data} --split train" in message
            assert "--top-k" in message
            assert not out.exists()  # before any model is loaded or anything written


def top_k_join(model_dir, k: int):
    """dpo.recipe's verify_and_join, then top-k columns added to the verified rows from the reference itself
    (runtime.logprobs.reference_top_k), named as the join will name them once precompute-ref writes them."""
    from dpo import recipe
    from runtime.checkpoint import Checkpoint

    reference = Checkpoint.open(str(model_dir), False).load_model(torch.float32)
    joined = recipe.verify_and_join

    def with_top_k(**kwargs):
        verified = joined(**kwargs)
        rows = verified.table.to_pylist()
        for side in ("chosen", "rejected"):
            top = [reference_top_k(reference, r["prompt_ids"], r[f"{side}_ids"], k) for r in rows]
            for i, x in enumerate(("top_ids", "top_logps", "tail")):
                verified.table = verified.table.append_column(f"ref_{side}_{x}", pa.array([t[i].tolist() for t in top]))
        return verified

    return with_top_k


TOP_K_RUN = dict(max_steps=3, logging_steps=1, learning_rate=1e-3, loss_type="tdpo2", kl_coef=0.05, seed=3,
                 save_strategy="no")


@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_train_dpo_with_top_k_columns_logs_the_kls_and_plots_them(llama_dir, dpo_data, dpo_cache, tmp_path,
                                                                  monkeypatch, use_peft):
    """The whole train-dpo run (tdpo2 + --kl-coef, gradient accumulation) on rows with top-k columns."""
    from dpo import recipe
    from dpo.lora import LoraOptions

    if use_peft:
        pytest.importorskip("peft")
    monkeypatch.setattr(recipe, "verify_and_join", top_k_join(llama_dir, 8))
    out = tmp_path / "out"
    cfg = TrainConfig(model=str(llama_dir), data=str(dpo_data), ref_cache=str(dpo_cache), output_dir=str(out),
                      use_cpu=True, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      lora=LoraOptions(use_peft=True, lora_r=4) if use_peft else LoraOptions(), **TOP_K_RUN)
    run_train(cfg, log=lambda m: None)
    logged = [r for r in records(out) if "loss" in r]
    assert len(logged) == 3 and all(set(KL_METRICS) <= set(r) for r in logged)
    assert abs(logged[0]["loss"] - math.log(2)) < 1e-5  # step 0: the policy is the reference (LoRA's B = 0)
    assert logged[-1]["kl/policy_ref/chosen"] > 1e-7 and 0 < logged[-1]["ref_top_k_mass/chosen"] <= 1
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"


DRIVER = """
import sys
sys.path[:0] = {paths!r}
from dpo import recipe
from test_topk_train import top_k_join
recipe.verify_and_join = top_k_join({model!r}, 8)
from dpo.cli import process_main
sys.argv = ["train-dpo", *sys.argv[1:]]
process_main()
"""


def test_torchrun_two_ranks_log_the_same_kls_and_tdpo_loss_as_one_process(llama_dir, dpo_data, dpo_cache, tmp_path,
                                                                          monkeypatch):
    """2 DDP ranks of batch 2 against one process of batch 4: the per-pair metric table (KLs included) is gathered
    over the ranks, and the TDPO gradients are averaged like any loss's."""
    from pathlib import Path

    from conftest import TORCHRUN, run_in_session
    from dpo import recipe

    here = Path(__file__).parent
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(paths=[str(here.parent.parent), str(here.parent), str(here)], model=str(llama_dir)))
    options = [f"--{k.replace('_', '-')}={v}" for k, v in TOP_K_RUN.items()]
    run_in_session([*TORCHRUN, str(driver), "--model", str(llama_dir), "--data", str(dpo_data), "--ref-cache",
                    str(dpo_cache), "--output-dir", str(tmp_path / "ranks"), "--per-device-train-batch-size", "2",
                    "--use-cpu", "--no-plot", "--batch-layout", "padded", *options], tmp_path, timeout=400)
    monkeypatch.setattr(recipe, "verify_and_join", top_k_join(llama_dir, 8))
    run_train(TrainConfig(model=str(llama_dir), data=str(dpo_data), ref_cache=str(dpo_cache), use_cpu=True,
                          output_dir=str(tmp_path / "one"), per_device_train_batch_size=4, plot=False,
                          batch_layout="padded", **TOP_K_RUN), log=lambda m: None)
    ranks, one = records(tmp_path / "ranks"), records(tmp_path / "one")
    assert len(ranks) == len(one) and sum("kl/policy_ref/chosen" in r for r in one) == 3
    for x, y in zip(one, ranks):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], float) and not any(t in key for t in ("runtime", "per_second", "flos", "epoch")):
                assert abs(x[key] - y[key]) <= 1e-5 * max(1.0, abs(x[key])), (key, x[key], y[key])


def test_the_plot_gets_a_kl_panel_when_the_run_logged_kls(tmp_path):
    plain = [{"step": 1, "loss": 0.7, "logratio/chosen": 0.0}]
    assert metric_panels(plain) == PANELS
    with_kl = plain + [{"step": 2, "eval_loss": 0.6, **{f"eval_{m}": 0.01 for m in KL_METRICS}}]
    assert metric_panels(with_kl) == PANELS + KL_PANELS
    assert {k for panel in KL_PANELS for k, _ in panel.series} == set(KL_METRICS)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in with_kl) + "\n")
    plot_metrics(path, tmp_path / "metrics.png", "a title")
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_a_top_k_train_cache_with_an_eval_cache_without_top_k_notes_once_that_eval_logs_no_kl(llama_dir, dpo_data,
                                                                                               dpo_cache, tmp_path):
    from click.testing import CliRunner

    from conftest import precompute_in_process
    from dpo.cli import main

    top_k = precompute_in_process(llama_dir, dpo_data, tmp_path / "top-k", top_k=4)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, [str(a) for a in (
        "--model", llama_dir, "--data", dpo_data, "--ref-cache", top_k, "--eval-data", dpo_data, "--eval-ref-cache",
        dpo_cache, "--output-dir", out, "--use-cpu", "--max-steps", 1, "--per-device-train-batch-size", 8,
        "--eval-strategy", "steps", "--eval-steps", 1, "--no-plot")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    note = f"note: the eval cache {dpo_cache} was made without --top-k, so the evaluations log no KL figures"
    assert result.stderr.count(note) == 1, result.stderr
    logged = records(out)
    assert any("kl/policy_ref/chosen" in r for r in logged)  # the train steps do log it
    assert not any("eval_kl/policy_ref/chosen" in r for r in logged)
