"""The domain of every numeric option, declared once where the option is (a dataclass field's `metadata={"domain": D}`,
or a table for a foreign class such as transformers.TrainingArguments) and checked by `check`, for the command line
(`DomainType`, the click type runtime.options.option_specs builds) and for config files alike. NaN and infinities are
outside every domain."""

from __future__ import annotations

import math

import click

COEFFICIENT_MAX = 1e6

# domain -> (number kind, what it means, test of a finite value of that kind)
DOMAINS = {
    "finite": (float, "a finite number", lambda v: True),
    "nonnegative": (float, "a finite number >= 0", lambda v: v >= 0),
    "positive": (float, "a finite number > 0", lambda v: v > 0),
    "probability": (float, "a probability (a number in [0, 1])", lambda v: 0 <= v <= 1),
    "open_probability": (float, "a number strictly between 0 and 1", lambda v: 0 < v < 1),
    "factor": (float, "a finite number > 1", lambda v: v > 1),
    # a loss coefficient (β, its schedule's and clamp's ends, the weights of added terms): it multiplies a per-sequence
    # log-ratio in float32/bf16 (max 3.4e38), so it is bounded far above any coefficient in use (TRL's β 0.1) and far
    # below an overflow: 1e6 leaves a log-ratio of 1e32, and at β 1e6 the sigmoid is already a step function
    "coefficient": (float, "a finite number > 0 and <= 1e6", lambda v: 0 < v <= COEFFICIENT_MAX),
    "weight": (float, "a finite number >= 0 and <= 1e6", lambda v: 0 <= v <= COEFFICIENT_MAX),
    "scale": (float, "a finite number between -1e6 and 1e6",
              lambda v: abs(v) <= COEFFICIENT_MAX),
    "count": (int, "a whole number >= 1", lambda v: v >= 1),
    "natural": (int, "a whole number >= 0", lambda v: v >= 0),
    # options whose negative values have a meaning of their own (max_steps -1: train by epochs instead)
    "integer": (int, "a whole number", lambda v: True),
}


def kind_of(domain: str) -> type:
    """int or float: the kind of number a domain holds."""
    return DOMAINS[domain][0]


def describe(domain: str) -> str:
    return DOMAINS[domain][1]


def check(value, domain: str, minimum=None):
    """`value` (a number, or its text) as the domain's kind of number, or ValueError saying what the domain
    takes. Text is read as Python reads a number; a whole float (2.0) is taken for an int domain, 2.5 is not.
    `minimum`: a lower bound of the option's own beyond the domain's (max_length >= 2)."""
    if domain not in DOMAINS:
        raise KeyError(f"unknown numeric domain {domain!r} (one of {', '.join(DOMAINS)})")
    kind, meaning, holds = DOMAINS[domain]
    if minimum is not None:
        meaning, bounded = f"{'a whole' if kind is int else 'a finite'} number >= {minimum}", holds
        holds = lambda v: bounded(v) and v >= minimum
    number = _number(value)
    if number is None:
        raise ValueError(f"{value!r} is not a number; expected {meaning}")
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(f"{value!r} is not finite; expected {meaning}")
    if kind is int:
        if isinstance(number, float) and not number.is_integer():
            raise ValueError(f"{value!r} is not a whole number; expected {meaning}")
        number = int(number)
    else:
        number = float(number)
    if not holds(number):
        raise ValueError(f"{value!r} is out of range; expected {meaning}")
    return number


def _number(value):
    if isinstance(value, bool):  # YAML's `yes`/`true` for a number is a mistake, not 1
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        for parse in (int, float):
            try:
                return parse(text)
            except ValueError:
                continue
    return None


class DomainType(click.ParamType):
    """A numeric option checked by `check` against its declared domain; a bad value is a usage error naming the
    option (click names it) and what the domain takes."""

    def __init__(self, domain: str, minimum=None):
        kind_of(domain)  # an unknown domain fails where the option is made
        self.domain, self.minimum = domain, minimum
        self.name = f"{kind_of(domain).__name__} ({domain})"

    def get_metavar(self, param, ctx=None):
        return "INTEGER" if kind_of(self.domain) is int else "FLOAT"

    def convert(self, value, param, ctx):
        try:
            return check(value, self.domain, self.minimum)
        except ValueError as e:
            self.fail(str(e), param, ctx)

    def __repr__(self):
        return f"DomainType({self.domain!r})"


class DomainInt(DomainType, click.types.IntParamType):
    """An int-valued domain (still an int type to whoever walks the options)."""


class DomainFloat(DomainType, click.types.FloatParamType):
    """A float-valued domain."""


def domain_type(domain: str, minimum=None) -> DomainType:
    return (DomainInt if kind_of(domain) is int else DomainFloat)(domain, minimum)
