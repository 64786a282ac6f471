"""GroupEnds: a failed group end is kept for a caller that is not awaiting it, and settle waits
for the ends in flight."""

from __future__ import annotations

import asyncio

from services.worker.checkpoint import GroupEnds


def test_a_failed_end_is_kept_and_settle_waits_for_the_others() -> None:
    done: list[str] = []

    async def ok() -> None:
        await asyncio.sleep(0.05)
        done.append("ok")

    async def fails() -> None:
        raise OSError("outputs not acknowledged")

    async def main() -> GroupEnds:
        ends = GroupEnds(settle_s=5.0)
        ends.start(ok())
        ends.start(fails())
        await ends.settle()
        return ends

    ends = asyncio.run(main())
    assert done == ["ok"]
    assert isinstance(ends.error, OSError)
