"""The preference losses' names and options (formulas in dpo/losses.py), apart from torch so that train-dpo's
command line can offer them without importing it."""

from __future__ import annotations

from dataclasses import dataclass

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "bco_pair", "sppo_hard", "nca_pair", "apo_zero", "apo_down",
              "sigmoid_norm", "tdpo1", "tdpo2", "beta_dpo")
TOP_K_LOSSES = ("tdpo1", "tdpo2")


@dataclass
class LossConfig:
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    ld_alpha: float = 1.0
    tdpo_alpha: float = 0.5
    kl_coef: float = 0.0
    beta_dpo_alpha: float = 0.6  # β-DPO (Wu et al. 2024): α, the scaling of β by the batch's reward discrepancy
    beta_dpo_rho: float = 0.2  # ρ, the share of each batch its β-guided filtering leaves out
    beta_dpo_momentum: float = 0.9  # m, of the moving mean and standard deviation of the discrepancy

    @property
    def needs_top_k(self) -> str | None:
        """The option that needs the reference's top-k distribution (a top-k cache), or None."""
        if self.loss_type in TOP_K_LOSSES:
            return f"--loss-type {self.loss_type}"
        return "--kl-coef" if self.kl_coef else None

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.beta <= 0:
            raise ValueError("beta must be positive")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError("label_smoothing must be in [0, 0.5)")
        if not 0 <= self.ld_alpha <= 1:
            raise ValueError("ld_alpha must be in [0, 1]")
        if not 0 <= self.beta_dpo_rho < 1 or not 0 <= self.beta_dpo_momentum < 1:
            raise ValueError("beta_dpo_rho and beta_dpo_momentum must be in [0, 1)")
        if self.tdpo_alpha < 0 or self.kl_coef < 0:
            raise ValueError("tdpo_alpha and kl_coef must be >= 0")
