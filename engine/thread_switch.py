"""A per-thread on/off switch held for the duration of a ``with`` block.

The engine's CPU fast paths (``engine.skinny_linear``, ``engine.fused_linear``) are installed on
the model in place but take effect only while the ModelRunner holds their switch around its own
forward, on its own thread: a Hugging Face reference sharing the model (or a deep copy of it)
stays on the plain path.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ThreadSwitch:
    def __init__(self) -> None:
        self._state = threading.local()

    @property
    def on(self) -> bool:
        return getattr(self._state, "on", False)

    @contextlib.contextmanager
    def __call__(self, on: bool = True) -> Iterator[None]:
        """On (or off) within the block, on this thread; the previous state after it."""
        previous = self.on
        self._state.on = on
        try:
            yield
        finally:
            self._state.on = previous
