"""A fake OpenAI-compatible server with a known timetable, for the load generator's tests.

It streams its first chunk 100 ms after it takes a request and one every 20 ms after that,
on an absolute schedule, then usage and [DONE]; a plan keyed by request index makes chosen
requests fail in chosen ways. `capacity` caps the requests it serves at once (the rest wait,
as for a server's slots), `cached_share` reports that share of each prompt as cached, and
`/metrics` serves Prometheus text in vLLM's names when `metrics` is on.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

FIRST_S = 0.100
GAP_S = 0.020


class FakeOpenAI:
    """A Starlette app that streams on a fixed timetable and misbehaves on request."""

    def __init__(self) -> None:
        self.plan: dict[int, str] = {}  # request index → mode; default "ok"
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.llama_server_tokenize = False  # /tokenize in llama-server's shape
        self.capacity: int | None = None  # requests served at once; None: any number
        self.slots: asyncio.Semaphore | None = None
        self.cached_share = 0.0  # the share of each prompt reported as cached (at least 1)
        self.metrics = False  # serve /metrics
        self.generated = 0  # tokens streamed, for /metrics
        self.model_ids = ["fake-model"]  # what /v1/models lists, in order
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/version", self.version),
                Route("/metrics", self.prometheus),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
            ]
        )

    def reset(self) -> None:
        self.plan, self.in_flight, self.max_in_flight, self.bodies = {}, 0, 0, []
        self.llama_server_tokenize = False
        self.capacity, self.slots, self.cached_share, self.metrics = None, None, 0.0, False
        self.model_ids = ["fake-model"]

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": "fake-1.0"})

    async def prometheus(self, request: Request) -> Response:
        if not self.metrics:
            return PlainTextResponse("not found", status_code=404)
        waiting = max(0, self.in_flight - (self.capacity or self.in_flight))
        text = (
            "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="fake-model"}} {self.in_flight - waiting}\n'
            "# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="fake-model"}} {waiting}\n'
            "# HELP vllm:kv_cache_usage_perc KV.\n# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="fake-model"}} {0.1 * self.in_flight}\n'
            "# HELP vllm:generation_tokens Tokens.\n# TYPE vllm:generation_tokens counter\n"
            f'vllm:generation_tokens_total{{model_name="fake-model"}} {self.generated}\n'
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        data = [{"id": i, "object": "model", "owned_by": f"owner-{i}"} for i in self.model_ids]
        return JSONResponse({"object": "list", "data": data})

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        if self.llama_server_tokenize:  # {"content"} in, {"tokens"} out; other keys ignored
            return JSONResponse({"tokens": list(range(len(body.get("content", "").split())))})
        return JSONResponse({"count": len(body["prompt"].split())})

    async def generate(self, request: Request) -> Response:
        start = time.perf_counter()
        body = await request.json()
        self.bodies.append(body)
        index = int(request.headers["x-request-id"][-12:], 16)  # the bench ends ids in it
        mode = self.plan.get(index, "ok")
        if mode == "503":
            error = {"message": "queue full", "type": "server_error", "param": None, "code": 503}
            return JSONResponse({"error": error}, status_code=503)
        chat = request.url.path.endswith("/chat/completions")
        text = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        return StreamingResponse(
            self.stream(start, mode, chat, body["max_tokens"], len(text.split())),
            media_type="text/event-stream",
        )

    async def stream(
        self, start: float, mode: str, chat: bool, tokens: int, prompt_tokens: int
    ) -> AsyncIterator[bytes]:
        def event(body: dict) -> bytes:
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        def token(i: int) -> bytes:
            # byte_chunks closes with an event of its own, as llama-cpp-python's server does.
            last = i == tokens - 1 and mode != "byte_chunks"
            choice = {"index": 0, "finish_reason": "length" if last else None}
            # llama.cpp's servers: a token that is only part of a character streams as an
            # empty chunk (byte_chunks), or is held back to the closing event (held_back).
            empty = (mode == "byte_chunks" and i % 2 == 0) or mode == "held_back"
            text = "" if empty else f" t{i}"
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            return event({"choices": [choice]})

        self.in_flight += 1
        held = False
        try:
            if self.capacity is not None:  # wait for a slot, then keep the timetable from there
                if self.slots is None:
                    self.slots = asyncio.Semaphore(self.capacity)
                await self.slots.acquire()
                held = True
                start = time.perf_counter()
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if chat:  # announced at once, before any token: must not count as the first token
                yield event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            first = FIRST_S * (50 if mode == "slow" else 1)
            for i in range(tokens):
                await asyncio.sleep(max(0.0, start + first + i * GAP_S - time.perf_counter()))
                self.generated += 1
                if mode != "held_back" or i == tokens - 1:
                    yield token(i)
                if i == 1 and mode == "broken":
                    raise RuntimeError("the fake server breaks the stream on purpose")
                if i == 1 and mode == "truncated":
                    return
            if mode == "byte_chunks":
                closing = {"index": 0, "finish_reason": "length"}
                closing |= {"delta": {}} if chat else {"text": ""}
                yield event({"choices": [closing]})
            if mode not in ("no_usage", "byte_chunks"):
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": tokens,
                    "prompt_tokens_details": {
                        "cached_tokens": max(1, int(self.cached_share * prompt_tokens))
                    },
                }
                yield event({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            if held and self.slots is not None:
                self.slots.release()


@contextmanager
def serve_fake() -> Iterator[tuple[FakeOpenAI, str]]:
    """The fake server on a free 127.0.0.1 port, in a thread."""
    server_app = FakeOpenAI()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(server_app.app, log_level="critical", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield server_app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()
