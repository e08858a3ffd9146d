"""An OpenAI-compatible server that answers instantly, to measure the load generator alone.

It streams max_tokens one-word chunks, then usage and [DONE], with no model behind it and as
little work per chunk as raw asyncio streams allow. Run it in its own process:
`python -m loomserve.cli.bench.instant_server [--port N]` prints "listening on PORT" when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

MODEL = "instant"


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk of the chunked transfer encoding."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(body: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")


TOKEN_EVENTS = {
    "completions": _event({"object": "text_completion", "choices": [{"index": 0, "text": " w"}]}),
    "chat": _event({"object": "chat.completion.chunk", "choices": [{"delta": {"content": " w"}}]}),
}
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _json_response(status: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}"
    return head.encode() + b"\r\n\r\n" + data


def _finish_events(endpoint: str, prompt_tokens: int, tokens: int) -> bytes:
    key = "text" if endpoint == "completions" else "delta"
    empty: object = "" if endpoint == "completions" else {}
    finish = {"choices": [{"index": 0, key: empty, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens}}
    return _event(finish) + _event(usage) + DONE


async def _stream(writer: asyncio.StreamWriter, endpoint: str, body: dict) -> None:
    tokens = max(1, int(body.get("max_tokens") or 16))
    prompt = body.get("prompt") or json.dumps(body.get("messages", ""))
    writer.write(STREAM_HEAD)
    event = TOKEN_EVENTS[endpoint]
    for _ in range(tokens):
        writer.write(event)  # one write per event, as a real server flushes each token
        await writer.drain()
    writer.write(_finish_events(endpoint, max(1, len(str(prompt)) // 4), tokens))
    await writer.drain()


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            target = request_line.split(" ")[1]
            length = 0
            for line in header_lines:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if target.endswith("/chat/completions"):
                await _stream(writer, "chat", body)
            elif target.endswith("/completions"):
                await _stream(writer, "completions", body)
            elif target.endswith("/models"):
                models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                writer.write(_json_response("200 OK", models))
            else:
                error = {"error": {"message": "not found", "type": "not_found", "code": 404}}
                writer.write(_json_response("404 Not Found", error))
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def serve(port: int) -> None:
    """Serve on 127.0.0.1:port (0 picks a free one) until killed."""
    server = await asyncio.start_server(_handle, "127.0.0.1", port, backlog=1024)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.port))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
