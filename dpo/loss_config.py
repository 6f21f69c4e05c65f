"""The preference losses' names and options (formulas in dpo/losses.py), apart from torch so that train-dpo's
command line can offer them without importing it.

The registry: each loss declares the options it reads (LOSSES). An option that the chosen loss does not read is
refused when given (`unread_options`), so that nothing ignored is recorded as used; every LossConfig field but
loss_type is read by at least one loss (tests/dpo/test_losses.py enumerates them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from runtime.domains import check

# read by every loss: the strength beta, and the terms added to any loss (RPO's NLL, LD-DPO's token weights, the KL
# penalty)
EVERY_LOSS = ("beta", "rpo_alpha", "ld_alpha", "kl_coef")
LOSSES = {
    "sigmoid": EVERY_LOSS + ("label_smoothing",),
    "ipo": EVERY_LOSS,
    "hinge": EVERY_LOSS,
    "robust": EVERY_LOSS + ("label_smoothing",),
    "bco_pair": EVERY_LOSS,
    "sppo_hard": EVERY_LOSS,
    "nca_pair": EVERY_LOSS,
    "apo_zero": EVERY_LOSS,
    "apo_down": EVERY_LOSS,
    "sigmoid_norm": EVERY_LOSS,
    "tdpo1": EVERY_LOSS,
    "tdpo2": EVERY_LOSS + ("tdpo_alpha",),
    "beta_dpo": EVERY_LOSS + ("label_smoothing", "beta_dpo_alpha", "beta_dpo_rho", "beta_dpo_momentum"),
}
LOSS_TYPES = tuple(LOSSES)
TOP_K_LOSSES = ("tdpo1", "tdpo2")


def _option(default, domain: str):
    return field(default=default, metadata={"domain": domain})


@dataclass
class LossConfig:
    """A loss and its options; each numeric option's domain (runtime/domains.py) is declared here once, and
    train-dpo's option of the same name takes it from here (dpo/config.py)."""

    beta: float = _option(0.1, "coefficient")
    loss_type: str = "sigmoid"
    label_smoothing: float = _option(0.0, "probability")  # and < 0.5: __post_init__
    rpo_alpha: float = _option(0.0, "weight")
    ld_alpha: float = _option(1.0, "probability")
    tdpo_alpha: float = _option(0.5, "weight")
    kl_coef: float = _option(0.0, "weight")
    beta_dpo_alpha: float = _option(0.6, "scale")  # β-DPO (Wu et al. 2024): α, the scaling of β by the batch's reward discrepancy
    beta_dpo_rho: float = _option(0.2, "probability")  # ρ, the share of each batch its β-guided filtering leaves out (< 1)
    beta_dpo_momentum: float = _option(0.9, "probability")  # m, of the moving mean and deviation of the discrepancy (< 1)

    @property
    def needs_top_k(self) -> str | None:
        """The option that needs the reference's top-k distribution (a top-k cache), or None."""
        if self.loss_type in TOP_K_LOSSES:
            return f"--loss-type {self.loss_type}"
        return "--kl-coef" if self.kl_coef else None

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        for f in dataclasses.fields(self):
            if "domain" in f.metadata:
                try:
                    setattr(self, f.name, check(getattr(self, f.name), f.metadata["domain"]))
                except ValueError as e:
                    raise ValueError(f"{f.name}: {e}") from None
        if self.label_smoothing >= 0.5:
            raise ValueError(f"label_smoothing must be below 0.5 (robust divides by 1 - 2e), got {self.label_smoothing}")
        if self.beta_dpo_rho >= 1 or self.beta_dpo_momentum >= 1:
            raise ValueError(f"beta_dpo_rho and beta_dpo_momentum must be below 1, got {self.beta_dpo_rho} and "
                             f"{self.beta_dpo_momentum}")


def trained_with(loss: LossConfig) -> dict:
    """The loss and the options it reads, as a checkpoint records them: {option as typed: value}. A resume with
    other values would train one run under two objectives that its record calls one (dpo/provenance.py)."""
    return {"--loss-type": loss.loss_type,
            **{f"--{name.replace('_', '-')}": getattr(loss, name) for name in LOSSES[loss.loss_type]}}


def loss_field(name: str) -> dataclasses.Field:
    """LossConfig's field `name` (its default and domain)."""
    return next(f for f in dataclasses.fields(LossConfig) if f.name == name)


def readers(option: str) -> list[str]:
    """The losses that read `option`."""
    return [loss for loss, options in LOSSES.items() if option in options]


def unread_options(loss_type: str, given) -> list[str]:
    """The loss options in `given` (names) that the loss `loss_type` does not read."""
    options = {f.name for f in dataclasses.fields(LossConfig)} - {"loss_type"}
    return [name for name in given if name in options and name not in LOSSES[loss_type]]


def unread_message(loss_type: str, name: str, value, where: str) -> str:
    """The refusal of a loss option the chosen loss does not read (`where`: how it was given)."""
    users = readers(name)
    return (f"{where} {value}: the {loss_type} loss does not read it (it is an option of {', '.join(users)}), so it "
            f"would be ignored; drop it, or choose --loss-type {' / '.join(users)}")
