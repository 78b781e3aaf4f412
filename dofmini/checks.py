"""The package's one way to refuse a bad argument: a ValueError naming the function (`what`),
the argument, its value and what it must be, raised before any work. Standard library only, so a
vendored module carries it along."""

import math
import numbers


def not_integers(what: str, least: int = 1, **values) -> str:
    """need_integers' message for the first value that is no integer >= least, or "": for a
    caller that raises it in its own frame."""
    for name, value in values.items():
        whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if not (whole and value >= least):
            return f"{what}: {name}={value!r}; expected an integer >= {least}"
    return ""


def need_integers(what: str, least: int = 1, **values) -> None:
    """A ValueError naming `what`, an argument and its value, unless each
    is an integer >= least (no bool)."""
    why = not_integers(what, least, **values)
    if why:
        raise ValueError(why)


def not_positive(what: str, **values) -> str:
    """need_positive's message for the first value that is no positive finite number, or ""."""
    for name, value in values.items():
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (real and math.isfinite(value) and value > 0):
            return f"{what}: {name}={value!r}; expected a positive finite number"
    return ""


def need_positive(what: str, **values) -> None:
    """need_integers' error unless each value is a positive finite number."""
    why = not_positive(what, **values)
    if why:
        raise ValueError(why)


def need_one_of(what: str, choices, **values) -> None:
    """need_integers' error unless each value is one of `choices`."""
    allowed = list(choices)
    for name, value in values.items():
        if value not in allowed:
            raise ValueError(f"{what}: {name}={value!r}; expected one of {allowed}")
