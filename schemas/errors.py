"""The exception tree of Refinery, drawn once.

    RefineryError                  root; anything Refinery raises on purpose
    ├── ConfigError                a setting, spec or rule file is wrong (CLI: one line, exit 2)
    ├── RejectedInput              input that must go to the dead-letter topic
    │                              (carries a ``reason`` from :class:`schemas.reasons.Reason`)
    ├── TransientError             retry with backoff, commit nothing meanwhile
    └── BrokerError                the local broker tooling cannot do what was asked

Anything else escaping the data path is a bug: the process exits non-zero and its supervisor
restarts it.
"""

from __future__ import annotations

from schemas.reasons import Reason


class RefineryError(Exception):
    """Root of every error Refinery raises on purpose."""


class ConfigError(RefineryError):
    """A setting, spec or rule file is wrong; the message is one line a user can act on."""


class RejectedInput(RefineryError):
    """Input that goes to the dead-letter topic with ``reason``; the rest of the batch flows."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class TransientError(RefineryError):
    """A failure worth retrying (broker unreachable, disk briefly full); commit nothing."""


class BrokerError(RefineryError):
    """The local broker tooling cannot do what was asked (missing java, port in use, ...)."""
