"""The gateway's line to `serve`'s model manager: load a model, unload one, know their phases.

Only `serve` runs a manager (cli/models.py): it owns the workers' processes, so it alone can
start a model's worker on demand and stop an idle one. A gateway started on its own has no
manager, and serves the models whose workers it finds.

One request at a time on one DEALER socket: the manager answers in order, and the gateway's
questions are rare (a load, an unload, the phases every POLL_SECONDS).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio

from ...protocol.codec import MAX_FRAME_BYTES, DecodeError, decode, encode
from ...protocol.messages import LoadModel, ModelsQuery, ModelStates, UnloadModel
from ...protocol.model_manager import ModelState

log = structlog.get_logger(__name__)

POLL_SECONDS = 1.0  # how often the phases are asked for
ANSWER_SECONDS = 5.0  # the manager answers within this, or it is taken as gone


class ManagerGone(Exception):
    """The manager did not answer in time."""


class ManagerClient:
    """Asks serve's model manager; keeps its latest phases of every model."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context | None = None) -> None:
        self.endpoint = endpoint
        self.states: dict[str, ModelState] = {}  # the latest answer's, by model name
        self.answered_at = -float("inf")  # time.monotonic() of the latest answer
        self._owns_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()
        self._poll: asyncio.Task[None] | None = None
        # The models with requests in flight in this gateway, told with every question.
        self.busy: Callable[[], list[str]] = list

    async def start(self) -> None:
        self._connect()
        self._poll = asyncio.create_task(self._poll_loop(), name="models-poll")

    async def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._owns_context:
            self._context.destroy(linger=0)

    @property
    def reachable(self) -> bool:
        """Whether the manager answered within the last few polls."""
        return time.monotonic() - self.answered_at < 3 * POLL_SECONDS + ANSWER_SECONDS

    async def load(self, name: str) -> ModelStates:
        return await self.ask(LoadModel(name, self.busy()))

    async def unload(self, name: str) -> ModelStates:
        return await self.ask(UnloadModel(name, self.busy()))

    async def ask(self, message: LoadModel | UnloadModel | ModelsQuery) -> ModelStates:
        """The manager's answer; ManagerGone when none comes in ANSWER_SECONDS."""
        async with self._lock:
            assert self._socket is not None
            await self._socket.send_multipart(encode(message))
            try:
                async with asyncio.timeout(ANSWER_SECONDS):
                    while True:
                        frames = await self._socket.recv_multipart()
                        try:
                            answer = decode(frames)
                        except DecodeError:
                            continue
                        if isinstance(answer, ModelStates):
                            break
            except TimeoutError:
                # A late answer must not be read as the next question's: start over.
                self._socket.close(linger=0)
                self._connect()
                raise ManagerGone(f"the model manager at {self.endpoint} did not answer") from None
        self.states = {state.name: state for state in answer.models}
        self.answered_at = time.monotonic()
        return answer

    def _connect(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.connect(self.endpoint)
        self._socket = sock

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self.ask(ModelsQuery(self.busy()))
            except ManagerGone as exc:
                log.warning("no answer from the model manager", error=str(exc))
            except Exception:
                log.exception("asking the model manager failed")
            await asyncio.sleep(POLL_SECONDS)
