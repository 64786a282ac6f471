"""A clock block is range-checked in the decoder (``value_out_of_range`` beyond what a clock
reports), and refining never leaves int64 for any block the decoder accepts, whatever the
send time: the rows' clock columns saturate instead (an error bound at ERROR_CAP_NS)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.refine.aligned import ERROR_CAP_NS, align_records
from pipelines.refine.batch import RawBatch, RefineState, refine_group
from schemas.codec import ARROW, CLOCK_SPAN_NS, JSON, decode, encode
from schemas.errors import RejectedInput
from schemas.reasons import Reason
from schemas.wire import EVENTS_SCHEMA, Batch, ClockBlock, Envelope, PayloadKind, SourceId
from tests.unit.test_refine import CAT, NOW, TOPO, S, batch, ctr

M = 2**63 - 1


def _decoded(b: Batch, content_type: str = ARROW) -> Batch:
    ct, body = encode(b.envelope, b.table, content_type)
    return decode(body, ct)


@pytest.mark.parametrize(
    "clock,where",
    [
        (ClockBlock(source="chrony", offset_ns=M, error_bound_ns=M), "clock.offset_ns"),
        (ClockBlock(source="chrony", offset_ns=-CLOCK_SPAN_NS - 1), "clock.offset_ns"),
        (ClockBlock(source="chrony", error_bound_ns=CLOCK_SPAN_NS + 1), "clock.error_bound_ns"),
        (ClockBlock(source="ptp4l", exchanges=[(NOW, M, NOW, 0)]), "exchanges[0].append_ms"),
        (
            ClockBlock(source="ptp4l", exchanges=[(NOW, 1, NOW, 0), (-1, 1, NOW, 0)]),
            "exchanges[1].send_ns",
        ),
        (ClockBlock(source="ptp4l", exchanges=[(NOW, 1, M, 0)]), "exchanges[0].ack_ns"),
        (ClockBlock(source="ptp4l", exchanges=[(NOW, 1, NOW, 2**31)]), "exchanges[0].partition"),
    ],
)
@pytest.mark.parametrize("content_type", [ARROW, JSON])
def test_a_clock_block_no_clock_reports_is_value_out_of_range(
    clock: ClockBlock, where: str, content_type: str
) -> None:
    with pytest.raises(RejectedInput) as e:
        _decoded(batch([ctr(100)], 1, sent=1, clock=clock), content_type)
    assert e.value.reason is Reason.VALUE_OUT_OF_RANGE
    assert where in e.value.detail


def test_a_clock_at_the_ends_of_its_ranges_is_accepted() -> None:
    for clock in (
        ClockBlock(source="chrony", offset_ns=CLOCK_SPAN_NS, error_bound_ns=CLOCK_SPAN_NS),
        ClockBlock(source="chrony", offset_ns=-CLOCK_SPAN_NS, error_bound_ns=0),
        ClockBlock(source="ptp4l", exchanges=[(2**62, 2**62 // 10**6, 2**62, 2**31 - 1)]),
    ):
        assert _decoded(batch([ctr(100)], 1, clock=clock)).envelope.clock == clock


_SPAN = st.integers(-CLOCK_SPAN_NS, CLOCK_SPAN_NS)
_EXCHANGE = st.tuples(
    st.integers(0, 2**62),
    st.integers(0, 2**62 // 10**6),
    st.integers(0, 2**62),
    st.integers(0, 2**31 - 1),
)
_CLOCKS = st.one_of(
    st.none(),
    st.builds(
        ClockBlock,
        source=st.just("chrony"),
        offset_ns=st.one_of(st.none(), _SPAN, st.sampled_from([-CLOCK_SPAN_NS, CLOCK_SPAN_NS])),
        error_bound_ns=st.one_of(st.none(), st.integers(0, CLOCK_SPAN_NS)),
        exchanges=st.one_of(st.none(), st.lists(_EXCHANGE, min_size=1, max_size=8)),
    ),
)
_SENT = st.one_of(st.integers(0, M), st.sampled_from([0, 1, NOW, M]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_SENT, _CLOCKS), min_size=1, max_size=4))
def test_refining_stays_in_int64_for_every_clock_block_the_decoder_accepts(
    sends: list[tuple[int, ClockBlock | None]],
) -> None:
    """One source's batches with any accepted clock blocks and send times: refined, one by one
    and as one group, without raising; every error bound in [0, ERROR_CAP_NS + growth]."""
    items = []
    for i, (sent, clock) in enumerate(sends):
        b = _decoded(batch([ctr(100 + i, NOW + i * S)], i + 1, sent=sent, clock=clock))
        items.append(RawBatch(b, (0, i), NOW + i * S + 2_000_000))
    for group in ([items], [[x] for x in items]):
        state = RefineState()
        for g in group:
            for r in refine_group(g, state, CAT, TOPO, NOW + 10 * S):
                rows = r.refined
                assert rows.num_rows == 1
                err = rows.column("clock_error_ns")[0].as_py()
                assert 0 <= err <= ERROR_CAP_NS + 2**60


@settings(max_examples=100, deadline=None)
@given(_SENT, _CLOCKS)
def test_aligning_events_stays_in_int64_for_every_clock_block_the_decoder_accepts(
    sent: int, clock: ClockBlock | None
) -> None:
    from pipelines.refine.clock import ClockEstimator, ClockSettings

    src = SourceId(node="n1", exporter="ev", instance="0", boot_id="b0")
    env = Envelope(source=src, seq=1, sent_ns=sent, kind=PayloadKind.EVENTS, clock=clock)
    cols = {"ts_ns": [NOW], "event": ["xid"], "device": ["gpu0"]}
    table = pa.table({f.name: cols.get(f.name, [None]) for f in EVENTS_SCHEMA}, EVENTS_SCHEMA)
    b = _decoded(Batch(envelope=env, table=table))
    est = ClockEstimator(ClockSettings()).observe(sent, NOW + 2_000_000, b.envelope.clock)
    t = align_records(b, est, (0, 1), "telemetry.raw")
    assert 0 <= t.column("clock_error_ns")[0].as_py() <= ERROR_CAP_NS + 2**60
