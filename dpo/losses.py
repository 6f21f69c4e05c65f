"""Preference losses over per-token log-probs, and the metrics logged with them.

Notation (per pair): lp+/lp- policy log-probs of the chosen/rejected completion, r+/r- the reference's,
s+ = lp+ - r+, s- = lp- - r-, d = s+ - s-, b = beta, e = label smoothing, |y| the completion length.

  sigmoid       -(1-e) log sig(b d) - e log sig(-b d)          DPO; e > 0 is conservative DPO (cDPO)
  ipo           (d' - 1/(2b))^2, d' from per-token means        IPO
  hinge         max(0, 1 - b d)                                  SLiC
  robust        (-(1-e) log sig(b d) + e log sig(-b d)) / (1-2e) robust DPO
  bco_pair      -log sig(b s+) - log sig(-b s-)                  BCO, paired form
  sppo_hard     (s+ - 1/(2b))^2 + (s- + 1/(2b))^2                SPPO, hard labels
  nca_pair      -log sig(b s+) - 0.5 log sig(-b s+) - 0.5 log sig(-b s-)
  apo_zero      (1 - sig(b s+)) + sig(b s-)                      APO-zero
  apo_down      sig(b s+) + (1 - sig(b d))                       APO-down
  sigmoid_norm  -log sig(b (s+/|y+| - s-/|y-|))                  length-normalised DPO

Lengths are clamped to 1 token in the per-token means (the encoder already refuses an empty completion).

Metrics: rewards/* are b*s per pair and rewards/accuracies the share of pairs where the implicit reward ranks chosen
above rejected (TRL's meaning); logps/accuracies the share where the policy's own log-prob does. logratio/chosen and
logratio/rejected are the mean per-token log(pi/ref) over the dataset's completion tokens. They are not a KL
estimate: KL(pi||ref) estimators (k1, k3) need tokens sampled from the policy, and these are the dataset's.

Modifiers: rpo_alpha adds w * mean per-token NLL of the chosen completion (RPO); ld_alpha < 1 (LD-DPO) weights
the tokens past the shorter completion's length by ld_alpha in both policy and reference sums.

With a top-k cache (precompute-ref --top-k K; batch columns ref_top_ids, ref_top_logps, ref_tail), per completion
position t with context (x, y_<t): p_t = pi(.|x, y_<t), q_t = ref(.|x, y_<t), S_t the reference's K most probable
ids. Both are coarsened to the K + 1 outcomes "token v of S_t" and "any other token" (p_t(rest) and q_t(rest) are
log-sum-exps over the tokens outside S_t, never log(1 - sum)), and

  KL_t(p||q) = sum over the K + 1 outcomes o of p_t(o) (log p_t(o) - log q_t(o))   (0 where p_t(o) = 0)

in either direction. Coarsening is a deterministic map of the outcomes, so by the data-processing inequality for
relative entropy (e.g. Cover & Thomas, Elements of Information Theory) KL_t never exceeds the full-vocabulary KL at that
position, and equals it when the tail is empty (K = vocabulary); q_t(S_t), the reference's top-k mass, says how
tight it is. The inequality is about distributions: both coarsened ones sum to 1 (the cached one as read,
schemas/format.py normalised_top_k; both again in float64 in coarse_kl), without which a KL is off by the missing
mass, first order. Metrics (per completion, means over its tokens): kl/policy_ref/* = KL_t(p||q), kl/ref_policy/* =
KL_t(q||p), ref_top_k_mass/* = q_t(S_t). They are not sampled estimators (k1, k3): exact sums over the outcomes.

  tdpo1  -log sig(b ((s+ - s-) + (K+ - K-)))                  TDPO1, Zeng et al. 2024 (ICML; arXiv 2404.11999)
  tdpo2  -log sig(b ((s+ - s-) + alpha (sg(K+) - K-)))        TDPO2, ibid. (sg: stop-gradient; alpha default 0.5)

K+ / K- are the sequential KL of the chosen / rejected completion, sum over its tokens of KL_t(q||p) (the paper's
D_SeqKL(x, y; pi_ref || pi_theta); here from the coarsened distributions, exact at K = vocabulary). The implicit
rewards logged for TDPO are b (s+ + K+) and b (s- + K-), as in the authors' code
(Vance0124/Token-level-Direct-Preference-Optimization). At step 0 (pi = ref) every K is 0 and both losses are ln 2.
kl_coef C adds C x the mean over the chosen completion's tokens of KL_t(p||q) to any loss ("DPO + KL penalty", e.g.
Levanter's DPO documentation). tdpo1/tdpo2 and kl_coef > 0 need a top-k cache.

The loss's parts are logged apart, per pair: loss/preference (the table's loss, TDPO's included), loss/kl_penalty
(kl_coef x KL), loss/sft (rpo_alpha x NLL), and for TDPO tdpo/kl_term, the KL term inside its sigmoid (b (K+ - K-),
TDPO2 b alpha (K+ - K-)).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.distributed import Dist

from .loss_config import LOSS_TYPES, TOP_K_LOSSES, LossConfig  # noqa: F401  (re-exported; apart from torch for the CLI)


@dataclass
class TopK:
    """Per completion token, in the batch's order (chosen of every pair, then rejected): the policy's log-probs of
    the reference's top-k ids [N, K] and the log of its mass outside them [N]; the reference's (cached) same."""

    policy: torch.Tensor
    policy_rest: torch.Tensor
    ref: torch.Tensor
    ref_rest: torch.Tensor


def coarse_kl(a_top, a_rest, b_top, b_rest) -> torch.Tensor:
    """Per position KL(a||b) between two distributions coarsened to K outcomes plus one for the rest (log-probs;
    [N, K] and [N]): sum over outcomes of a (log a - log b), an outcome a gives no mass contributing 0 (and no NaN
    gradient). In float64, each side first less its own log-sum-exp: the outcomes of a true distribution sum to 1, so
    this changes neither value nor gradient beyond rounding, but a float32 log-softmax's normaliser is rounded (about
    1e-7 of mass), and a KL between distributions whose masses differ by m is off by about m, first order, where at
    a small KL it would otherwise be second order. Returned in a's dtype."""
    la = torch.cat([a_top, a_rest[:, None]], 1).double()
    lb = torch.cat([b_top, b_rest[:, None]], 1).double().to(la.device)
    la, lb = la - la.logsumexp(-1, keepdim=True), lb - lb.logsumexp(-1, keepdim=True)
    absent = torch.isneginf(la)
    la, lb = torch.where(absent, 0.0, la), torch.where(absent, 0.0, lb)
    return torch.where(absent, 0.0, la.exp() * (la - lb)).sum(-1).to(a_top.dtype)


