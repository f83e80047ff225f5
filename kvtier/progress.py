"""A progress line for slow steps of the command lines (loading a model, exporting it)."""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

_SPINNER = "|/-\\"


class Stage:
    """Prints ``"<label>… done in 2.1 s"`` to a stream around a slow step.

    On a terminal a spinner turns while the step runs (a daemon thread that
    stops when the step ends); elsewhere the label is printed once.
    """

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def __enter__(self) -> Stage:
        self._t0 = time.monotonic()
        if not self.enabled:
            return self
        self.stream.write(f"{self.label}… ")
        self.stream.flush()
        if self.stream.isatty():
            self._thread = threading.Thread(target=self._spin, name="kvtier-spinner", daemon=True)
            self._thread.start()
        return self

    def _spin(self) -> None:
        i = 0
        while not self._stop.wait(0.1):
            self.stream.write(_SPINNER[i % len(_SPINNER)] + "\b")
            self.stream.flush()
            i += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self.enabled:
            elapsed = time.monotonic() - self._t0
            self.stream.write(f"done in {elapsed:.1f} s\n" if exc is None else "failed\n")
            self.stream.flush()
