"""A bound on how long a process takes to stop: after the first SIGTERM/SIGINT it exits within
``bound`` seconds whatever its main thread waits on, or at once on a second signal.

Why a thread and a wakeup fd: Python runs a signal handler only between bytecodes, and a
librdkafka call (``list_topics``, watermarks, a producer flush) holds the main thread for its
whole timeout. The interpreter's C handler writes each caught signal's number to the wakeup
fd at once, so the watchdog thread learns of the stop even then.

``liverl up`` stops its components with SIGTERM and expects each to be gone within 10 s, the
broker gone or not (issue 37); :data:`STOP_S` leaves room for process teardown. Exiting at a
component's bound is safe where it is used: the trainer's versions are renamed into place
whole, and the archive's progress is its Delta commits (records read but not committed are
read again at the next start).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable

STOP_S = 8.0

_STOPS = frozenset({signal.SIGTERM, signal.SIGINT})


def arm(bound: float, message: str, setting: str = "") -> Callable[[], None]:
    """Start the watchdog; returns the function that disarms it (and restores the previous
    wakeup fd). ``message`` is written to stderr before the exit, ``{why}`` in it replaced by
    what ended the wait (the bound, naming ``setting`` where one sets it). Call from the main
    thread, after installing Python handlers for SIGTERM and SIGINT (only signals with a
    Python handler reach the wakeup fd)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(
        target=_watch, args=(read_fd, bound, message, setting), name="stop-watchdog", daemon=True
    ).start()
    disarmed = False

    def disarm() -> None:
        nonlocal disarmed
        if disarmed:
            return
        disarmed = True
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the watchdog reads the end of the pipe and returns

    return disarm


def _watch(read_fd: int, bound: float, message: str, setting: str) -> None:
    try:
        while True:
            got = os.read(read_fd, 1)
            if not got:
                return  # disarmed
            if got[0] in _STOPS:  # the fd carries each caught signal's number
                break
        deadline = time.monotonic() + bound
        why = f"{bound:g}s" + (f" ({setting})" if setting else "")
        while (left := deadline - time.monotonic()) > 0:
            if select.select([read_fd], [], [], left)[0]:
                got = os.read(read_fd, 1)
                if not got:
                    return  # disarmed: the process stopped in time
                if got[0] in _STOPS:
                    why = "a second signal"
                    break
    finally:
        with contextlib.suppress(OSError):
            os.close(read_fd)
    os.write(2, (message.replace("{why}", why) + "\n").encode())
    os._exit(0)
