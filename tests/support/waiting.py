"""Waiting in tests: a condition polled until a deadline, never a bare sleep or an endless loop.

A regression then fails at once with what was awaited, instead of hanging until pytest's
timeout or passing by luck of timing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

T = TypeVar("T")
#: Seconds any wait in the tests may take by default: ample on a loaded two-core machine.
DEADLINE = 30.0


def wait_until(condition: Callable[[], T], what: str, timeout: float = DEADLINE, every: float = 0.01) -> T:
    """``condition()``'s first true value, polled every ``every`` seconds.

    Raises
    ------
    AssertionError
        Naming ``what`` when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(every)
    return value


async def until(condition: Callable[[], T], what: str, timeout: float = DEADLINE, every: float = 0.001) -> T:
    """:func:`wait_until` inside an event loop: the loop runs on between polls."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(every)
    return value
