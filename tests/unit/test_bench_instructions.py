"""The instruction-count harness outside valgrind: what each valgrind child runs, and its
argument check (the valgrind runs themselves take minutes and are not part of the suite)."""

from __future__ import annotations

import pytest

from lab.bench.instructions import GROUP, main, run
from services.worker.config import WorkerConfig


def test_the_measured_half_refines_samples_and_the_warm_up_alone_none() -> None:
    assert run(nodes=2, ticks=2, measure=True) > 0
    assert run(nodes=2, ticks=2, measure=False) == 0


def test_small_spread_groups_refine_the_same_samples_as_large_ones() -> None:
    large = run(nodes=3, ticks=2, measure=True, interval_ms=500, spread=True)
    assert large > 0
    assert run(nodes=3, ticks=2, measure=True, group=5, interval_ms=500, spread=True) == large


def test_a_bad_size_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--ticks", "1"])
    assert e.value.code == 2
    assert "--ticks >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--group", "0"])
    assert e.value.code == 2
    assert "--group must be >= 1" in capsys.readouterr().err


def test_it_refines_in_the_worker_s_chunks() -> None:
    assert WorkerConfig().refine_chunk == GROUP
