"""Per-message faults: duplicates from a second producer session, late (held back) batches,
malformed records of every whole-record reason and bad samples of every per-sample reason.

Each kind fires with its ``rate`` per raw batch and at least once per planning window (on a
tick drawn per window), so even a short run carries every declared fault.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

from lab.simulate import malformed
from lab.simulate.clocks import NodeClocks
from lab.simulate.faults import FaultKind, FaultSpec, S
from lab.simulate.messages import Message, SendKind, Stream
from schemas.reasons import RECORD_REASONS, Reason
from schemas.wire import Envelope

# (node index, source-clock sent_ns, offset) -> envelope of the node's "custom" exporter
EnvelopeFactory = Callable[[int, int, int], Envelope]


def row_offsets(offs: np.ndarray) -> pa.Array:
    """Each row's clock offset as a :class:`Message`'s ``offset_ns``: an int64 Arrow array,
    which the truth subtracts from ``ts_ns`` row by row as it would one int (rows stamped
    while a clock drifts, slews or steps do not share one offset)."""
    return pa.array(np.asarray(offs, np.int64))


def inject_faults(
    spec: FaultSpec,
    forced: set[str],
    reasons: list[Reason],
    out: list[Message],
    r: np.random.Generator,
    interval_ns: int,
    node_names: list[str],
    clocks: NodeClocks,
    custom_envelope: EnvelopeFactory,
) -> list[Message]:
    """Apply the per-message faults to one tick's messages; returns them plus the extra ones.
    ``forced`` names the kinds this tick must carry at least once."""
    raw = [m for m in out if m.stream is Stream.RAW]
    extra: list[Message] = []
    if spec.on(FaultKind.MALFORMED) and raw:
        rec = [x for x in reasons if x in RECORD_REASONS]
        smp = [x for x in reasons if x not in RECORD_REASONS]
        if "malformed_sample" in forced and smp:
            m = next(
                (x for x in raw if x.envelope is not None and x.envelope.source.exporter == "gpu"),
                raw[0],
            )
            assert m.table is not None
            bad = malformed.bad_rows(smp, int(m.table.column("ts_ns")[0].as_py()))
            good = np.broadcast_to(np.asarray(m.offset_ns), (m.table.num_rows,))
            m.offset_ns = row_offsets(np.concatenate([good, np.repeat(good[:1], len(bad))]))
            m.table = pa.concat_tables([m.table, bad])
            m.samples, m.bad = m.table.num_rows, smp
        if "malformed_record" in forced:
            base = raw[int(r.integers(len(raw)))]
            i = node_names.index(base.key.decode())
            off = clocks.offset(i, base.sent_true_ns)
            for reason in rec:
                env = custom_envelope(i, base.sent_true_ns + off, off)
                ct, body, n = malformed.record(reason, env, base.sent_true_ns + off)
                extra.append(
                    Message(
                        Stream.RAW,
                        SendKind.MALFORMED,
                        base.key,
                        base.due_ns + 1,
                        base.sent_true_ns,
                        env,
                        None,
                        ct,
                        body,
                        reason,
                        n,
                        off,
                    )
                )
    if spec.on(FaultKind.DUP) and raw:
        p = spec.fparam(FaultKind.DUP, "rate", 0.003)
        pick = [int(x) for x in np.flatnonzero(r.random(len(raw)) < p)]
        if "dup" in forced and not pick:
            pick = [int(r.integers(len(raw)))]
        for j in pick:
            m = raw[j]
            extra.append(
                Message(
                    Stream.RAW,
                    SendKind.DUPLICATE,
                    m.key,
                    m.due_ns + int(r.uniform(0.05, 1.5) * interval_ns),
                    m.sent_true_ns,
                    m.envelope,
                    m.table,
                    samples=m.samples,
                    offset_ns=m.offset_ns,
                    bad=m.bad,
                    original=m,
                )
            )
    if spec.on(FaultKind.LATE) and raw:
        p = spec.fparam(FaultKind.LATE, "rate", 0.002)
        hold = spec.fparam(FaultKind.LATE, "delay", 3.0) * S
        pick = [int(x) for x in np.flatnonzero(r.random(len(raw)) < p)]
        if "late" in forced and not pick:
            pick = [int(r.integers(len(raw)))]
        for j in pick:
            m = raw[j]
            if m.kind is not SendKind.BATCH or any(x.envelope is m.envelope for x in extra):
                continue  # a duplicated batch stays on time so its copies are comparable
            assert m.envelope is not None
            i = node_names.index(m.key.decode())
            release = clocks.resumed(i, m.sent_true_ns + int(hold * r.uniform(0.8, 1.2)))
            m.envelope = m.envelope.model_copy(
                update={"sent_ns": release + clocks.offset(i, release)}
            )
            m.kind, m.sent_true_ns, m.due_ns = (
                SendKind.LATE,
                release,
                release + (m.due_ns - m.sent_true_ns),
            )
    return out + extra
