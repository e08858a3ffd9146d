"""`serve`'s model manager: several models behind one endpoint, loaded on demand, at most
--models-max at once, unloaded when idle.

Each model has its workers (supervised children started on demand) on their own ipc://
endpoints, which every gateway knows from the start: a gateway connects to a model's worker
as soon as it runs, and learns its model from it. A gateway asks the manager for a model no
worker serves (LoadModel, on the ROUTER socket at the control endpoint); the manager starts
its workers, first stopping the least recently used idle model when --models-max are loaded.
A model is idle when no gateway has a request in flight on it (each says which models it has
requests on with every question it asks, LoadModel's included: what the gateway knows, ahead
of the workers) and its workers' heartbeats say nothing has been queued or running for a
while (Heartbeat.idle_seconds): one with requests in flight is never evicted, and one idle
for --idle-unload seconds is stopped to free its memory. An unload (asked for, an eviction or
an idle one) drains first: the gateways answer new requests for the model with a 503 while
its running ones finish, for at most --unload-drain seconds; then its workers stop.

Everything here runs in the supervisor's loop (on_poll), without blocking it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import zmq

from ..protocol.codec import DecodeError, decode, encode
from ..protocol.messages import (
    Heartbeat,
    LoadModel,
    ModelsQuery,
    ModelStates,
    Ping,
    UnloadModel,
)
from ..protocol.model_manager import ModelPhase, ModelState
from .default_model import MODELS_MAX, UNLOAD_DRAIN_SECONDS
from .supervisor import Child, Supervisor

log = structlog.get_logger(__name__)

PING_SECONDS = 1.0  # how often each loaded model's workers are asked for their load
# A model loaded this recently is not evicted: the requests that asked for it are on their way.
LOAD_GRACE_SECONDS = 2.0
MIN_IDLE_SECONDS = 0.25  # a model idle for less is not evicted: a request may be arriving
REFRESH_SECONDS = 0.5  # how long an eviction waits for fresh heartbeats (local sockets)
# A gateway tells the models it has requests in flight on with every question (at least every
# second, its poll); a report older than this is of a gateway gone.
BUSY_REPORT_SECONDS = 5.0


@dataclass(slots=True)
class ManagedModel:
    """One model: its workers and where it stands."""

    name: str
    path: Path
    workers: list[Child]  # its supervised worker processes (replicas)
    endpoints: list[str]
    phase: ModelPhase = ModelPhase.UNLOADED
    since: float = field(default_factory=time.time)  # wall clock, for ModelState
    loaded_at: float = 0.0  # time.monotonic() when it last became loaded
    beats: dict[str, Heartbeat] = field(default_factory=dict)  # latest, by endpoint
    answered: dict[str, float] = field(default_factory=dict)  # latest Ping answered, by endpoint
    loads: int = 0
    unloads: int = 0
    error: str = ""  # why it could not be loaded, last time
    # While unloading: when its running requests must have ended (time.monotonic()), when
    # the unload began (time.time(), as the Pings' sent_at; and time.monotonic(), as the
    # gateways' reports), and whether its workers were told to stop (after the drain).
    drain_deadline: float = 0.0
    drain_since: float = 0.0
    drain_heard: float = 0.0
    stopping: bool = False

    def enter(self, phase: ModelPhase) -> None:
        self.phase, self.since = phase, time.time()

    @property
    def idle_seconds(self) -> float:
        """How long none of its workers had work (0 while one has, or before it reported)."""
        if not self.beats or len(self.beats) < len(self.endpoints):
            return 0.0
        return min(beat.idle_seconds for beat in self.beats.values())

    @property
    def busy(self) -> bool:
        return any(beat.load.running or beat.load.queue_depth for beat in self.beats.values())


class ModelManager:
    """Loads and unloads models at the gateways' and the operators' request."""

    def __init__(
        self,
        supervisor: Supervisor,
        models: Sequence[ManagedModel],
        control: str,
        models_max: int = MODELS_MAX,
        idle_unload: float | None = None,
        unload_drain: float = UNLOAD_DRAIN_SECONDS,
    ) -> None:
        self.supervisor = supervisor
        self.models = {model.name: model for model in models}
        self.models_max = models_max
        self.idle_unload = idle_unload
        self.unload_drain = unload_drain
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(control)
        self._pings: dict[str, zmq.Socket] = {}  # one DEALER per loaded worker endpoint
        # Each gateway's latest report of its busy models, by its socket identity, with when
        # (time.monotonic()) it came.
        self._gateway_busy: dict[bytes, tuple[frozenset[str], float]] = {}
        self._report_at: float | None = None  # the report of the question being answered
        self._next_ping = 0.0

    def close(self) -> None:
        for sock in self._pings.values():
            sock.close(linger=0)
        self._control.close(linger=0)
        self._context.destroy(linger=0)

    # --- the supervisor's loop --------------------------------------------------------

    def poll(self, now: float) -> None:
        """One round: answer the control socket, read heartbeats, move phases along."""
        while self._control.poll(0):
            self._answer(self._control.recv_multipart())
        self._read_heartbeats()
        if now >= self._next_ping:
            self._next_ping = now + PING_SECONDS
            self._ping_all()
        for model in self.models.values():
            self._advance(model, now)

    def _advance(self, model: ManagedModel, now: float) -> None:
        running = [child for child in model.workers if child.process is not None]
        if model.phase == ModelPhase.LOADING:
            failed = next((c.failed for c in model.workers if c.failed), None)
            if failed:
                self._unloaded(model, error=f"{model.name}: {failed}")
            elif len(model.beats) == len(model.endpoints) and all(
                beat.ready for beat in model.beats.values()
            ):
                model.enter(ModelPhase.LOADED)
                model.loaded_at = now
                log.info("model loaded", model=model.name, loads=model.loads)
        elif model.phase == ModelPhase.UNLOADING and not running:
            self._unloaded(model)
        elif model.phase == ModelPhase.UNLOADING and not model.stopping:
            self._drain(model, now)
        elif model.phase == ModelPhase.LOADED:
            failed = next((c.failed for c in model.workers if c.failed), None)
            if failed:
                self._unloaded(model, error=f"{model.name}: {failed}")
            elif (
                self.idle_unload is not None
                and model.idle_seconds >= self.idle_unload
                and not self.busy_in_gateways(model.name)
            ):
                log.info("model idle; unloading", model=model.name, idle_s=self.idle_unload)
                self._unload(model, reason="idle")

    def _unloaded(self, model: ManagedModel, error: str = "") -> None:
        model.enter(ModelPhase.UNLOADED)
        model.error = error
        model.beats.clear()
        model.answered.clear()
        for endpoint in model.endpoints:
            sock = self._pings.pop(endpoint, None)
            if sock is not None:
                sock.close(linger=0)
        for child in model.workers:
            if child.process is not None:
                self.supervisor.stop_child(child)
        if error:
            log.error("model failed to load", model=model.name, error=error)
        else:
            log.info("model unloaded", model=model.name, unloads=model.unloads)

    # --- loading and unloading ---------------------------------------------------------

    def load(self, name: str) -> ModelStates:
        model = self.models.get(name)
        if model is None:
            return self._states(f"no model is named {name!r}", "model_not_found")
        if model.phase in (ModelPhase.LOADING, ModelPhase.LOADED):
            return self._states()
        if model.phase == ModelPhase.UNLOADING:
            return self._states(f"{name} is unloading; ask again in a moment", "model_busy")
        loaded = [m for m in self.models.values() if m.phase != ModelPhase.UNLOADED]
        if len(loaded) >= self.models_max:
            # Decide on heartbeats asked for now: the last round's may predate a request.
            self._refresh_heartbeats(loaded)
            victim = self._eviction_candidate()
            if victim is None:
                return self._states(
                    f"every loaded model is busy (--models-max {self.models_max}); "
                    f"{name} loads when one is idle",
                    "models_busy",
                )
            log.info("evicting the least recently used model", model=victim.name, wanted=name)
            self._unload(victim, reason="evicted")
        model.error = ""
        model.loads += 1
        model.enter(ModelPhase.LOADING)
        for child in model.workers:
            self.supervisor.start_child(child)
        for endpoint in model.endpoints:
            self._pings[endpoint] = self._ping_socket(endpoint)
        log.info("loading model", model=name, path=str(model.path))
        return self._states()

    def unload(self, name: str) -> ModelStates:
        model = self.models.get(name)
        if model is None:
            return self._states(f"no model is named {name!r}", "model_not_found")
        if model.phase in (ModelPhase.UNLOADED, ModelPhase.UNLOADING):
            return self._states()
        self._unload(model, reason="asked")
        return self._states()

    def _unload(self, model: ManagedModel, reason: str) -> None:
        """Start unloading: the gateways refuse new requests for it (503, Retry-After) while
        its running ones finish, up to --unload-drain seconds; then its workers stop."""
        model.unloads += 1
        model.enter(ModelPhase.UNLOADING)
        model.drain_deadline = time.monotonic() + self.unload_drain
        model.stopping = False
        model.drain_since = self._ping_all(model.endpoints)  # fresh beats say when it is idle
        # The asking gateway's report (with its question) is as of now; the others must
        # report again, so that none has a request on it it had not yet told of.
        model.drain_heard = self._report_at or time.monotonic()
        log.info(
            "unloading model; its running requests finish first",
            model=model.name,
            reason=reason,
            drain_s=self.unload_drain,
        )

    def _drain(self, model: ManagedModel, now: float) -> None:
        """Stop the unloading model's workers once nothing runs on it (in any gateway's
        count, and in heartbeats sent after the unload began), or when the drain runs out."""
        fresh = all(model.answered.get(e, 0.0) >= model.drain_since for e in model.endpoints)
        heard = all(
            at >= model.drain_heard
            for _, at in self._gateway_busy.values()
            if now - at < BUSY_REPORT_SECONDS
        )
        idle = fresh and heard and not model.busy and not self.busy_in_gateways(model.name)
        if not idle and now < model.drain_deadline:
            return
        if not idle:
            running = sum(
                beat.load.running + beat.load.queue_depth for beat in model.beats.values()
            )
            log.warning(
                "unload drain ran out; stopping the model with requests running",
                model=model.name,
                drain_s=self.unload_drain,
                running=running,
            )
        model.stopping = True
        for child in model.workers:
            self.supervisor.stop_child(child)

    def busy_in_gateways(self, name: str) -> bool:
        """Whether a gateway said, in its latest report, it has requests in flight on it."""
        now = time.monotonic()
        return any(
            name in busy and now - at < BUSY_REPORT_SECONDS
            for busy, at in self._gateway_busy.values()
        )

    def _eviction_candidate(self) -> ManagedModel | None:
        """The loaded model idle the longest, never one with work (in a gateway's count or a
        worker's) or just loaded."""
        now = time.monotonic()
        idle = [
            model
            for model in self.models.values()
            if model.phase == ModelPhase.LOADED
            and not self.busy_in_gateways(model.name)
            and not model.busy
            and model.idle_seconds >= MIN_IDLE_SECONDS
            and now - model.loaded_at >= LOAD_GRACE_SECONDS
        ]
        return max(idle, key=lambda model: model.idle_seconds, default=None)

    # --- the control socket -------------------------------------------------------------

    def _answer(self, frames: list[bytes]) -> None:
        peer, body = frames[0], frames[1:]
        try:
            message = decode(body)
        except DecodeError as exc:
            log.warning("dropped a bad control message", error=str(exc))
            return
        if not isinstance(message, LoadModel | UnloadModel | ModelsQuery):
            log.warning("dropped a control message", type=type(message).__name__)
            return
        self._report_at = time.monotonic()
        self._gateway_busy[peer] = (frozenset(message.busy), self._report_at)
        try:
            if isinstance(message, LoadModel):
                answer = self.load(message.name)
            elif isinstance(message, UnloadModel):
                answer = self.unload(message.name)
            else:
                answer = self._states()
        finally:
            self._report_at = None
        self._control.send_multipart([peer, *encode(answer)])

    def _states(self, error: str = "", code: str = "") -> ModelStates:
        states = [
            ModelState(model.name, model.phase.value, model.endpoints[0], model.since, model.error)
            for model in self.models.values()
        ]
        return ModelStates(states, error, code)

    # --- heartbeats ----------------------------------------------------------------------

    def _ping_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a worker not up yet
        sock.connect(endpoint)
        return sock

    def _ping_all(self, endpoints: Sequence[str] | None = None) -> float:
        """Ping the workers (those at `endpoints`, or all loaded); the Pings' sent_at."""
        sent_at = time.time()
        for endpoint in self._pings if endpoints is None else endpoints:
            sock = self._pings.get(endpoint)
            if sock is not None:
                with contextlib.suppress(zmq.Again):  # not connected yet
                    sock.send_multipart(encode(Ping(sent_at=sent_at)), flags=zmq.NOBLOCK)
        return sent_at

    def _read_heartbeats(self, timeout_ms: int = 0) -> None:
        for endpoint, sock in self._pings.items():
            while sock.poll(timeout_ms):
                timeout_ms = 0
                try:
                    message = decode(sock.recv_multipart())
                except DecodeError:
                    continue
                if isinstance(message, Heartbeat):
                    model = self._model_at(endpoint)
                    if model is not None:
                        model.beats[endpoint] = message
                        answered = model.answered.get(endpoint, 0.0)
                        model.answered[endpoint] = max(answered, message.ping_sent_at)

    def _refresh_heartbeats(self, models: Sequence[ManagedModel]) -> None:
        """Ping the models' workers and wait (briefly) for every answer: whether they are
        idle is then known as of now. A worker that does not answer keeps its old beat."""
        endpoints = [e for model in models for e in model.endpoints if e in self._pings]
        sent_at = self._ping_all(endpoints)
        deadline = time.monotonic() + REFRESH_SECONDS
        while time.monotonic() < deadline:
            fresh = all(
                (beat := self._beat_at(endpoint)) is not None and beat.ping_sent_at >= sent_at
                for endpoint in endpoints
            )
            if fresh:
                return
            self._read_heartbeats(timeout_ms=10)

    def _beat_at(self, endpoint: str) -> Heartbeat | None:
        model = self._model_at(endpoint)
        return model.beats.get(endpoint) if model is not None else None

    def _model_at(self, endpoint: str) -> ManagedModel | None:
        return next((m for m in self.models.values() if endpoint in m.endpoints), None)
