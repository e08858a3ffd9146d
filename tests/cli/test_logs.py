"""The JSON log keeps an exception's traceback, from structlog and from the standard library."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from loomserve.cli.logs import configure_logging


def fail() -> None:
    raise ValueError("the tick's own words")


@pytest.mark.parametrize("source", ["structlog", "stdlib"])
def test_json_lines_carry_the_traceback(source: str, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json=True)
    try:
        fail()
    except ValueError:
        if source == "structlog":
            structlog.get_logger("loop").exception("tick failed", tick=7)
        else:
            logging.getLogger("loop").exception("tick failed")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    entry = json.loads(line)
    assert entry["event"] == "tick failed" and entry["level"] == "error"
    (raised,) = entry["exception"]
    assert raised["exc_type"] == "ValueError" and raised["exc_value"] == "the tick's own words"
    assert [frame["name"] for frame in raised["frames"]][-1] == "fail"


def test_the_console_renderer_prints_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json=False)
    try:
        fail()
    except ValueError:
        structlog.get_logger("loop").exception("tick failed")
    err = capsys.readouterr().err
    assert "tick failed" in err and "ValueError: the tick's own words" in err


def fail_holding_a_secret() -> None:
    # Made at run time: the traceback's source lines show this line as written, not its value.
    api_key = "-".join(["sk", "the", "secret", str(40 + 2)])  # noqa: F841 - not in the log
    raise ValueError("failed with a secret in scope")


@pytest.mark.parametrize("json_lines", [True, False])
def test_tracebacks_leave_frame_locals_out(
    json_lines: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging(json=json_lines)
    try:
        fail_holding_a_secret()
    except ValueError:
        structlog.get_logger("gateway").exception("request failed")
    err = capsys.readouterr().err
    assert "failed with a secret in scope" in err
    assert "sk-the-secret-42" not in err
    if json_lines:
        (raised,) = json.loads(err.strip().splitlines()[-1])["exception"]
        assert all("locals" not in frame for frame in raised["frames"])
