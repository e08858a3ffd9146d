"""A FastAPI route class that parses large JSON bodies in a thread.

FastAPI parses a body with json.loads on the event loop: a body of a million token ids
(8 MB) took over a second, during which every stream of the gateway stalled and its
heartbeats to the worker stopped. Bodies above OFF_LOOP_BYTES are parsed in a worker thread.
Then a body with more tools or messages than any request may have is refused (limits.py),
before FastAPI validates it, on the event loop, into a request object.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import anyio.to_thread
from fastapi import Request, Response
from fastapi.routing import APIRoute

from ..request.limits import TURNS, check_counts

OFF_LOOP_BYTES = 64 * 1024


class OffLoopJSONRequest(Request):
    """A Request whose json() parses big bodies off the event loop."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFF_LOOP_BYTES:
                self._json = await anyio.to_thread.run_sync(json.loads, body)
            else:
                self._json = json.loads(body)
        return self._json

    async def check_counts(self, turns: tuple[str, ...]) -> None:
        """400 (an APIError) for a body over the caps (of tools, and of the `turns` fields'
        items); a body that is not JSON is left to FastAPI, which answers it in its own words."""
        if not await self.body():
            return
        try:
            parsed = await self.json()
        except (ValueError, RecursionError):
            return
        check_counts(parsed, turns)


class OffLoopJSONRoute(APIRoute):
    """An APIRoute whose handler gets an OffLoopJSONRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        # The embeddings' `input` is a list of inputs, capped by its own route.
        turns = () if self.path == "/v1/embeddings" else TURNS

        async def offloading_handler(request: Request) -> Response:
            offloaded = OffLoopJSONRequest(request.scope, request.receive)
            # Here, not in json(): FastAPI turns any error raised there into its own 400.
            await offloaded.check_counts(turns)
            return await handler(offloaded)

        return offloading_handler
