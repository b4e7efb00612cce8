"""A store that counts the operations made through it (what a rank costs the server per step)."""
from __future__ import annotations

import threading


class CountingStore:
    """Wraps a torch.distributed store; `ops` counts every call, whatever the method."""

    def __init__(self, store) -> None:
        self._store, self.ops, self._lock = store, 0, threading.Lock()

    def __getattr__(self, name: str):
        target = getattr(self._store, name)
        if not callable(target):
            return target

        def counted(*args, **kwargs):
            with self._lock:
                self.ops += 1
            return target(*args, **kwargs)

        return counted
