"""Grammars that could freeze a worker (docs/grammar.md), and the watchdog behind them, on
real processes and the tiny model.

A GBNF that can never finish gets a 400 at the gateway; a grammar that does not compile is
refused by the worker from any peer; an ambiguous grammar (which froze llama.cpp's grammar
sampler) runs in bounded steps on llguidance, beside other streams. And a tick stuck in
native code for real (LOOMSERVE_TEST_STUCK_TICK, worker/tick/faults.py) trips the watchdog:
every request hears of it, the gateway's /health says 503, and the worker exits with status
3 to be restarted, SIGTERM or not.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from loomserve.protocol import ErrorCode, Generate, SamplingParams
from loomserve.protocol.grammar_shape import grammar_shape_problem
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.tick.faults import STUCK_ENV
from loomserve.worker.tick.loop import TickLoop
from loomserve.worker.tick.watchdog import Watchdog
from tests.procs import Proc, start_gateway, start_worker
from tests.worker.engine.test_engine import GW, Collector, drain

NEVER_ENDS = 'root ::= x\nx ::= "a" x "b" | "a" x "c"'  # 38 bytes that froze a worker for good
AMBIGUOUS = 'root ::= x\nx ::= "a" x "b" | "a" x "c" | "a"'  # ends, but doubles per "a"
LETTER_A = 3 + ord("a")  # the tiny model's byte token <0x61>
FORCED_A = {"logit_bias": {str(LETTER_A): 100}, "temperature": 0}


def completions(gateway: Proc) -> str:
    return gateway.url + "/v1/completions"


class Stream:
    """A plain streamed completion read on a thread: its events, and how it ended."""

    def __init__(self, gateway: Proc, max_tokens: int) -> None:
        self.body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}
        self.body |= {"temperature": 0, "stream": True}
        self.url = completions(gateway)
        self.events: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[len("data: ") :])

    def ended(self, timeout: float) -> list[str]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream is frozen"
        return self.events


@pytest.mark.parametrize(
    ("grammar", "stuck"),
    [
        (NEVER_ENDS, ["root", "x"]),
        ('root ::= "a" | "b" y\ny ::= "c" y', ["y"]),  # reachable, though root can end
        ('root ::= ( "a" root )+', ["root"]),
        ('root ::= "a" (\n "b" | c )\nc ::= "d" c # a comment', ["c"]),
        ('root ::= x\nx ::= "a" x "b" | "a" x "c" | ""', []),  # ends: the bound's business
        ('root ::= "a" | "b" y\ny ::= "c" y*', []),
        ('root ::= ( "a" root ){0,3}', []),
        ('root ::= [a-z]+ "x"\nunused ::= unused "a"', []),  # unreachable
        ("root ::= <[12]> root | <[13]>", []),
        (JSON_GBNF, []),
        (json_schema_to_gbnf('{"type": "array", "items": {"type": "object"}}'), []),
        ("root ::= (", []),  # does not parse: llama.cpp's parser says why
    ],
)
def test_grammars_that_can_never_finish_are_named(grammar: str, stuck: list[str]) -> None:
    problem = grammar_shape_problem(grammar)
    if not stuck:
        assert problem is None
    else:
        assert problem is not None and "can never finish" in problem
        assert all(f"`{name}`" in problem for name in stuck), problem


def test_a_grammar_that_can_never_finish_gets_a_400(tiny_model_path: Path) -> None:
    with (
        start_worker(tiny_model_path) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        body = {"prompt": "Say a:", "max_tokens": 8, "temperature": 0, "grammar": NEVER_ENDS}
        response = httpx.post(completions(gateway), json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "grammar"
        assert "can never finish" in error["message"] and "`x`" in error["message"]
        fine = {**body, "grammar": 'root ::= "a"+'}
        assert httpx.post(completions(gateway), json=fine, timeout=30).is_success
        assert httpx.get(gateway.url + "/health", timeout=5).status_code == 200


def test_the_worker_refuses_a_grammar_that_does_not_compile_from_any_peer(
    tiny_model_path: Path,
) -> None:
    config = WorkerConfig(model_path=tiny_model_path, slots=2, ctx_size=128, threads=1)
    engine = Engine(config)
    try:
        loop = TickLoop(engine, config, collector := Collector())
        for name, grammar in [("gbnf", NEVER_ENDS), ("undefined", "start: nowhere\n")]:
            params = SamplingParams(max_tokens=8, temperature=0.0, grammar=grammar)
            loop.inbox.submit(GW, Generate(name, [1, 40], params))
        drain(loop)
        refused = ErrorCode.INVALID_REQUEST.value
        assert collector.rejected() == {"gbnf": refused, "undefined": refused}
    finally:
        engine.close()


def test_an_ambiguous_grammar_runs_and_the_stream_beside_it_runs_on(
    tiny_model_path: Path,
) -> None:
    """The grammar that doubled llama.cpp's parse stacks per `a` runs to max_tokens."""
    with (
        start_worker(tiny_model_path) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        beside = Stream(gateway, max_tokens=120)
        body = {"prompt": "Say a:", "max_tokens": 64, "grammar": AMBIGUOUS, **FORCED_A}
        response = httpx.post(completions(gateway), json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and set(choice["text"]) == {"a"}
        events = beside.ended(timeout=60)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert httpx.get(gateway.url + "/health", timeout=5).status_code == 200
        assert worker.alive()


def stuck_after(passes: int) -> dict[str, str]:
    """A worker's environment whose forward pass after `passes` others sticks for good."""
    return {STUCK_ENV: str(passes)}


def test_a_stuck_tick_trips_the_watchdog(tiny_model_path: Path) -> None:
    with (
        start_worker(tiny_model_path, env=stuck_after(40), tick_watchdog=3) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        beside = Stream(gateway, max_tokens=400)
        body = {"prompt": "Say a:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        response = httpx.post(completions(gateway), json=body, timeout=120)
        assert response.status_code >= 500, response.text
        assert "engine failed" in response.json()["error"]["message"]
        assert worker.popen.wait(timeout=30) == 3  # for its supervisor to restart it
        assert "tick stuck" in worker.logs()
        events = beside.ended(timeout=30)
        assert events[-1] != "[DONE]" and "error" in json.loads(events[-1])
        unhealthy = httpx.get(gateway.url + "/health", timeout=5)
        assert unhealthy.status_code == 503


def test_sigterm_ends_a_worker_stuck_in_its_tick(tiny_model_path: Path) -> None:
    environment = stuck_after(12)
    with (
        start_worker(tiny_model_path, env=environment, tick_watchdog=300, shutdown_timeout=1) as w,
        start_gateway(tiny_model_path, w.endpoint) as gateway,
    ):
        body = {"prompt": "Say a:", "max_tokens": 64, "ignore_eos": True, "temperature": 0}
        body["stream"] = True
        tokens: list[str] = []

        def read() -> None:
            with httpx.stream("POST", completions(gateway), json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        tokens.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        # The 13th forward pass sticks in native code for real: the stream stops short.
        deadline = time.monotonic() + 60
        while len(tokens) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3)
        assert len(tokens) < 64
        w.popen.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert w.popen.wait(timeout=30) == 3
        assert time.monotonic() - signalled < 15  # not the 300 s watchdog limit
        assert "asked to stop" in w.logs()
        reader.join(30)
        assert not reader.is_alive()


class FakeLoop:
    """The one attribute of the tick loop the watchdog reads."""

    busy_since: float | None = None


def test_the_watchdog_fires_on_an_old_tick_only() -> None:
    loop, fired = FakeLoop(), []
    watchdog = Watchdog(loop, limit=1.0, stop_grace=0.5, on_stuck=fired.append)
    watchdog.start()
    try:
        time.sleep(1.5)  # idle: waiting for work is not being stuck
        assert fired == []
        for _ in range(15):  # short ticks, one after another
            loop.busy_since = time.monotonic()
            time.sleep(0.1)
        assert fired == []
        time.sleep(1.5)  # the last one never ends
        assert len(fired) == 1 and "a tick has run" in fired[0]
    finally:
        watchdog.stop()


def test_a_stop_signal_during_a_stuck_tick_fires_after_the_grace() -> None:
    """The signal reaches the watchdog through the wakeup fd, whatever the main thread does."""
    loop, fired = FakeLoop(), []
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    watchdog = Watchdog(loop, limit=60.0, stop_grace=0.5, on_stuck=fired.append)
    watchdog.start()
    try:
        loop.busy_since = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(fired) == 1 and "asked to stop" in fired[0]
    finally:
        watchdog.stop()
        signal.signal(signal.SIGTERM, previous)
