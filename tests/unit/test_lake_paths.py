"""Hostile partition values, dataset names and offsets never produce a path outside the lake."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

from services.lake.layout import (
    LakeError,
    LakePaths,
    encode_value,
    file_name,
    hour_of,
    live_files,
    parse_file_name,
    parse_hour,
)
from services.lake.writer import LakeWriter

HOSTILE = [
    "..",
    ".",
    "../../etc",
    "/etc/passwd",
    "a/../../b",
    "a\x00b",
    "\x00",
    "x" * 5000,
    "é" * 300,
    "a\u2215..\u2215b",  # division slash
    "\uff0f..\uff0f",  # fullwidth solidus
    "\u202e..\u202d/",  # right-to-left override, left-to-right override
    "\u200f\u200e..",  # RTL / LTR marks
    "%2e%2e",
    "%2F",
    "C:\\Windows",
    "\\..\\..",
    "con",
    "a=b",
    "date=2024-01-01/hour=00",
    "\n",
    " ",
    "~",
    "$(rm -rf /)",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_partition_values_stay_one_component_inside_the_root(
    tmp_path: Path, value: str
) -> None:
    paths = LakePaths(tmp_path / "lake")
    d = paths.partition_dir("samples", [("node", value), ("device", value)])
    root = (tmp_path / "lake").resolve()
    assert d.resolve().is_relative_to(root)
    rel = d.relative_to(tmp_path / "lake")
    assert len(rel.parts) == 3  # samples / node=... / device=...
    for part in rel.parts[1:]:
        assert part not in (".", "..") and "/" not in part and "\x00" not in part
        assert len(part.encode()) < 255  # a valid file name on every common file system
        d.mkdir(parents=True, exist_ok=True)  # and the OS accepts it


def test_distinct_values_stay_distinct_even_when_long() -> None:
    a, b = "x" * 5000 + "a", "x" * 5000 + "b"
    assert encode_value(a) != encode_value(b)
    assert encode_value("a/b") != encode_value("a%2Fb")


@pytest.mark.parametrize("value", ["", "\ud800"])
def test_values_that_cannot_be_a_component_are_refused(value: str) -> None:
    with pytest.raises(LakeError):
        encode_value(value)


@pytest.mark.parametrize(
    "dataset", ["..", "../samples", "samples/../..", "/tmp", "", "SAMPLES", "samples\x00"]
)
def test_unknown_datasets_are_refused(tmp_path: Path, dataset: str) -> None:
    with pytest.raises(LakeError):
        LakePaths(tmp_path).dataset_dir(dataset)
    with pytest.raises(LakeError):
        LakeWriter(tmp_path).land(dataset, pa.table({"ts": [1]}), partition=0, first=0, last=0)


@pytest.mark.parametrize(
    "date, hour",
    [
        ("..", "00"),
        ("2024-01-01/..", "00"),
        ("2024-13-01", "00"),
        ("2024-01-01", "24"),
        ("2024-01-01", "0/"),
        ("2024-01-01", "\uff10\uff10"),
        ("\uff12\uff10\uff12\uff14-01-01", "00"),
    ],
)
def test_bad_hours_are_refused(tmp_path: Path, date: str, hour: str) -> None:
    with pytest.raises(LakeError):
        LakePaths(tmp_path).hour_dir("samples", date, hour)
    with pytest.raises(LakeError):
        parse_hour(f"{date}T{hour}")


@pytest.mark.parametrize(
    "partition, first, last",
    [(-1, 0, 0), (0, -5, 0), (0, 5, 4), (2**31, 0, 0), (0, 0, 2**63), (True, 0, 0)],
)
def test_bad_offsets_are_refused(partition: int, first: int, last: int) -> None:
    with pytest.raises(LakeError):
        file_name(partition, first, last)


def test_symlinked_dataset_dir_pointing_outside_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "lake").mkdir()
    os.symlink(outside, tmp_path / "lake" / "events")
    with pytest.raises(LakeError):
        LakePaths(tmp_path / "lake").hour_dir("events", "2024-01-01", "00")
    assert list(outside.iterdir()) == []


def test_timestamps_out_of_range_clamp_into_valid_hours() -> None:
    assert hour_of(-(10**18)) == ("1970-01-01", "00")
    assert hour_of(2**63 - 1) == ("2262-04-11", "23")
    assert hour_of(1_704_070_800_000_000_000) == ("2024-01-01", "01")


def test_names_round_trip_and_coverage() -> None:
    d = Path("/l/samples/date=2024-01-01/hour=00")
    a = parse_file_name(d / file_name(3, 10, 19))
    b = parse_file_name(d / file_name(3, 20, 29))
    c = parse_file_name(d / file_name(3, 10, 29))
    other = parse_file_name(d / file_name(4, 10, 29))
    assert a and b and c and other
    assert (a.partition, a.first, a.last) == (3, 10, 19)
    assert c.covers(a) and c.covers(b) and not a.covers(c) and not other.covers(a)
    assert live_files([a, b, c, other]) == sorted([c, other])
    assert parse_file_name(d / ".land-p3-10-19.parquet.partial") is None
    assert parse_file_name(d / "seed.parquet") is None
