"""Ctrl-C while a coroutine runs on another thread's event loop (the engine's loop thread):
the coroutine is cancelled there and its cleanup (a python tool call kills its sandbox, reaps
the process and removes its temp dir) finishes before the KeyboardInterrupt goes on, so the
loop is never closed under pending tasks or live subprocess transports ("Task was destroyed but
it is pending", "Event loop is closed" at exit).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

CLEANUP_TIMEOUT_S = 15.0


def run_cancel_on_interrupt(run: Callable[[Awaitable[T]], T], coro: Awaitable[T],
                            timeout_s: float = CLEANUP_TIMEOUT_S) -> T:
    """`run(coro)` (a blocking call that runs `coro` on some event loop); on KeyboardInterrupt
    (or any BaseException of the waiting thread) cancel the coroutine's task on its loop and wait
    up to `timeout_s` for it to end before re-raising.

    Args:
        run: blocks until the coroutine it is given has finished, returns its result.
        coro: the coroutine.
        timeout_s: longest wait for the cancelled task's cleanup.
    Returns:
        the coroutine's result.
    """
    where: dict[str, Any] = {}

    async def tracked() -> T:
        where["task"], where["loop"] = asyncio.current_task(), asyncio.get_running_loop()
        return await coro

    try:
        return run(tracked())
    except BaseException:
        task, loop = where.get("task"), where.get("loop")
        if task is not None and loop is not None and not task.done() and not loop.is_closed() \
                and loop is not _running_loop():
            done = threading.Event()

            def cancel() -> None:
                task.add_done_callback(lambda _: done.set())
                task.cancel()

            try:
                loop.call_soon_threadsafe(cancel)
                done.wait(timeout_s)
            except RuntimeError:  # the loop closed meanwhile
                pass
        raise


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
