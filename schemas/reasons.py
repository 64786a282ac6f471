"""Reason codes: why a record went to the dead-letter topic or a value became NULL.

The list is the documented contract; codes are never renamed, only added.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a whole Kafka record, or a single sample of it, was quarantined."""

    # whole record
    UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"  # header missing or unknown
    UNDECODABLE = "undecodable"  # bytes are not valid JSON / Arrow IPC
    OVERSIZED = "oversized"  # message, decompressed size or sample count over a limit
    BAD_ENVELOPE = "bad_envelope"  # envelope missing fields or of the wrong type
    UNSUPPORTED_SCHEMA_VERSION = "unsupported_schema_version"
    SCHEMA_MISMATCH = "schema_mismatch"  # sample columns missing or of the wrong type
    # an envelope integer past int64 (seq, sent_ns), a clock block value no clock reports
    VALUE_OUT_OF_RANGE = "value_out_of_range"
    # single sample
    UNKNOWN_METRIC = "unknown_metric"  # metric not in the catalog
    BAD_DEVICE = "bad_device"  # empty or over-long device string
    NON_FINITE = "non_finite"  # NaN or infinite value
    OUT_OF_RANGE = "out_of_range"  # outside the catalog's valid range
    TIMESTAMP_OUT_OF_WINDOW = "timestamp_out_of_window"  # ts_ns not within a sane window
    WRONG_KIND = "wrong_kind"  # e.g. a counter without a raw value, or a negative counter
    # whole record, found after it decoded
    OUTPUT_TOO_LARGE = "output_too_large"  # its refined rows exceed an output message's limit
    REFINE_FAILED = "refine_failed"  # refining it raised (the exception's class in the detail)


class NullReason(StrEnum):
    """Why a refined value is NULL although its sample was kept."""

    SENTINEL = "sentinel"  # a documented "no data" marker (DCGM blank, "N/A (no PMA)")
    FIRST_SAMPLE = "first_sample"  # a counter's first reading: no delta yet
    RESET = "reset"  # counter reset assumed (boot_id change or decrease): delta unknown
    SATURATED = "saturated"  # a saturating counter stuck at its maximum


RECORD_REASONS: frozenset[Reason] = frozenset(
    {
        Reason.UNSUPPORTED_CONTENT_TYPE,
        Reason.UNDECODABLE,
        Reason.OVERSIZED,
        Reason.BAD_ENVELOPE,
        Reason.UNSUPPORTED_SCHEMA_VERSION,
        Reason.SCHEMA_MISMATCH,
        Reason.VALUE_OUT_OF_RANGE,
    }
)

# Whole-record reasons the refiner gives a record that decoded: no malformed body makes them,
# they follow from what refining or publishing that one record did.
REFINER_REASONS: frozenset[Reason] = frozenset({Reason.OUTPUT_TOO_LARGE, Reason.REFINE_FAILED})
