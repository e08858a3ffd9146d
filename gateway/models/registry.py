"""Models: which model a request's `model` names, whether it can run now, and each model's
state for /v1/models, /health and the metrics.

A model is known when the gateway has its file, when a worker serves it, or when `serve`'s
manager has it. A request for a known model that no worker serves now waits while the
manager loads it (bounded in time and in how many wait); without a manager it gets a 503.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from ...protocol.messages import ModelInfo
from ...protocol.model_manager import ModelPhase
from .. import tracing
from ..api.errors import APIError, invalid_request, unavailable
from ..config import GatewayConfig
from ..metrics import GatewayMetrics
from ..workers.pool import WorkerPool
from .catalogue import Catalogue, ServedModel
from .manager import ManagerClient, ManagerGone

log = structlog.get_logger(__name__)

WAIT_POLL_SECONDS = 0.05
ASK_AGAIN_SECONDS = 0.5  # a load refused (every loaded model busy) is asked for again
RETRY_AFTER_SECONDS = 5  # what a 503 for a model still loading tells the client


class ModelState:
    """The states /v1/models reports (llama-server's router says the same words)."""

    LOADED = "loaded"  # a worker serves it now
    LOADING = "loading"  # the manager is starting its worker
    UNLOADING = "unloading"
    UNLOADED = "unloaded"  # the manager can load it on demand
    UNAVAILABLE = "unavailable"  # known, but no worker serves it and none can be started


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model as /v1/models lists it."""

    name: str
    state: str  # a ModelState word
    info: ModelInfo | None  # a serving worker's, while one is in rotation
    workers: int  # in rotation
    reason: str = ""  # why it is unavailable, when that is known
    failed: bool = False  # unavailable for good: its file cannot be loaded


class Models:
    """The catalogue, the workers and the manager, asked as one about models."""

    def __init__(
        self,
        config: GatewayConfig,
        catalogue: Catalogue,
        pool: WorkerPool,
        manager: ManagerClient | None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        self.catalogue = catalogue
        self.pool = pool
        self.manager = manager
        self.metrics = metrics
        self.waiting = 0  # requests waiting for their model to load, on this gateway
        if manager is not None:
            manager.busy = pool.busy_models

    # --- one request's model ---------------------------------------------------

    def name_of(self, requested: str | None) -> str:
        """The served name a request's `model` (possibly absent) stands for; 404 for one
        nobody serves (with --any-model-name, the default model's), 400 when it is absent and
        several models are served."""
        if requested is not None:
            known = self._known_name(requested)
            if known is not None:
                return known
            if not self.config.any_model_name:
                raise self._not_found(requested)
        names = self.names()
        default = self.catalogue.default
        if default is not None:
            return default.name
        if len(names) == 1:
            return names[0]
        if requested is not None:  # --any-model-name, and no model is the default
            raise self._not_found(requested)
        raise invalid_request(
            f"this server serves several models ({', '.join(names)}); say which in `model`",
            "model",
        )

    def _known_name(self, requested: str) -> str | None:
        """The served name of a model named by its name or an alias; None for another name."""
        only = self.catalogue.only
        if only is not None:  # the one-model gateway knows its name and aliases only
            aliases = self.config.model_aliases
            return only.name if requested == only.name or requested in aliases else None
        return requested if requested in self.names() else None

    async def get(self, requested: str | None, *, worker: bool = True) -> ServedModel:
        """The model a request runs on. `worker`: it must be served now (the request goes
        to a worker), so an unloaded one is loaded first; else its vocabulary is enough."""
        name = self.name_of(requested)
        failed = self.catalogue.failed.get(name)
        if failed is not None:
            raise unavailable(f"the model {name!r} is unavailable: {failed}", "model_unavailable")
        if worker:
            self._refuse_unloading(name)
        model = self.catalogue.get(name)
        if model is not None and (not worker or self.pool.unavailable_reason(name) is None):
            return model
        if model is not None and self.manager is None:
            return model  # the request answers the pool's own 503 when it starts
        if self.manager is None:
            raise unavailable(self.pool.unavailable_reason(name) or f"{name} is not ready")
        # A cold load is seconds of the request's time: its own span, not a gap in the trace.
        span = tracing.start_span("gateway.model_load", {"gen_ai.request.model": name})
        try:
            model = await self._load_and_wait(name)
        except BaseException as exc:
            tracing.end(span, error=str(exc) or type(exc).__name__)
            raise
        tracing.end(span)
        return model

    def _refuse_unloading(self, name: str) -> None:
        """503 with Retry-After for a model `serve` unloads: its running requests finish, no
        new one starts on the workers about to stop (the next after the unload loads it)."""
        state = self.manager.states.get(name) if self.manager is not None else None
        if state is not None and state.phase == ModelPhase.UNLOADING:
            raise unavailable(
                f"the model {name!r} is unloading: its running requests finish first; "
                "retry, and it loads again",
                code="model_unloading",
                retry_after=RETRY_AFTER_SECONDS,
            )

    async def _load_and_wait(self, name: str) -> ServedModel:
        """Ask the manager to load the model and wait until a worker serves it. While every
        loaded model is busy (--models-max), the request waits for one to go idle, asking
        again; 503 with Retry-After at the deadline."""
        assert self.manager is not None
        if self.waiting >= self.config.max_waiting_for_load:
            raise _retry_later(f"too many requests wait for models to load; retry {name!r} soon")
        self.waiting += 1
        try:
            deadline = time.monotonic() + self.config.model_load_timeout
            refused = await self._ask_load(name)
            asked_at = time.monotonic()
            while True:
                model = self.catalogue.get(name)
                if model is not None and self.pool.unavailable_reason(name) is None:
                    return model
                state = self.manager.states.get(name)
                if state is not None and state.phase == ModelPhase.UNLOADED and state.error:
                    raise unavailable(f"the model {name!r} failed to load: {state.error}")
                now = time.monotonic()
                if now >= deadline:
                    why = refused or f"it did not load within {self.config.model_load_timeout:g} s"
                    raise _retry_later(f"the model {name!r} cannot be served now: {why}")
                if now - asked_at >= ASK_AGAIN_SECONDS and (
                    refused or state is None or state.phase == ModelPhase.UNLOADED
                ):
                    refused, asked_at = await self._ask_load(name), now
                await asyncio.sleep(WAIT_POLL_SECONDS)
        finally:
            self.waiting -= 1

    async def _ask_load(self, name: str) -> str:
        """Ask the manager to load the model; why it cannot now ("" when it started to)."""
        assert self.manager is not None
        try:
            answer = await self.manager.load(name)
        except ManagerGone as exc:
            raise _retry_later(str(exc)) from None
        if answer.code == "model_not_found":
            raise self._not_found(name)
        return answer.error

    def _not_found(self, name: str) -> APIError:
        listed = ", ".join(f"`{known}`" for known in self.names()) or "none yet"
        return APIError(
            404,
            f"The model `{name}` does not exist; this server serves {listed}.",
            param="model",
            code="model_not_found",
        )

    # --- operators --------------------------------------------------------------

    async def load(self, requested: str) -> ModelEntry:
        """POST /models/load: start the model's worker and wait until it serves."""
        self._need_manager()
        name = self.name_of(requested)
        await self._load_and_wait(name)
        return self.entry(name)

    async def unload(self, requested: str) -> ModelEntry:
        """POST /models/unload: stop the model's worker (its requests finish first)."""
        manager = self._need_manager()
        name = self.name_of(requested)
        try:
            answer = await manager.unload(name)
        except ManagerGone as exc:
            raise _retry_later(str(exc)) from None
        if answer.error:
            raise APIError(409, answer.error, param="model", code=answer.code or "conflict")
        return self.entry(name)

    def _need_manager(self) -> ManagerClient:
        if self.manager is None:
            raise APIError(
                400,
                "this gateway does not start or stop workers: models load and unload with "
                "`loomserve serve` (or by starting and stopping their workers)",
                code="models_not_managed",
            )
        return self.manager

    # --- every model -------------------------------------------------------------

    def names(self) -> list[str]:
        """Every model known: the gateway's files, then workers', then the manager's."""
        names = dict.fromkeys(self.catalogue.names())
        names.update(dict.fromkeys(self.catalogue.failed))
        if self.catalogue.only is None:
            names.update(dict.fromkeys(self.pool.models()))
            if self.manager is not None:
                names.update(dict.fromkeys(self.manager.states))
        return list(names)

    def entry(self, name: str) -> ModelEntry:
        failed = self.catalogue.failed.get(name)
        if failed is not None:
            return ModelEntry(name, ModelState.UNAVAILABLE, None, 0, failed, failed=True)
        ready, _ = self.pool.counts(name)
        info = self.pool.info_of(name)
        if self.catalogue.only is not None:
            ready, _ = self.pool.counts()
            info = self.pool.info_of(None)
        serving = bool(ready) and self.catalogue.get(name) is not None
        phase = (
            self.manager.states[name].phase
            if self.manager and name in self.manager.states
            else None
        )
        state: str
        if phase is not None and phase in (ModelPhase.UNLOADING, ModelPhase.UNLOADED):
            state = phase  # what the manager does wins over a worker still draining
        elif serving:
            state = ModelState.LOADED
        elif phase is not None:
            state = ModelState.LOADING  # its worker is starting, or is not placed yet
        else:
            # No worker of it can take requests: say why (lost, refused, still loading).
            why = self.pool.unavailable_reason(name) or ""
            return ModelEntry(name, ModelState.UNAVAILABLE, None, ready, why)
        return ModelEntry(name, state, info if serving else None, ready)

    def entries(self) -> list[ModelEntry]:
        return [self.entry(name) for name in self.names()]

    def can_serve(self) -> str | None:
        """Why this gateway can serve nothing now (for /health); None while it can: a worker
        is in rotation, or the manager answers and can load what is asked for."""
        reason = self.pool.unavailable_reason()
        if reason is None:
            return None
        if self.manager is not None and self.manager.reachable:
            return None
        return reason

    def export_metrics(self) -> None:
        """Each model's state as a gauge: 1 for its state now, 0 for the others."""
        if self.metrics is None:
            return
        words = (
            ModelState.LOADED,
            ModelState.LOADING,
            ModelState.UNLOADING,
            ModelState.UNLOADED,
            ModelState.UNAVAILABLE,
        )
        for entry in self.entries():
            for word in words:
                self.metrics.model_state.labels(entry.name, word).set(word == entry.state)


def _retry_later(message: str) -> APIError:
    return unavailable(message, code="model_not_loaded", retry_after=RETRY_AFTER_SECONDS)
