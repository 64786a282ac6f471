"""What a detect process takes in at once: input in flight bounded in bytes (the consumer's
fetch per partition, the records it unpacks per poll, Faust's buffer)."""

from __future__ import annotations

from pathlib import Path

from services.detect.agent import FETCH_BYTES, POLL_RECORDS, STREAM_BUFFER, _faust_app
from services.detect.runner import DetectConfig
from services.settings import KafkaSettings

REFINED_RECORD_BYTES = 500_000  # one node's rows of a worker group, decoded (~1,600 samples)
WIRE_RATIO = 10  # 309 B/sample decoded, 31 B/sample as zstd stores it


def test_input_in_flight_is_bounded(tmp_path: Path) -> None:
    app = _faust_app(KafkaSettings(), DetectConfig(data_dir=tmp_path / "detect"))
    assert app.conf.consumer_max_fetch_size == FETCH_BYTES
    assert app.conf.broker_max_poll_records == POLL_RECORDS
    assert app.conf.stream_buffer_maxsize == STREAM_BUFFER
    # decoded records held between the consumer and the agent, whatever the node count:
    # Faust's buffer and one poll's records, plus one fetch per refined partition (8)
    decoded = (STREAM_BUFFER + POLL_RECORDS) * REFINED_RECORD_BYTES
    fetched = 8 * FETCH_BYTES * WIRE_RATIO
    assert decoded + fetched < 300 * 2**20
