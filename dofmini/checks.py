"""The package's one way to refuse a bad argument: a ValueError naming the function (`what`),
the argument, its value and what it must be, raised before any work. Standard library only, so a
vendored module carries it along."""

import math
import numbers


def need_integers(what: str, least: int = 1, **values) -> None:
    """A ValueError naming `what`, an argument and its value, unless each
    is an integer >= least (no bool)."""
    for name, value in values.items():
        whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if not (whole and value >= least):
            raise ValueError(f"{what}: {name}={value!r}; expected an integer >= {least}")


def need_positive(what: str, **values) -> None:
    """need_integers' error unless each value is a positive finite number."""
    for name, value in values.items():
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (real and math.isfinite(value) and value > 0):
            raise ValueError(f"{what}: {name}={value!r}; expected a positive finite number")


def need_one_of(what: str, choices, **values) -> None:
    """need_integers' error unless each value is one of `choices`."""
    allowed = list(choices)
    for name, value in values.items():
        if value not in allowed:
            raise ValueError(f"{what}: {name}={value!r}; expected one of {allowed}")
