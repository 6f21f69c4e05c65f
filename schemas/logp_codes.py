"""The 16-bit codes of a top-k log-prob (`encode_logps` / `decode_logps`, FORMAT.md "The log-prob codes") and what
their rounding allows a decoded value and a decoded distribution's mass (`code_allowance`, `mass_allowance`): the
codec that schemas/format.py writes and reads the top-k columns with, and that the top-k rules judge stored values by."""

from __future__ import annotations

import numpy as np


LOGP_STEP = 2.0**-11  # code step: absolute (nats) above LOGP_FIXED, of log(-logp) below it
LOGP_FIXED = 24.0  # log-probs in [-24, 0]: fixed point; below: logarithmic (relative error)
LOGP_ERROR = LOGP_STEP / 2  # the stored error bound: absolute above -24, relative (of |logp|) below
_LOG_START = round(LOGP_FIXED / LOGP_STEP)  # 49152, the first logarithmic code
_NEG_INF = 2**16 - 1


def encode_logps(values) -> np.ndarray:
    """Log-probs (<= 0) as uint16 codes: c = round(-v / step) for v >= -24 (error <= 2**-12 nats), then
    49152 + round(log(-v / 24) / step) (relative error <= 2**-12) down to about -71500, where it saturates; 65535 is
    -inf. Probabilities of log-probs below -24 are under 4e-11, so a KL term they enter (p x logp) moves by less
    than their relative error of what it already is."""
    v = np.asarray(values, np.float64)
    if np.isnan(v).any():
        raise ValueError("a top-k log-prob is NaN")
    a = np.maximum(-v, 0.0)  # a log-prob rounded above 0 is 0
    with np.errstate(divide="ignore", invalid="ignore"):
        log_part = _LOG_START + np.rint(np.log(np.maximum(a, LOGP_FIXED) / LOGP_FIXED) / LOGP_STEP)
    code = np.where(a < LOGP_FIXED, np.rint(a / LOGP_STEP), log_part)
    return np.where(np.isinf(a), _NEG_INF, np.minimum(code, _NEG_INF - 1)).astype(np.uint16)


def decode_logps(codes) -> np.ndarray:
    """The float32 log-probs of `encode_logps`' codes."""
    c = np.asarray(codes).astype(np.float64)
    v = np.where(c < _LOG_START, -c * LOGP_STEP, -LOGP_FIXED * np.exp((c - _LOG_START) * LOGP_STEP))
    return np.where(c == _NEG_INF, -np.inf, v).astype(np.float32)


# How far the true top-k mass plus the tail's may be from 1 before any code is rounded: float32 log_softmax and
# log-sum-exp of the same logits agree within about 1e-6 (tests/precompute/test_topk.py); 1e-5 leaves room.
MASS_SLACK = 1e-5


def code_allowance(decoded) -> np.ndarray:
    """How far a decoded log-prob may be from the value it was encoded from, as the top-k rules state it: 2.45e-4 x
    max(1, |v|) (the codes' error is at most LOGP_ERROR above -24 and 2.45e-4 of |v| below), plus the float32
    rounding of a decoded value (2e-6); 0 for -inf (stored exactly)."""
    a = np.abs(np.asarray(decoded, np.float64))
    return np.where(np.isfinite(a), 2.45e-4 * np.maximum(1.0, a) + 2e-6, 0.0)


def mass_allowance(top_logps, tail) -> np.ndarray:
    """Per position ([T, K] decoded log-probs, [T] tails), how far their mass plus the tail's may be from 1 when each
    value is within `code_allowance` of a true one and the true mass is 1 within MASS_SLACK:
    sum_i exp(v_i) exp(a_i) (exp(a_i) - 1) + MASS_SLACK (exp(v_i + a_i) bounds the true p_i)."""
    v = np.asarray(top_logps, np.float64)
    a = code_allowance(v)
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.exp(v + a) * np.expm1(a)).sum(-1) + MASS_SLACK


def _code_steps(codes: np.ndarray) -> np.ndarray:
    """Per token, the first code and then each code's step from the one before, modulo 2**16 (lossless whatever
    the order; a descending top-k's steps are small and non-negative, which zstd packs tighter than the codes)."""
    steps = codes.astype(np.int64)
    steps[..., 1:] = np.diff(steps, axis=-1)
    return (steps % 2**16).astype(np.uint16)


def _code_values(steps: np.ndarray) -> np.ndarray:
    """The codes of `_code_steps`' steps ([tokens, K])."""
    return (np.cumsum(steps.astype(np.int64), axis=-1) % 2**16).astype(np.uint16)


def normalised_top_k(top_logps, tail) -> tuple[np.ndarray, np.ndarray]:
    """The decoded top-k log-probs ([T, K]) and tails ([T]) less log Z per position, Z their mass plus the tail's
    (float64), so that the distribution they stand for sums to 1 (within float32 rounding) wherever the codes'
    rounding explains how far Z is from 1 (`mass_allowance`). Why: a KL against a distribution of mass Z is off by
    about log Z (first order, up to 2.4e-4 nats per token), against a normalised one of the same accuracy by half the
    variance of the rounding (under 3e-8). A position the rounding cannot explain (a damaged value or tail) is
    returned as decoded, so the top-k rules (schemas/rules.py `top_k_mass`) still see and name it."""
    v = np.asarray(top_logps, np.float64)
    t = np.asarray(tail, np.float64)
    every = np.concatenate([v, t[:, None]], axis=1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        top = np.max(every, axis=1, initial=-np.inf)
        log_z = top + np.log(np.exp(every - np.where(np.isfinite(top), top, 0.0)[:, None]).sum(1))
        explained = np.isfinite(log_z) & (np.abs(np.expm1(log_z)) <= mass_allowance(v, t))
    shift = np.where(explained, log_z, 0.0)
    return (v - shift[:, None]).astype(np.float32), (t - shift).astype(np.float32)
