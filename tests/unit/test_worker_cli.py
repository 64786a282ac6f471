"""``refinery worker`` arguments: ``--take-within-ms`` and ``--checkpoint-ms`` reach the
worker's configuration in seconds, ``--clock-plausible-drift-ppm`` in ppm, the dead-letter
limit as a share of a window of records, and a bad value is one line naming the argument,
exit 2, before anything runs."""

from __future__ import annotations

import pytest

from services.cli import build_parser, main


def test_take_within_ms_is_read_in_milliseconds() -> None:
    args = build_parser().parse_args(["worker", "--take-within-ms", "12.5"])
    assert args.take_within_ms == 12.5
    assert build_parser().parse_args(["worker"]).take_within_ms == 50.0


def test_checkpoint_ms_is_read_in_milliseconds_and_zero_means_every_group() -> None:
    assert build_parser().parse_args(["worker", "--checkpoint-ms", "250"]).checkpoint_ms == 250.0
    assert build_parser().parse_args(["worker", "--checkpoint-ms", "0"]).checkpoint_ms == 0.0
    assert build_parser().parse_args(["worker"]).checkpoint_ms == 1000.0


def test_the_dead_letter_limit_is_more_than_half_of_the_last_thousand_records() -> None:
    args = build_parser().parse_args(["worker"])
    assert (args.max_deadletter_share, args.deadletter_window) == (0.5, 1000)
    args = build_parser().parse_args(
        ["worker", "--max-deadletter-share", "0.9", "--deadletter-window", "50"]
    )
    assert (args.max_deadletter_share, args.deadletter_window) == (0.9, 50)


def test_plausible_drift_is_read_in_ppm() -> None:
    args = build_parser().parse_args(["worker", "--clock-plausible-drift-ppm", "50"])
    assert args.clock_plausible_drift_ppm == 50.0
    assert build_parser().parse_args(["worker"]).clock_plausible_drift_ppm == 200.0


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--take-within-ms", "0", "0 ms: expected 1 to 10000"),
        ("--take-within-ms", "x", "'x' is not a number of milliseconds"),
        ("--checkpoint-ms", "-1", "-1 ms: expected 0 to 10000"),
        ("--checkpoint-ms", "20000", "20000 ms: expected 0 to 10000"),
        ("--clock-plausible-drift-ppm", "0", "0 ppm: expected 1 to 10000"),
        ("--clock-plausible-drift-ppm", "fast", "'fast' is not a number of ppm"),
        ("--max-deadletter-share", "0", "0 of the records: expected 0.01 to 1"),
        ("--max-deadletter-share", "1.5", "1.5 of the records: expected 0.01 to 1"),
        ("--deadletter-window", "0", "0 records: expected 1 to 10000000"),
        ("--deadletter-window", "1e3", "'1e3' is not a number of records"),
    ],
)
def test_a_bad_number_is_one_line_and_exit_2(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["worker", flag, value])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and says in err, err
