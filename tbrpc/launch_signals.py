"""The signals that stop ``tbrpc launch`` (SIGINT, SIGTERM), taken over from its first line on.

A module of its own, importing nothing heavy: the CLI installs the handler
before it imports tbrpc/launch.py and with it llama-cpp-python, which is most
of a launch's first half second. A signal that comes then is remembered and
launch answers it as soon as it runs (``arm``): exit 130 with its own message,
not click's ``Aborted!``. Nothing has started by then, so nothing is lost by
answering it a moment later.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class Interrupted(Exception):
    """SIGINT or SIGTERM reached launch (the message is the signal's name)."""


class LaunchSignals:
    """SIGINT/SIGTERM: remembered until ``arm()``; then they interrupt Python code, or, while
    ``loading``, only set ``received``: a model load is aborted at its next progress report."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.loading = False
        self._armed = False
        self._previous: dict[int, Any] = {}

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if self._armed and not self.loading:
            raise Interrupted(signal.Signals(signum).name)

    def arm(self) -> None:
        """From now on a signal interrupts; one that came before interrupts now."""
        self._armed = True
        if self.received is not None:
            raise Interrupted(signal.Signals(self.received).name)

    def __enter__(self) -> LaunchSignals:
        if threading.current_thread() is threading.main_thread():   # signals reach only the main thread
            self._previous = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
