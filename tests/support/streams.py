"""Helpers for tests that run calls as async streams: one way to read a stream to its end."""

from __future__ import annotations

import asyncio


async def read_to_end(stream):
    """An async stream read to its end, yielding to the event loop at each piece; its final state."""
    async for _ in stream:
        await asyncio.sleep(0)
    return stream.state


async def drained(gen, prompt, kwargs: dict):
    """``gen.astream(prompt, **kwargs)`` read to its end (:func:`read_to_end`); its final state."""
    return await read_to_end(gen.astream(prompt, **kwargs))
