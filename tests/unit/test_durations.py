"""One duration parser for the product and the lab (:mod:`schemas.durations`): every form
the exporters' ``--interval``, detect's rule files, topic specs and the simulator took."""

from __future__ import annotations

import doctest

import pytest
from pydantic import BaseModel, ValidationError

import schemas.durations
from schemas.durations import DurationNs, parse_duration_ns, parse_duration_s
from schemas.errors import ConfigError

S = 1_000_000_000


def test_the_docstring_examples_run() -> None:
    assert doctest.testmod(schemas.durations).failed == 0


@pytest.mark.parametrize(
    ("text", "ns"),
    [("1s", S), ("500ms", S // 2), ("2", 2 * S), ("1.5", 3 * S // 2), (".5s", S // 2),
     (" 2 m ", 120 * S), ("1h", 3600 * S), ("250us", 250_000), ("10ns", 10), ("0.3", 3 * S // 10),
     (30, 30 * S), (0.25, S // 4), (0, 0)],
)  # fmt: skip
def test_what_is_a_duration(text: str | float, ns: int) -> None:
    assert parse_duration_ns(text) == ns
    assert parse_duration_s(text) == ns / 1e9


@pytest.mark.parametrize(
    "bad", ["soon", "-1s", "1 d", "1e3s", "", -1, float("nan"), True, "9" * 400]
)
def test_what_is_not_is_one_line_naming_the_flag(bad: str | float) -> None:
    with pytest.raises(ConfigError) as e:
        parse_duration_ns(bad, name="--interval")
    assert str(e.value).startswith("--interval ") and "\n" not in str(e.value)


def test_an_interval_must_be_positive() -> None:
    assert parse_duration_s("1ms", positive=True) == 0.001
    for zero in ("0", "0ms", 0):
        with pytest.raises(ConfigError, match="positive"):
            parse_duration_s(zero, positive=True)


def test_a_pydantic_field_reports_a_bad_duration_as_a_validation_error() -> None:
    class Rule(BaseModel):
        for_ns: DurationNs = 0

    assert Rule.model_validate({"for_ns": "5m"}).for_ns == 300 * S
    assert Rule.model_validate({"for_ns": 2}).for_ns == 2 * S
    with pytest.raises(ValidationError, match="expected a duration"):
        Rule.model_validate({"for_ns": "soon"})
