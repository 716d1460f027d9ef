"""The Faust worker process: a thread's exception is logged once, whole (issue 25)."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

import pytest
from mode.utils.logging import FileLogProxy

from pipeline.processors.worker import BoundedShutdownWorker, log_thread_exception


def _die() -> None:
    try:
        raise ConnectionError("node 1 is not ready")
    except ConnectionError:
        raise asyncio.CancelledError  # noqa: B904 - chained, as in a stopping mode thread


def _run_dying_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, hook: object
) -> list[logging.LogRecord]:
    """Run a thread that dies while stderr is mode's proxy (as in a worker); its records."""
    monkeypatch.setattr(sys, "stderr", FileLogProxy(logging.getLogger("redirected")))
    monkeypatch.setattr(threading, "excepthook", hook)
    with caplog.at_level(logging.DEBUG):
        t = threading.Thread(target=_die, name="Thread-fetcher")
        t.start()
        t.join()
    return list(caplog.records)


def test_the_default_hook_splits_a_traceback_into_one_warning_per_write(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The failure: mode's FileLogProxy logs every write(); Python's hook writes tokens."""
    records = _run_dying_thread(monkeypatch, caplog, threading.__excepthook__)
    assert len(records) > 10 and {r.levelno for r in records} == {logging.WARNING}
    assert any(r.getMessage() == "^" for r in records) or len(records) > 20


def test_a_thread_exception_is_one_record_with_the_whole_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    records = _run_dying_thread(monkeypatch, caplog, log_thread_exception)
    (rec,) = records
    assert rec.levelno == logging.WARNING and "Thread-fetcher" in rec.getMessage()
    text = caplog.text
    assert "Traceback (most recent call last)" in text and "CancelledError" in text
    assert "node 1 is not ready" in text  # the chained cause too


def test_the_worker_installs_the_hook_with_its_logging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    worker = BoundedShutdownWorker.__new__(BoundedShutdownWorker)
    worker.spinner = None
    worker.on_setup_root_logger(logging.getLogger("root-under-test"), logging.INFO)
    assert threading.excepthook is log_thread_exception
