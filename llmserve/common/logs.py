"""How every llmserve process logs: the HTTP process (or the offline CLI), the engine core and the
model workers write one line per record to stderr, with a UTC timestamp and the process's role,
as text or as one JSON object per line (``--log-format json``, for log collectors).

The command sets it up once (``configure_logging``) and leaves its choice in the environment
under the flags' own variables (``LLMSERVE_LOG_LEVEL``, ``LLMSERVE_LOG_FORMAT``), which the
engine core and the workers, started as fresh interpreters, read (``configure_child_logging``).

Status lines (what is served where, the model loaded, the periodic throughput line) go through
``STATUS_LOGGER`` at INFO, which shows them at the default level (warning) too: they are the
server's own report, as its start-up lines always were.
"""

from __future__ import annotations

import logging
import os
import sys
import time

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
STATUS_LOGGER = "llmserve.status"
_LEVEL_VAR = "LLMSERVE_LOG_LEVEL"
_FORMAT_VAR = "LLMSERVE_LOG_FORMAT"


class _Role(logging.Filter):
    """Names the process in every record (``role``): http, core, worker, cli."""

    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes (a test's capture, say), not as it
    was when logging was set up."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _TextFormatter(logging.Formatter):
    converter = time.gmtime      # UTC, whatever the machine's zone: lines of several hosts compare
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(role)s[%(process)d] %(name)s: %(message)s")


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.core import RESERVED_ATTRS
    from pythonjsonlogger.json import JsonFormatter

    # `extra` fields of a record (the periodic line's numbers) become keys of its object;
    # uvicorn's `color_message` (the message with terminal colour codes) does not.
    return JsonFormatter("%(levelname)s %(name)s %(role)s %(process)d %(message)s", timestamp=True,
                         rename_fields={"levelname": "level", "name": "logger", "process": "pid"},
                         reserved_attrs=[*RESERVED_ATTRS, "color_message"])


def configure_logging(level: str = "warning", log_format: str = "text", role: str = "cli") -> None:
    """Send every logger's records to stderr in ``log_format``; the processes this one starts
    log the same way."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = _StderrHandler()
    handler.setFormatter(_json_formatter() if log_format == "json" else _TextFormatter())
    handler.addFilter(_Role(role))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:   # set up again: replace ours only
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    status_level = logging.INFO if root.level <= logging.WARNING else root.level
    logging.getLogger(STATUS_LOGGER).setLevel(status_level)
    logging.captureWarnings(True)     # warnings.warn() as records too, so a JSON log stays JSON
    os.environ[_LEVEL_VAR], os.environ[_FORMAT_VAR] = level, log_format


def report_error(message: str) -> None:
    """The one line a command ends with when it fails: ``llmserve: error: ...`` on a text log
    (what a person reads, without a timestamp), a record of its own on a JSON one (so that every
    line still parses)."""
    if os.environ.get(_FORMAT_VAR) == "json" and any(isinstance(h, _StderrHandler) for h in logging.getLogger().handlers):
        logging.getLogger("llmserve").error(message)
    else:
        print(f"llmserve: error: {message}", file=sys.stderr, flush=True)


def adopt_library_logging() -> None:
    """transformers writes its records through a handler of its own (plain text) and keeps them
    from reaching ours: once it is imported, send them through ours instead, so that a JSON log
    stays JSON. Called where the process has imported it (it is not imported here: the HTTP
    process may never need it)."""
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is not None:
        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()


def configure_child_logging(role: str, level: str | None = None) -> None:
    """In the engine core or a worker: log as the process that started it chose."""
    configure_logging(level or os.environ.get(_LEVEL_VAR, "warning"), os.environ.get(_FORMAT_VAR, "text"), role)


def status_logger() -> logging.Logger:
    return logging.getLogger(STATUS_LOGGER)
