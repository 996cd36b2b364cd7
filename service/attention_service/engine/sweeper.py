"""The idle-TTL sweeper of the engine's registries (KV caches, shared-memory regions)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("attention_service")


class Sweeper:
    """A daemon thread that calls ``expire`` every eighth of ``ttl`` (0.05-30 s) until
    ``stop``: what a TTL has made idle goes within 1/8 of the TTL after it."""

    def __init__(self, name: str, ttl: float, expire: Callable[[], object]) -> None:
        self._period = min(max(ttl / 8, 0.05), 30.0)
        self._expire = expire
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._expire()
            except Exception:  # never lose the sweeper
                log.exception("%s: expiry failed", self._thread.name)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
