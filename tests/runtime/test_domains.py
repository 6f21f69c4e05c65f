"""runtime/domains.py: the one check of a numeric option's declared domain (issue 34 family 3), for numbers and for
their text alike; NaN and infinities are in no domain."""

from __future__ import annotations

import math

import click
import pytest

from runtime.domains import DOMAINS, check, domain_type, kind_of

# per domain: values inside, values outside (beyond NaN and the infinities, refused by every domain)
CASES = {
    "finite": ([-1e300, 0, 2.5, "-3e-7"], []),
    "nonnegative": ([0, 0.0, 1e-12, "5"], [-1e-12, "-1"]),
    "positive": ([1e-12, 3, "0.5"], [0, 0.0, -1]),
    "probability": ([0, 1, 0.5, "1.0"], [-0.01, 1.01, "2"]),
    "open_probability": ([0.01, 0.99], [0, 1, -0.5, 1.5]),
    "factor": ([1.01, 10, "2"], [1, 0.5, 0, -2]),
    "count": ([1, 2, "7", 3.0], [0, -1, 2.5, "1.5"]),
    "natural": ([0, 1, "0"], [-1, 0.5]),
    "integer": ([-1, 0, 12, "-5"], [0.5]),
    "coefficient": ([1e-12, 0.1, 1e6, "5"], [0, -0.1, 1.0000001e6, 1e308, "1e308"]),
    "weight": ([0, 0.5, 1e6], [-1e-12, 2e6, 1e308]),
    "scale": ([-1e6, 0, 0.6, 1e6], [-1.0000001e6, 1e308, "-1e308"]),
}


def test_every_domain_has_cases():
    assert set(CASES) == set(DOMAINS)


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_values_inside_are_taken_as_the_domains_kind_and_outside_refused(domain):
    inside, outside = CASES[domain]
    for value in inside:
        got = check(value, domain)
        assert type(got) is kind_of(domain) and got == float(value), (domain, value)
    for value in [*outside, math.nan, math.inf, -math.inf, "nan", "inf", "-inf", "NaN", "Infinity", "x", "", True,
                  None, [1]]:
        with pytest.raises(ValueError) as raised:
            check(value, domain)
        assert repr(value) in str(raised.value) and "expected" in str(raised.value), (domain, value)


def test_a_bound_of_the_options_own_is_checked_with_the_domain():
    assert check("2", "count", minimum=2) == 2
    with pytest.raises(ValueError, match="expected a whole number >= 2"):
        check(1, "count", minimum=2)
    with pytest.raises(KeyError):
        check(1, "percentage")


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_the_click_type_is_a_number_type_that_refuses_as_a_usage_error(domain):
    kind = domain_type(domain)
    assert isinstance(kind, click.types.IntParamType if kind_of(domain) is int else click.types.FloatParamType)

    @click.command()
    @click.option("--value", type=kind)
    def cmd(value):
        click.echo(repr(value))

    from click.testing import CliRunner

    result = CliRunner().invoke(cmd, ["--value", "nan"])
    assert result.exit_code == 2 and "Invalid value for '--value'" in result.output, result.output
    assert "'nan' is not finite" in result.output, result.output
    inside = CASES[domain][0][0]
    result = CliRunner().invoke(cmd, ["--value", str(inside)])
    assert result.exit_code == 0 and result.output.strip() == repr(kind_of(domain)(inside)), result.output
