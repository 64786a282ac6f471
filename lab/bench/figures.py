"""Figures of a benchmark run: a value, its unit, the goal it is measured against, and the
table and JSON they are reported as.

A :class:`Figure` is one number. Its goal is data (``op`` and ``goal``), so the report can say
whether it is met, but nothing here fails on it: the suite measures, people judge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

GoalOp = Literal[">=", "<="]


@dataclass(frozen=True)
class Figure:
    """One measured number. ``op``/``goal`` state the goal (None: informational)."""

    name: str
    value: float
    unit: str
    op: GoalOp | None = None
    goal: float | None = None
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.op is None or self.goal is None or not math.isfinite(self.value):
            return None
        return self.value >= self.goal if self.op == ">=" else self.value <= self.goal

    def goal_text(self) -> str:
        if self.op is None or self.goal is None:
            return "—"
        return f"{'≥' if self.op == '>=' else '≤'} {fmt(self.goal)} {self.unit}".rstrip()

    def as_dict(self) -> dict[str, Any]:
        return {
            "value": self.value if math.isfinite(self.value) else None,
            "unit": self.unit,
            "goal": None if self.op is None else f"{self.op} {self.goal}",
            "met": self.met,
            "note": self.note,
        }


@dataclass
class BenchResult:
    """What one benchmark produced: its figures, details for the JSON, or why it did not run."""

    name: str
    figures: list[Figure] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: str | None = None
    error: str | None = None

    def add(
        self,
        name: str,
        value: float,
        unit: str,
        op: GoalOp | None = None,
        goal: float | None = None,
        note: str = "",
    ) -> Figure:
        f = Figure(name, float(value), unit, op, goal, note)
        self.figures.append(f)
        return f

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 2),
            "skipped": self.skipped,
            "error": self.error,
            "figures": {f.name: f.as_dict() for f in self.figures},
            "details": self.details,
        }


def fmt(v: float) -> str:
    """A number for people: thousands separators for large values, 3 significant digits."""
    if not math.isfinite(v):
        return "n/a"
    a = abs(v)
    if a >= 10_000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.3g}"
    if a == 0:
        return "0"
    return f"{v:.3g}"


def markdown_table(results: list[BenchResult]) -> str:
    """``| benchmark | figure | measured | goal | met |`` rows for every figure."""
    lines = ["| benchmark | figure | measured | goal | met |", "|---|---|---|---|---|"]
    for r in results:
        if r.skipped or r.error:
            why = f"skipped: {r.skipped}" if r.skipped else f"error: {r.error}"
            lines.append(f"| {r.name} | — | {why} | — | — |")
            continue
        for f in r.figures:
            met = {True: "yes", False: "no", None: ""}[f.met]
            note = f" ({f.note})" if f.note else ""
            lines.append(
                f"| {r.name} | {f.name}{note} | {fmt(f.value)} {f.unit} | {f.goal_text()} | {met} |"
            )
    return "\n".join(lines)
