"""Helpers for tests that run calls as async streams."""

from __future__ import annotations

import asyncio


async def drained(gen, prompt, kwargs: dict):
    """``gen.astream(prompt, **kwargs)`` read to its end, yielding to the event loop at each piece; its final state."""
    pieces = gen.astream(prompt, **kwargs)
    async for _ in pieces:
        await asyncio.sleep(0)
    return pieces.state