def pair_loss(s_pos, s_neg, len_pos, len_neg, cfg: LossConfig, kl_pos=None, kl_neg=None) -> torch.Tensor:
    """Per-pair loss from the policy-minus-reference log-ratios s+ and s- (summed over tokens); TDPO also takes the
    sequential KLs K+ and K-."""
    b, e = cfg.beta, cfg.label_smoothing
    d = s_pos - s_neg
    logsig = F.logsigmoid
    t = cfg.loss_type
    if t in ("sigmoid", "beta_dpo"):  # beta_dpo: the batch's β comes in cfg.beta (BetaDPO.batch)
        return -(1 - e) * logsig(b * d) - e * logsig(-b * d)
    if t == "ipo":
        return (s_pos / len_pos - s_neg / len_neg - 1 / (2 * b)) ** 2
    if t == "hinge":
        return torch.relu(1 - b * d)
    if t == "robust":
        return (-(1 - e) * logsig(b * d) + e * logsig(-b * d)) / (1 - 2 * e)
    if t == "bco_pair":
        return -logsig(b * s_pos) - logsig(-b * s_neg)
    if t == "sppo_hard":
        return (s_pos - 1 / (2 * b)) ** 2 + (s_neg + 1 / (2 * b)) ** 2
    if t == "nca_pair":
        return -logsig(b * s_pos) - 0.5 * logsig(-b * s_pos) - 0.5 * logsig(-b * s_neg)
    if t == "apo_zero":
        return (1 - torch.sigmoid(b * s_pos)) + torch.sigmoid(b * s_neg)
    if t == "apo_down":
        return torch.sigmoid(b * s_pos) + (1 - torch.sigmoid(b * d))
    if t == "sigmoid_norm":
        return -logsig(b * (s_pos / len_pos - s_neg / len_neg))
    if t == "tdpo1":
        return -logsig(b * (d + kl_pos - kl_neg))
    if t == "tdpo2":
        return -logsig(b * (d + cfg.tdpo_alpha * (kl_pos.detach() - kl_neg)))
    raise ValueError(t)


