"""How every process logs: timestamps, text or JSON, status lines at the default level."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys

import pytest

from llmserve.common.logs import configure_logging, status_logger


@pytest.fixture
def restore_logging(monkeypatch):
    """configure_logging changes the root logger and the environment: put both back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    for var in ("LLMSERVE_LOG_LEVEL", "LLMSERVE_LOG_FORMAT"):
        monkeypatch.setenv(var, "")
    yield
    root.handlers[:], root.level = handlers, level
    logging.getLogger("llmserve.status").setLevel(logging.NOTSET)
    logging.captureWarnings(False)


def test_text_lines_have_a_utc_timestamp_and_the_process(restore_logging, capsys):
    configure_logging("warning", "json", role="core")
    configure_logging("warning", "text", role="core")
    logging.getLogger("llmserve.x").warning("something %s", "odd")
    logging.getLogger("llmserve.x").info("not at warning")
    [line] = capsys.readouterr().err.splitlines()      # once, though set up twice
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING core\[\d+\] llmserve\.x: something odd", line), line


def test_json_lines_parse_and_carry_extra_fields(restore_logging, capsys):
    configure_logging("warning", "json", role="http")
    status_logger().info("busy", extra={"num_running": 3})
    try:
        raise ValueError("bad")
    except ValueError:
        logging.getLogger("llmserve.y").exception("it failed")
    first, second = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert first["message"] == "busy" and first["num_running"] == 3 and first["level"] == "INFO"
    assert first["role"] == "http" and first["logger"] == "llmserve.status" and "timestamp" in first
    assert second["level"] == "ERROR" and "ValueError: bad" in second["exc_info"]


def test_status_lines_show_at_the_default_level_but_not_at_error(restore_logging, capsys):
    configure_logging("warning", "text")
    status_logger().info("serving")
    assert "serving" in capsys.readouterr().err
    configure_logging("error", "text")
    status_logger().info("serving")
    assert capsys.readouterr().err == ""


def test_the_processes_it_starts_log_the_same_way(restore_logging):
    """The engine core and the workers read the choice from the environment they inherit."""
    configure_logging("info", "json", role="http")
    code = ("import logging; from llmserve.common.logs import configure_child_logging; "
            "configure_child_logging('worker'); logging.getLogger('w').info('loaded')")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    record = json.loads(err)
    assert (record["role"], record["message"], record["level"]) == ("worker", "loaded", "INFO")


def test_transformers_records_go_through_ours(restore_logging, capsys):
    """transformers has a plain-text handler of its own; a JSON log must stay JSON."""
    from transformers.utils import logging as transformers_logging

    from llmserve.common.logs import adopt_library_logging

    configure_logging("warning", "json", role="worker")
    adopt_library_logging()
    try:
        transformers_logging.get_logger("transformers.some_module").warning("deprecated thing")
        [record] = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
        assert (record["logger"], record["message"]) == ("transformers.some_module", "deprecated thing")
    finally:
        transformers_logging.disable_propagation()
        transformers_logging.enable_default_handler()


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_commands_last_error_line(restore_logging, capsys, log_format):
    from llmserve.common.logs import report_error

    configure_logging("warning", log_format, role="http")
    report_error("cannot listen on 127.0.0.1:8000")
    err = capsys.readouterr().err
    if log_format == "text":   # what a person reads: no timestamp
        assert err == "llmserve: error: cannot listen on 127.0.0.1:8000\n"
    else:
        record = json.loads(err)
        assert (record["level"], record["message"]) == ("ERROR", "cannot listen on 127.0.0.1:8000")
