"""The pause gate of asynchronous rollouts: generation requests run together, a weight update
runs alone (it waits for the requests in flight and holds new ones back: pause, update,
continue), and an engine wrapper whose `agenerate` holds the gate (agent episodes)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Any


class UpdateGate:
    """Generation requests (many at once) versus weight updates (one, exclusive).

    An update waiting for the gate blocks new requests (pause), waits for those in flight,
    runs, then lets requests through again (continue)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._updating = False

    @contextmanager
    def generating(self):
        """Hold while a generation request is in flight."""
        with self._cond:
            while self._updating:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def updating(self):
        """Hold while new weights are loaded into the engine."""
        with self._cond:
            while self._updating:
                self._cond.wait()
            self._updating = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()


class GatedEngine:
    """An engine whose `agenerate` holds the producer's gate (agent mode); everything else is
    the wrapped engine's."""

    def __init__(self, engine: Any, gate: UpdateGate) -> None:
        self._engine, self._gate = engine, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def __class__(self):  # isinstance checks see the wrapped engine (e.g. batching choices)
        return type(self._engine)

    async def agenerate(self, requests):
        cm = self._gate.generating()
        await asyncio.to_thread(cm.__enter__)
        try:
            return await self._engine.agenerate(requests)
        finally:
            cm.__exit__(None, None, None)
