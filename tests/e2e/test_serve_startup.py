"""What `serve`'s start-up says (issue 60, item 10), on the real engine: `ready` only once the
default model serves, each connection logged once, the chat template in use named, and no
access lines for serve's own readiness probe."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from loomserve.cli.main import main
from loomserve.cli.serve import health_ok
from loomserve.gateway.http.middleware import READY_PROBE_AGENT
from tests.e2e.test_models import states, wait_until
from tests.e2e.test_serve_models import events, start_serve
from tests.procs import Proc, free_port, start_gateway

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def started(tiny_model_path: Path, other_model_path: Path, tmp_path_factory) -> Iterator[Proc]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    extra = ("--models-max", "1", "--chat-template", str(template))
    with start_serve(tiny_model_path, other_model_path, *extra) as proc:
        proc.template = template  # type: ignore[attr-defined]
        wait_until(lambda: bool(events(proc, "ready")), "serve to say it is ready")
        yield proc


def _line(proc: Proc, event: str, **fields: str) -> int:
    """The index of the first JSON log line of this event with these fields."""
    for index, line in enumerate(proc.logs().splitlines()):
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event and all(record.get(k) == v for k, v in fields.items()):
                return index
    raise AssertionError(f"no {event!r} {fields} in the log")


def test_ready_follows_the_default_model_in_rotation(started: Proc) -> None:
    assert len(events(started, "ready")) == 1
    in_rotation = [e for e in events(started, "worker in rotation") if "model-1-" in e["worker"]]
    assert in_rotation, "the default model's worker never came into rotation"
    ready_at = _line(started, "ready")
    rotation_at = _line(started, "worker in rotation", worker=in_rotation[0]["worker"])
    assert rotation_at < ready_at


def test_the_probe_waits_for_the_model_it_is_given(started: Proc) -> None:
    """/health is 200 with a model manager whatever is loaded; the probe asks for the model."""
    port = int(started.url.rsplit(":", 1)[1])
    wait_until(lambda: states(started)["a"] == "loaded", "a to load")
    assert health_ok("127.0.0.1", port, "a")
    unloaded = httpx.post(started.url + "/models/unload", json={"model": "a"}, timeout=60)
    assert unloaded.status_code == 200
    wait_until(lambda: states(started)["a"] == "unloaded", "a to unload")
    assert httpx.get(started.url + "/health").status_code == 200
    assert health_ok("127.0.0.1", port)
    assert not health_ok("127.0.0.1", port, "a")


def test_each_connection_is_logged_once(started: Proc) -> None:
    connected = [e["gateway_id"] for e in events(started, "gateway connected")]
    assert connected and len(connected) == len(set(connected)), connected
    ready = [(e["worker"], e["model"]) for e in events(started, "worker ready")]
    assert ready and len(ready) == len(set(ready)), ready


def test_the_chat_template_in_use_is_named(started: Proc) -> None:
    named = {e["model"]: e["template"] for e in events(started, "chat template")}
    expected = f"--chat-template {started.template}"  # type: ignore[attr-defined]
    assert named == {"a": expected, "b": expected}


def test_the_ready_probes_503s_are_not_logged(tiny_model_path: Path) -> None:
    """A gateway with no worker answers /health 503: to a person's probe that is logged, to
    serve's readiness probe (polling until 200) it is not."""
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    with start_gateway(tiny_model_path, nowhere, wait=False, log_json=True) as gateway:
        wait_until(lambda: _answers(gateway), "the gateway to listen")
        for _ in range(3):
            probe = httpx.get(gateway.url + "/health", headers={"User-Agent": READY_PROBE_AGENT})
            assert probe.status_code == 503
        assert httpx.get(gateway.url + "/health").status_code == 503
        logged = [e for e in events(gateway, "http request") if e["path"] == "/health"]
        assert [e["status"] for e in logged] == [503]


def _answers(gateway: Proc) -> bool:
    try:
        httpx.get(gateway.url + "/live", timeout=2)
    except httpx.TransportError:
        return False
    return True


def test_worker_health_points_endpoint_at_worker() -> None:
    result = CliRunner().invoke(main, ["worker-health", "--endpoint", "ipc:///tmp/nothing.ipc"])
    assert result.exit_code == 2
    assert "Did you mean '--worker'" in result.output
