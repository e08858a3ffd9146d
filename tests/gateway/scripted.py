"""A stand-in for the WorkerPool that answers each choice with a script of worker messages.

The gateway's request path (generate/) is tested in process with it: the real Generation,
GenerationGroup, StreamChunks and event_stream, over RequestHandles fed what a worker would
send. No model and no socket: what a worker sends is fixed by the test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from loomserve.gateway.request.generation_request import ApiBody, GenerationRequest, Prompt
from loomserve.gateway.workers.errors import WorkerClientError
from loomserve.gateway.workers.handle import RequestHandle
from loomserve.protocol.messages import (
    Finish,
    FinishReason,
    Generate,
    SamplingParams,
    TokenChunk,
)

# A vocabulary of byte strings: one word per token.
PIECES = {0: b"", 1: b"Hello", 2: b" world", 3: b" ST", 4: b"OP", 5: b"!", 6: b" again"}


class Pieces:
    """What text assembly uses of a vocabulary."""

    n_tokens = len(PIECES)

    def piece(self, token_id: int) -> bytes:
        return PIECES[token_id]


Script = list[TokenChunk | Finish | WorkerClientError]


def chunk(request_id: str, tokens: list[int], seq: int) -> TokenChunk:
    return TokenChunk(request_id, tokens, seq=seq)


def finish(request_id: str, completion: int, reason: str = FinishReason.LENGTH) -> Finish:
    return Finish(request_id, reason, 3, completion, 1, queue_seconds=0.0)


def tokens_then_finish(request_id: str, tokens: list[int]) -> Script:
    """Each token in its own chunk, then a Finish for their count."""
    script: Script = [chunk(request_id, [t], i) for i, t in enumerate(tokens)]
    return [*script, finish(request_id, len(tokens))]


@dataclass(slots=True)
class Config:
    request_timeout: float = 30.0


@dataclass(slots=True)
class ScriptedClient:
    """One worker connection: takes every Generate and queues the script `answer` gives for
    it on its handle; knows which requests it still runs, and which were cancelled."""

    answer: Callable[[Generate], Script]
    endpoint: str = "inproc://scripted"
    running: set[str] = field(default_factory=set)
    cancelled: list[str] = field(default_factory=list)
    cancel_reasons: list[str] = field(default_factory=list)  # the reason of each Cancel
    submitted: list[Generate] = field(default_factory=list)

    async def submit(self, generate: Generate, deadline: float) -> RequestHandle:
        self.submitted.append(generate)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        handle = RequestHandle(generate.request_id, deadline, accepted)
        script = self.answer(generate)
        if not any(isinstance(m, Finish | WorkerClientError) for m in script):
            self.running.add(generate.request_id)  # the worker still runs it
        for message in script:
            handle.events.put_nowait(message)
        return handle

    def is_open(self, handle: RequestHandle) -> bool:
        return handle.request_id in self.running

    def cancel(self, handle: RequestHandle, reason: str = FinishReason.CANCELLED) -> None:
        self.cancelled.append(handle.request_id)
        self.cancel_reasons.append(reason)

    def forget(self, handle: RequestHandle) -> None:
        self.running.discard(handle.request_id)


@dataclass(frozen=True, slots=True)
class ScriptedChoice:
    endpoint: str


@dataclass(slots=True)
class ScriptedPool:
    """`workers` scripted workers sharing one script; a request gets the first it has not
    tried yet, as the pool's routing would give it another."""

    answer: Callable[[Generate], Script]
    workers: int = 2
    config: Config = field(default_factory=Config)
    clients: list[ScriptedClient] = field(init=False)
    submitted: list[Generate] = field(default_factory=list)
    reroutes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clients = [
            ScriptedClient(self.answer, f"inproc://scripted-{index}", submitted=self.submitted)
            for index in range(self.workers)
        ]

    @property
    def client(self) -> ScriptedClient:
        """The first worker: the one every request tries first."""
        return self.clients[0]

    def pick(
        self, key: int | None, exclude: Collection[str], keys: list[int] | None = None
    ) -> tuple[ScriptedClient, ScriptedChoice] | None:
        for client in self.clients:
            if client.endpoint not in exclude:
                return client, ScriptedChoice(client.endpoint)
        return None

    def routed(self, choice: ScriptedChoice, key: int | None, client: ScriptedClient) -> None:
        pass  # nothing to learn about prefixes here

    def count_reroute(self, reason: str) -> None:
        self.reroutes.append(reason)

    def unavailable_reason(self) -> str | None:
        return None


def request(
    body: ApiBody, prompts: int = 1, n: int = 1, stops: tuple[str, ...] = ()
) -> GenerationRequest:
    """A request as the route builds it: `prompts` prompts of three tokens, n choices each."""
    params = SamplingParams(max_tokens=16, temperature=0.0)
    return GenerationRequest(
        id="cmpl-t",
        body=body,
        prompts=[Prompt([1, 2, 3], params, text="Hi") for _ in range(prompts)],
        n=n,
        stops=stops,
        model="m",
        arrived_at=time.monotonic(),
        created=0,
    )
