"""One log format for every process of the service: the supervisor, the API workers, the data plane.

Each record is written to stderr in one of two forms (``--log-format``, ``KVBLEND_LOG_FORMAT``)::

    text  2025-12-06T10:04:01.123Z INFO dataplane[4242] kvblend.dataplane: kernels ready in 0.41 s
    json  {"time": "2025-12-06T10:04:01.123Z", "level": "INFO", "process": "dataplane",
           "pid": 4242, "logger": "kvblend.dataplane", "message": "kernels ready in 0.41 s"}

``process`` is the service's part that wrote it (``serve``, ``api`` or ``dataplane``); times are
UTC. A JSON record is one object on one line: a traceback is its ``exception`` field, an access
log record has ``client``, ``method``, ``path``, ``status`` and ``request_id`` (the request's
``X-Request-ID``, which ``api.requestid`` sets in ``REQUEST_ID``) besides. In text, a traceback
follows its record's line, and an access line ends with ``request_id=<id>``.

This module owns the format and how a process takes it: ``configure`` at a process's entry point
(the supervisor, the data plane), ``uvicorn_config`` for uvicorn and its workers. It does not own
what is logged. The supervisor relays its children's output and wraps any line that is not a
record of theirs (a stray write to stdout, a crash before logging was configured) into a record of
that child (``api.child``), so that a JSON stream holds nothing else. Standard library only.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from contextvars import ContextVar
from datetime import datetime, timezone
from enum import StrEnum
from types import TracebackType
from typing import Any, Literal

#: the service's log levels (uvicorn's names): the values ``--log-level`` takes
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
#: uvicorn's level below DEBUG
TRACE = 5
#: fields a record of ``api.child``'s relay carries: the child's name and pid
PROCESS, PID = "kvblend_process", "kvblend_pid"
#: the id of the HTTP request being served in this context (``api.requestid``), else None
REQUEST_ID: ContextVar[str | None] = ContextVar("kvblend_request_id", default=None)


class LogFormat(StrEnum):
    """The form of every record of the service (see the module docstring)."""

    TEXT = "text"
    JSON = "json"


def python_level(level: str) -> int:
    """The ``logging`` level of a service log level (``trace`` is below ``DEBUG``)."""
    return TRACE if level.lower() == "trace" else logging.getLevelNamesMapping()[level.upper()]


class Formatter(logging.Formatter):
    """Formats a record as text or as one JSON object (see the module docstring).

    Args:
        form: ``text`` or ``json``.
        process: the service's part that logs (``serve``, ``api``, ``dataplane``).
    """

    def __init__(self, form: str = LogFormat.TEXT, process: str = "kvblend") -> None:
        super().__init__()
        self.form, self.process = LogFormat(form), process

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        """The record's fields, in the order a JSON record shows them."""
        when = datetime.fromtimestamp(record.created, timezone.utc)
        out: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "process": getattr(record, PROCESS, self.process),
            "pid": getattr(record, PID, record.process),
            # uvicorn logs everything but its access lines as "uvicorn.error"
            "logger": "uvicorn" if record.name == "uvicorn.error" else record.name,
            "message": record.getMessage(),
        }
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and \
                len(record.args) == 5:
            client, method, path, _, status = record.args
            out.update(client=client, method=method, path=path, status=status)
            rid = REQUEST_ID.get()  # uvicorn logs the line inside the request's own send
            if rid is not None:
                out["request_id"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["exception"] = self.formatStack(record.stack_info)
        return out

    def format(self, record: logging.LogRecord) -> str:
        f = self.fields(record)
        if self.form is LogFormat.JSON:
            return json.dumps(f, ensure_ascii=False, default=str)
        line = f"{f['time']} {f['level']} {f['process']}[{f['pid']}] {f['logger']}: {f['message']}"
        if "request_id" in f:
            line += f" request_id={f['request_id']}"
        return f"{line}\n{f['exception']}" if "exception" in f else line


def configure(level: str, form: str, process: str) -> None:
    """Send every record of this process to stderr in ``form``, from ``level`` up; Python's
    warnings and uncaught exceptions (any thread's) become records too."""
    logging.addLevelName(TRACE, "TRACE")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Formatter(form, process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(python_level(level))
    take_uncaught()


def take_uncaught() -> None:
    """Python's warnings and uncaught exceptions (any thread's) become records. ``configure``
    does it; a uvicorn worker process, whose logging uvicorn configured, calls it itself."""
    logging.captureWarnings(True)
    sys.excepthook = _uncaught
    threading.excepthook = lambda a: _uncaught(a.exc_type, a.exc_value, a.exc_traceback,
                                               a.thread.name if a.thread else None)


def _uncaught(kind: type[BaseException], exc: BaseException | None,
              tb: TracebackType | None, thread: str | None = None) -> None:
    if issubclass(kind, (KeyboardInterrupt, SystemExit)):
        sys.__excepthook__(kind, exc or kind(), tb)
        return
    where = f" in thread {thread}" if thread else ""
    logging.getLogger("kvblend").critical("uncaught %s%s: %s", kind.__name__, where, exc,
                                          exc_info=(kind, exc or kind(), tb))


def uvicorn_config(level: str, form: str) -> dict[str, Any]:
    """uvicorn's ``log_config``: every logger, uvicorn's access log included, through one
    ``Formatter`` of the ``api`` process to stderr. (Whether access lines are logged at all is
    uvicorn's ``access_log``.)"""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"kvblend": {"()": f"{__name__}.Formatter", "form": str(form),
                                   "process": "api"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "kvblend",
                                "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["stderr"], "level": python_level(level)},
        "loggers": {name: {"handlers": [], "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }


def message_of(line: str, form: str) -> str | None:
    """The message of ``line`` when it is a whole record in ``form`` (with the last line of its
    traceback, if any), else None. Text records are not told apart (a traceback's lines follow
    its record), so every text line is its own message."""
    if LogFormat(form) is LogFormat.TEXT:
        return line
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or "message" not in record or "level" not in record:
        return None
    message = str(record["message"])
    exception = str(record.get("exception", "")).strip().splitlines()
    return f"{message}: {exception[-1]}" if exception and exception[-1] not in message \
        else message


__all__ = ["LogFormat", "LogLevel", "Formatter", "configure", "uvicorn_config", "message_of",
           "python_level", "take_uncaught", "PROCESS", "PID", "REQUEST_ID"]
