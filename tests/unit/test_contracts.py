"""Contract tests: exported JSON Schema is current; models reject what they must."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schemas.export import OUT_DIR, rendered
from schemas.wire import Envelope, SourceId


def test_exported_json_schema_is_current() -> None:
    stale = [
        name
        for name, text in rendered().items()
        if not (OUT_DIR / name).exists() or (OUT_DIR / name).read_text() != text
    ]
    assert not stale, f"run `python -m schemas.export`; stale: {stale}"


@pytest.mark.parametrize("node", ["", "../x", "a/b", "x" * 200, "a\x00b", "-lead"])
def test_source_identity_rejects_unsafe_names(node: str) -> None:
    with pytest.raises(ValidationError):
        SourceId(node=node, exporter="e", instance="0", boot_id="b")


def test_envelope_rejects_unknown_fields_and_negative_seq() -> None:
    src = {"node": "n", "exporter": "e", "instance": "0", "boot_id": "b"}
    with pytest.raises(ValidationError):
        Envelope.model_validate({"source": src, "seq": -1, "sent_ns": 0})
    with pytest.raises(ValidationError):
        Envelope.model_validate({"source": src, "seq": 0, "sent_ns": 0, "extra": 1})
