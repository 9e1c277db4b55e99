"""The proxy hands freed heap pages back after seals: once per burst, on the event loop."""

from __future__ import annotations

import asyncio

import pytest

from harness_proxy import memory


@pytest.mark.skipif(memory._TRIM is None, reason="not glibc: nothing to trim")  # noqa: SLF001
def test_a_burst_of_seals_trims_once_then_again_later():
    async def scenario() -> list[int]:
        trim = memory.TrimAfterSeals(every_s=0.05)
        for _ in range(100):
            trim.sealed()
        counts = [trim.num_trims]
        await asyncio.sleep(0.15)
        counts.append(trim.num_trims)
        trim.sealed()
        await asyncio.sleep(0.15)
        counts.append(trim.num_trims)
        return counts

    assert asyncio.run(scenario()) == [0, 1, 2]
