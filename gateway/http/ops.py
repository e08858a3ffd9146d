"""Operators' views and levers: GET /slots (every worker's slots, as llama-server's /slots,
never any prompt text), GET /status (a live page over /slots and /health, shipped as
status.html), POST /models/load and /models/unload (as llama-server's router mode)."""

from __future__ import annotations

import dataclasses
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from ...protocol.messages import SlotsReport, SlotState
from ..api.response_bodies import (
    ModelActionResult,
    ModelStatus,
    ModelUnloadResult,
)
from ..api.schemas import ModelAction
from ..models.registry import ModelEntry, Models, ModelState
from ..workers.pool import WorkerPool, WorkerSlots

# How long a worker may take to answer: its IO thread answers from the loop's latest
# snapshot, without waiting for a tick, so only a dead or unreachable worker takes this long.
SLOTS_TIMEOUT_SECONDS = 2.0


def slots_router(pool: WorkerPool) -> APIRouter:
    """GET /slots; the app puts it behind the API key when keys are set."""
    router = APIRouter()

    @router.get("/slots", tags=["llama.cpp"])
    async def slots(request: Request, model: str | None = None) -> JSONResponse:
        """Every worker's slots (of `model` only, when given), gathered now: per slot its
        state, request id, tenant, priority, prompt tokens (cached and computed), tokens
        generated, age and tokens/s; per worker its model, health, queue per tenant. Never
        prompt text. With API keys, a key sees its own tenant's requests, and of the others'
        only that slots are busy and how many wait; an admin key sees all."""
        workers = await pool.slots(SLOTS_TIMEOUT_SECONDS)
        if model is not None:
            workers = [worker for worker in workers if worker.model == model]
        viewer = _viewer(request)
        return JSONResponse({"workers": [worker_body(worker, viewer) for worker in workers]})

    return router


def models_router(models: Models) -> APIRouter:
    """POST /models/load and /models/unload, for `serve`'s models; behind the API key."""
    router = APIRouter()

    def result(entry: ModelEntry) -> ModelActionResult:
        return ModelActionResult(model=entry.name, status=ModelStatus(value=entry.state))

    @router.post("/models/load", tags=["models"])
    async def load(body: ModelAction) -> ModelActionResult:
        """Load the model now (evicting the least recently used idle one past
        --models-max); answers once it serves. 400 when the server does not manage its
        workers (a gateway on its own), 503 with Retry-After when it cannot load in time."""
        return result(await models.load(body.model))

    @router.post("/models/unload", tags=["models"])
    async def unload(body: ModelAction) -> ModelUnloadResult:
        """Unload the model, answering at once: new requests for it get 503 with Retry-After
        while its running requests finish (up to serve's --unload-drain seconds), then its
        workers exit. The next request after that loads it again."""
        entry = await models.unload(body.model)
        if entry.state == ModelState.UNLOADING:
            message = (
                f"{entry.name} is unloading: new requests for it get 503 with Retry-After "
                "while its running requests finish (up to --unload-drain seconds); then its "
                "workers stop"
            )
        else:
            message = f"{entry.name} is {entry.state}"
        return ModelUnloadResult(
            model=entry.name, status=ModelStatus(value=entry.state), message=message
        )

    return router


def status_router() -> APIRouter:
    """GET /status: a static page; what it shows it fetches from /slots and /health."""
    router = APIRouter()
    page = (
        resources.files("loomserve.gateway.http")
        .joinpath("status.html")
        .read_text(encoding="utf-8")
    )

    @router.get("/status", tags=["probes"], response_class=HTMLResponse)
    async def status() -> HTMLResponse:
        """A live page of the workers, their slots, queues and tokens/s (HTML, no assets)."""
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    return router


def _viewer(request: Request) -> str | None:
    """The tenant whose requests alone /slots may show; None: every tenant's (no API keys,
    or an admin's key)."""
    state = request.state
    if getattr(state, "admin", False):
        return None
    return getattr(state, "tenant", None)


def worker_body(worker: WorkerSlots, viewer: str | None = None) -> dict[str, Any]:
    """One worker's part of GET /slots; with a viewer, only that tenant's requests are named."""
    info, beat, report = worker.info, worker.heartbeat, worker.report
    body: dict[str, Any] = {
        "endpoint": worker.endpoint,
        "model": worker.model or (info.model_name if info is not None else None),
        "status": "ok" if worker.unavailable is None else "unavailable",
        "reason": worker.unavailable,
        "slots_total": info.slots if info is not None else None,
        "slot_context": info.slot_context if info is not None else None,
        "error": worker.error,
    }
    if beat is not None:
        body |= {"slots_idle": beat.load.free_slots, "slots_processing": beat.load.running}
    if report is not None:
        body |= _report_body(report, viewer)
    return body


def _report_body(report: SlotsReport, viewer: str | None) -> dict[str, Any]:
    slots = [slot_body(slot, viewer) for slot in report.slots]
    tenants = [dataclasses.asdict(tenant) for tenant in report.tenants]
    if viewer is not None:
        # The other tenants' requests as one anonymous count: how busy, never whose.
        others = [tenant for tenant in tenants if tenant["tenant"] != viewer]
        tenants = [tenant for tenant in tenants if tenant["tenant"] == viewer]
        if others:
            running = sum(tenant["running"] for tenant in others)
            waiting = sum(tenant["waiting"] for tenant in others)
            tenants.append({"tenant": None, "running": running, "waiting": waiting})
    return {
        "queue_depth": report.queue_depth,
        "tokens_per_second": round(sum(slot.tokens_per_second for slot in report.slots), 2),
        "tenants": tenants,
        "slots": slots,
    }


# A busy slot of a tenant the viewer is not: what it runs, for whom and how far, is not said.
HIDDEN_FIELDS = (
    "request_id",
    "gateway",
    "tenant",
    "priority",
    "prompt_tokens",
    "cached_tokens",
    "computed_tokens",
    "generated_tokens",
    "age_seconds",
    "tokens_per_second",
)


def slot_body(slot: SlotState, viewer: str | None = None) -> dict[str, Any]:
    """One slot, in llama-server's terms where it has them (id, is_processing); a busy slot
    of another tenant than the viewer's (when there is one) with its details left null."""
    busy = slot.state != "idle"
    if busy and viewer is not None and slot.tenant != viewer:
        return {
            "id": slot.index,
            "state": slot.state,
            "is_processing": True,
            **dict.fromkeys(HIDDEN_FIELDS),
        }
    return {
        "id": slot.index,
        "state": slot.state,
        "is_processing": busy,
        "request_id": slot.request_id if busy else None,
        "gateway": slot.gateway if busy else None,
        "tenant": slot.tenant if busy else None,
        "priority": slot.priority,
        "prompt_tokens": slot.prompt_tokens,
        "cached_tokens": slot.cached_tokens,
        "computed_tokens": slot.computed_tokens,
        "generated_tokens": slot.generated_tokens,
        "age_seconds": round(slot.age_seconds, 3),
        "tokens_per_second": round(slot.tokens_per_second, 2),
    }
