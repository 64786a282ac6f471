"""The decode step, the first of the refining chain: raw records in, decoded batches out.

:class:`DecodeStep` takes a group of raw Kafka records (:meth:`DecodeStep.submit`) and
decodes each: a native record by its content type (either wire encoding,
:func:`schemas.codec.decode`), an ingest topic's records of the group together
(:func:`services.worker.refiner_ingest.decode_ingest`, each joined set handed on whole at its
first record). A record it cannot decode goes to the outputs step rejected
(:class:`services.worker.outcomes.OutputsStep`: dead-lettered with its reason); one its
decoder raised on (a decoder's bug) is rejected as ``undecodable``: it fails only itself.

A decoded record whose (source, seq) was already processed *at the same Kafka position* is a
replay after a crash: its outputs were published before the state that remembers it was
checkpointed (the worker flushes outputs first), so it goes to the outputs step as a replay
and nothing is published twice. Every other record goes on to the refine step
(:class:`services.worker.refining.RefineStep`), in order.
"""

from __future__ import annotations

from schemas.codec import content_type_of, decode
from schemas.errors import RejectedInput
from schemas.ingest import IngestDecoder, Position
from schemas.reasons import Reason
from schemas.wire import Batch
from services.kafka.internals import refused_detail
from services.worker.guard import recoverable
from services.worker.outcomes import OutputsStep
from services.worker.refiner_ingest import Decoded, decode_ingest
from services.worker.refiner_outputs import Group, Outcome, RawRecord, detail_of
from services.worker.refiner_state import RefinerState
from services.worker.refining import RefineStep


class DecodeStep:
    """Decodes groups of raw records (see the module). ``ingest``: the decoder of the topics
    of foreign formats (:mod:`schemas.ingest`); None: native records only. Not thread-safe."""

    def __init__(
        self,
        ingest: IngestDecoder | None,
        state: RefinerState,
        refine: RefineStep,
        outputs: OutputsStep,
    ) -> None:
        self.ingest = ingest
        self.state = state
        self.refine = refine
        self.outputs = outputs

    def submit(self, recs: list[RawRecord], now_ns: int) -> list[Outcome]:
        """Hand each of ``recs`` on, in order, and the group's end to the refine step, which
        hands back one outcome per record, in order. Raises only on a bug."""
        ingest = decode_ingest(self.ingest, recs)
        sets = {i: d.joined for i, d in ingest.items() if isinstance(d, Decoded)}
        group = Group(now_ns, [None] * len(recs), sets)
        for i, rec in enumerate(recs):
            got = ingest.get(i)
            if isinstance(got, Decoded):  # a joined set waits whole at its first record
                for m in got.members if got.first == i else []:
                    member = ingest[m]
                    assert isinstance(member, Decoded)
                    if not self._replayed(group, m, recs[m], member.batch):
                        self.refine.hold(group, m, recs[m], member.batch)
                continue
            ct = content_type_of(rec.headers)
            try:
                if isinstance(got, RejectedInput):
                    raise got
                batch = self.decode(rec, ct)
            except RejectedInput as e:
                self.outputs.reject(group, i, rec, ct, e)
                continue
            except Exception as e:  # a decoder's bug: this record's failure, no one else's
                if not recoverable(e):
                    raise
                bad = RejectedInput(Reason.UNDECODABLE, detail_of(e))
                self.outputs.reject(group, i, rec, ct, bad)
                continue
            if not self._replayed(group, i, rec, batch):
                self.refine.submit(group, i, rec, batch)
        return self.refine.join(group)

    def decode(self, rec: RawRecord, ct: str | None) -> Batch:
        """The record's batch: by its topic's declared format when it is an ingest topic.
        A record whose compressed batch would inflate past the consumer's bound was never
        inflated (:mod:`services.kafka.internals`): rejected as oversized. Raises
        :class:`~schemas.errors.RejectedInput`."""
        refused = refused_detail(rec.headers)
        if refused is not None:
            raise RejectedInput(Reason.OVERSIZED, refused)
        if self.ingest is None:
            return decode(rec.value, ct)
        at = Position(rec.partition, rec.offset, rec.append_ms * 1_000_000, rec.key)
        return self.ingest.decode(rec.topic, rec.value, ct, at)

    def _replayed(self, group: Group, i: int, rec: RawRecord, batch: Batch) -> bool:
        """Whether record ``i`` is a replay (its (source, seq) was processed at this very
        Kafka position), handed on to the outputs step if so; loads its source's state."""
        self.state.load(batch)
        window = self.state.refine.seqs.get(batch.envelope.source.key())
        if window is None or window.positions.get(batch.envelope.seq) != (
            rec.partition,
            rec.offset,
        ):
            return False
        self.outputs.replay(group, i, batch)
        return True
