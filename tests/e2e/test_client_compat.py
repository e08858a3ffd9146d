"""What clients that are not OpenAI's own SDK with its defaults expect, against a real worker on
the tiny model: the API's paths without /v1 (a bare base URL), `system_fingerprint`, and CORS for
a chat UI served from another origin (in Debian's Chromium, driven by Playwright)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import Proc, start_gateway, start_worker

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=512) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as proc,
    ):
        yield proc


def bare_client(gateway: Proc) -> openai.OpenAI:
    """A client given the server's bare address, as llama-server's users write it."""
    return openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)


# --- the API without /v1 ----------------------------------------------------------------


def test_bare_paths_serve_the_openai_api(gateway: Proc) -> None:
    client = bare_client(gateway)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    completion = client.completions.create(model=MODEL, prompt="once", max_tokens=3)
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    chat = client.chat.completions.create(**CHAT, temperature=0)
    pieces = client.chat.completions.create(**CHAT, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert streamed == chat.choices[0].message.content


def test_bare_paths_answer_as_their_v1_routes(gateway: Proc) -> None:
    """Embeddings, Responses and Messages too: each bare path gets its /v1 route's answer."""
    bodies = {
        "/embeddings": {"model": MODEL, "input": "hello"},
        "/responses/input_tokens": {"model": MODEL, "input": "hello"},
        "/messages/count_tokens": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
        },
    }
    for path, body in bodies.items():
        bare = httpx.post(gateway.url + path, json=body, timeout=30)
        v1 = httpx.post(gateway.url + "/v1" + path, json=body, timeout=30)
        assert (bare.status_code, bare.json()) == (v1.status_code, v1.json()), path
    messages = httpx.post(gateway.url + "/messages", json={"model": "nope"}, timeout=30)
    assert messages.json()["type"] == "error"  # Anthropic's error shape, as under /v1/messages


def test_bare_paths_leave_the_other_routes_and_the_schema_alone(gateway: Proc) -> None:
    # The model manager's routes stay theirs: GET is not one of their methods.
    assert httpx.get(gateway.url + "/models/load").status_code == 405
    assert httpx.get(gateway.url + "/chat/completions/extra").status_code == 404
    paths = httpx.get(gateway.url + "/openapi.json").json()["paths"]
    assert "/v1/chat/completions" in paths and "/chat/completions" not in paths


# --- system_fingerprint -----------------------------------------------------------------


def test_chat_completions_carry_a_stable_system_fingerprint(gateway: Proc) -> None:
    client = bare_client(gateway)
    first = client.chat.completions.create(**CHAT)
    again = client.chat.completions.create(**CHAT)
    fingerprint = first.system_fingerprint
    assert fingerprint is not None and fingerprint.startswith("fp_")
    assert again.system_fingerprint == fingerprint
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    assert chunks and {c.system_fingerprint for c in chunks} == {fingerprint}


# --- CORS, in a browser -----------------------------------------------------------------

# A chat UI's call: JSON and a bearer key, so the browser sends a preflight first.
FETCH_CHAT = """async ([url, key]) => {
    const response = await fetch(url + "/v1/chat/completions", {
        method: "POST",
        headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key},
        body: JSON.stringify({model: "tiny-llama", max_tokens: 4, stream: true,
                              messages: [{role: "user", content: "hi"}]}),
    });
    return {status: response.status, id: response.headers.get("x-request-id"),
            body: await response.text()};
}"""
# The same call where the browser refuses it: fetch's TypeError, whose text is the browser's.
FETCH_REFUSED = """async ([url, key]) => {
    try {
        await fetch(url + "/v1/models", {headers: {"Authorization": "Bearer " + key}});
        return "answered";
    } catch (error) {
        return "refused";
    }
}"""


@contextmanager
def page_server() -> Iterator[str]:
    """An origin of its own (another port on 127.0.0.1) serving an empty page, as a chat UI's."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>chat ui</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_of_an_allowed_origin_calls_the_api(browser, tiny_model_path: Path) -> None:
    """The preflight of a keyed JSON POST passes (no key needed for it), the stream is read;
    a page of another origin is refused by the browser, and so is every page by default."""
    with ExitStack() as stack:
        allowed = stack.enter_context(page_server())
        other = stack.enter_context(page_server())
        worker = stack.enter_context(start_worker(tiny_model_path, slots=2, ctx_size=512))
        gateway = stack.enter_context(
            start_gateway(tiny_model_path, worker.endpoint, api_key="sk-ui", cors_origins=[allowed])
        )
        closed = stack.enter_context(start_gateway(tiny_model_path, worker.endpoint))
        page = browser.new_page()
        page.goto(allowed + "/")
        answer = page.evaluate(FETCH_CHAT, [gateway.url, "sk-ui"])
        assert answer["status"] == 200, answer
        assert answer["id"]  # an exposed header, readable by the page
        assert answer["body"].rstrip().endswith("data: [DONE]")
        assert page.evaluate(FETCH_CHAT, [gateway.url, "wrong"])["status"] == 401
        assert page.evaluate(FETCH_REFUSED, [closed.url, ""]) == "refused"
        page.goto(other + "/")
        assert page.evaluate(FETCH_REFUSED, [gateway.url, "sk-ui"]) == "refused"
        page.close()


# --- model names: aliases, and any name ---------------------------------------------------


def test_aliases_and_any_model_name(tiny_model_path: Path) -> None:
    """A fixed name a client sends (gpt-4o-mini) runs on the model it is an alias of; with
    --any-model-name, any name runs on the default model; else other names stay a 404."""
    names = f"{MODEL},gpt-4o-mini, test"
    with ExitStack() as stack:
        worker = stack.enter_context(
            start_worker(tiny_model_path, slots=2, ctx_size=512, served_model_name=names)
        )
        strict = stack.enter_context(
            start_gateway(tiny_model_path, worker.endpoint, served_model_name=names)
        )
        lenient = stack.enter_context(
            start_gateway(tiny_model_path, worker.endpoint, any_model_name=True)
        )
        client = bare_client(strict)
        for name in ("gpt-4o-mini", "test", MODEL):
            answer = client.chat.completions.create(**{**CHAT, "model": name})
            assert answer.model == MODEL  # answers carry the model's own name, as vLLM's
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert client.models.retrieve("gpt-4o-mini").id == MODEL
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(**{**CHAT, "model": "claude-3-5-sonnet"})
        any_name = bare_client(lenient).chat.completions.create(**{**CHAT, "model": "gpt-4o"})
        assert any_name.model == MODEL
        assert bare_client(lenient).models.retrieve("gpt-4o").id == MODEL