class BetaDPO:
    """β-DPO's batch-level dynamic β and β-guided data filtering (Wu et al. 2024, "β-DPO: Direct Preference
    Optimization with Dynamic β", NeurIPS; arXiv 2407.08639; authors' code junkangwu/beta-DPO). Per pair the
    individual reward discrepancy M_i = d_i = s+ - s- (the log-ratio gap, as the authors' code takes it); per
    training batch, in this order:

      M_0 <- m M_0 + (1 - m) mean_i(M_i),   sigma <- m sigma + (1 - m) std_i(M_i)       (moving averages, from 0)
      w_i = exp(-(M_i - M_0)^2 / (2 sigma^2))                 (the Gaussian density around M_0, unnormalised)
      S = floor(n (1 - rho)) pairs drawn without replacement with probability proportional to w_i
      beta = max(beta_0 (1 + alpha (mean_{i in S}(M_i) - M_0)), 0.001)
      loss = mean over i in S of -log sig(beta d_i)          (beta a constant of the gradient, as in their code)

    alpha = --beta-dpo-alpha (0.6), rho = --beta-dpo-rho (0.2), m = --beta-dpo-momentum (0.9); std is the sample
    standard deviation (n - 1). The draw uses its own generator (seeded with the run's seed), so a run repeats. Eval
    batches use beta_0 and every pair, and move nothing. State (M_0, sigma, the generator) goes in each
    checkpoint."""

    def __init__(self, cfg: LossConfig, seed: int = 0):
        self.cfg = cfg
        self.mean = 0.0
        self.std = 0.0
        self.generator = torch.Generator().manual_seed(seed)
        self.share = 1.0

    def batch(self, gaps: torch.Tensor) -> tuple[float, torch.Tensor]:
        """(this batch's β, the mask of this rank's pairs kept) for the batch's M_i; updates the moving averages.
        Under torchrun the batch is every rank's pairs (the global batch, as the authors' code gathers them): each
        rank computes the same statistics, draw and β from the same gathered values, and keeps its own slice."""
        m = self.cfg.beta_dpo_momentum
        mine = gaps.detach().double().cpu()
        every_rank = Dist.joined().gather(mine.tolist())
        offset = sum(len(part) for part in every_rank[:Dist.joined().rank])
        g = torch.tensor([x for part in every_rank for x in part], dtype=torch.float64)
        self.mean = m * self.mean + (1 - m) * float(g.mean())
        self.std = m * self.std + (1 - m) * (float(g.std()) if len(g) > 1 else 0.0)
        if self.std > 0:
            weights = torch.exp(-0.5 * ((g - self.mean) / self.std) ** 2)
        else:
            weights = torch.ones_like(g)
        if not float(weights.sum()) > 0:  # every pair far out: none more typical than another
            weights = torch.ones_like(g)
        keep = max(1, int(len(g) * (1 - self.cfg.beta_dpo_rho)))
        chosen = torch.multinomial(weights, keep, replacement=False, generator=self.generator)
        mask = torch.zeros(len(g), dtype=torch.bool)
        mask[chosen] = True
        beta = max(self.cfg.beta * (1 + self.cfg.beta_dpo_alpha * (float(g[mask].mean()) - self.mean)), 1e-3)
        # the loss is the mean over every rank's kept pairs: this rank's sum x world / kept, which DDP's gradient
        # average turns into exactly that mean (a rank that keeps none adds nothing, never 0 / 0)
        self.share = Dist.joined().world / keep
        return beta, mask[offset:offset + len(mine)].to(gaps.device)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std, "generator": self.generator.get_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.std = state["mean"], state["std"]
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


def token_weights(lengths: torch.Tensor, n_pairs: int, ld_alpha: float, dtype=torch.float32) -> torch.Tensor:
    """Flat per-token weights: 1 up to the shorter completion of each pair, ld_alpha after it (LD-DPO)."""
    pos_in_seq = torch.arange(int(lengths.sum()), device=lengths.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    shorter = torch.minimum(lengths[:n_pairs], lengths[n_pairs:]).repeat(2)
    limit = torch.repeat_interleave(shorter, lengths)
    one, alpha = torch.tensor(1.0, dtype=dtype), torch.tensor(ld_alpha, dtype=dtype)  # 0.3 in the values' own dtype
    return torch.where(pos_in_seq < limit, one.to(lengths.device), alpha.to(lengths.device))


def dpo_loss(policy_logps, ref_logps, lengths, cfg: LossConfig, top_k: TopK | None = None,
             beta_dpo: BetaDPO | None = None):
    """Loss and metrics for a batch laid out as [chosen_0..chosen_{B-1}, rejected_0..rejected_{B-1}].

    policy_logps and ref_logps are flat per-token values (see runtime.logprobs.completion_logps); lengths holds
    each sequence's completion length; top_k, with a top-k cache, the distributions' K + 1 outcomes per token (then
    the KL metrics are logged too). Returns (mean loss, dict of per-pair metric tensors, detached).
    """
    if top_k is None and cfg.needs_top_k:
        raise ValueError(f"{cfg.needs_top_k} needs the reference's top-k log-probs (a precompute-ref --top-k K cache)")
    n = len(lengths) // 2
    seq = torch.repeat_interleave(torch.arange(2 * n, device=lengths.device), lengths)
    w = (token_weights(lengths, n, cfg.ld_alpha, policy_logps.dtype) if cfg.ld_alpha < 1
         else torch.ones_like(policy_logps))

    def sums(values):
        return torch.zeros(2 * n, dtype=values.dtype, device=values.device).index_add(0, seq, values)

    policy = sums(policy_logps * w)
    ref = sums(ref_logps.to(policy_logps) * w)
    s = policy - ref
    lens = lengths.clamp(min=1).to(policy.dtype)  # a per-token mean over no tokens is 0, not a division by zero
    kl = seq_kl = None
    if top_k is not None:
        kl = {"policy_ref": coarse_kl(top_k.policy, top_k.policy_rest, top_k.ref, top_k.ref_rest),
              "ref_policy": coarse_kl(top_k.ref, top_k.ref_rest, top_k.policy, top_k.policy_rest)}
        seq_kl = sums(kl["ref_policy"])  # TDPO's sequential KL(ref || pi) of each completion
    tdpo = cfg.loss_type in TOP_K_LOSSES
    kept = None
    if beta_dpo is not None and cfg.loss_type == "beta_dpo":  # a training batch: its own β and pairs (BetaDPO)
        batch_beta, kept = beta_dpo.batch(s[:n] - s[n:])
        cfg = dataclasses.replace(cfg, beta=batch_beta)
    losses = pair_loss(s[:n], s[n:], lens[:n], lens[n:], cfg, *((seq_kl[:n], seq_kl[n:]) if tdpo else ()))
    parts = {"loss/preference": losses.detach()}  # the loss's parts apart, per pair
    if cfg.kl_coef:
        penalty = cfg.kl_coef * sums(kl["policy_ref"])[:n] / lens[:n]
        losses = losses + penalty
        parts["loss/kl_penalty"] = penalty.detach()
    if cfg.rpo_alpha:
        nll_chosen = -sums(policy_logps)[:n] / lens[:n]
        losses = losses + cfg.rpo_alpha * nll_chosen
        parts["loss/sft"] = cfg.rpo_alpha * nll_chosen.detach()
    if tdpo:  # TDPO's KL term inside the sigmoid, b (K+ - K-) (TDPO2: b alpha (K+ - K-)), beside b d
        weight = cfg.beta * (cfg.tdpo_alpha if cfg.loss_type == "tdpo2" else 1.0)
        parts["tdpo/kl_term"] = weight * (seq_kl[:n] - seq_kl[n:]).detach()
    with torch.no_grad():
        ratio = (policy_logps - ref_logps.to(policy_logps)).detach()  # per token, log(pi / ref)
        tok = lambda v: sums(v)[: 2 * n] / lens  # per-sequence token means
        rewards = cfg.beta * (s + seq_kl if tdpo else s).detach()
        metrics = {
            "rewards/chosen": rewards[:n],
            "rewards/rejected": rewards[n:],
            "rewards/accuracies": (rewards[:n] > rewards[n:]).float(),
            "rewards/margins": rewards[:n] - rewards[n:],
            "logps/accuracies": (policy.detach()[:n] > policy.detach()[n:]).float(),  # outright preference
            "logps/chosen": policy.detach()[:n],
            "logps/rejected": policy.detach()[n:],
            "logratio/chosen": tok(ratio)[:n],
            "logratio/rejected": tok(ratio)[n:],
            "lengths/chosen": lengths[:n].to(policy.dtype),
            "lengths/rejected": lengths[n:].to(policy.dtype),
            **{k: v.to(policy.dtype) for k, v in parts.items()},
        }
        if top_k is not None:
            for direction, values in kl.items():
                metrics[f"kl/{direction}/chosen"], metrics[f"kl/{direction}/rejected"] = tok(values.detach()).split(n)
            mass = tok(top_k.ref.to(policy.dtype).logsumexp(-1).exp())
            metrics["ref_top_k_mass/chosen"], metrics["ref_top_k_mass/rejected"] = mass.split(n)
        if kept is not None:
            metrics["beta_dpo/beta"] = torch.full_like(rewards[:n], cfg.beta)
            metrics["beta_dpo/kept"] = kept.to(policy.dtype)
    if kept is not None:
        return (losses * kept).sum() * beta_dpo.share, metrics
    return losses.mean(), metrics
