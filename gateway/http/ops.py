"""Operators' views and levers: GET /slots (every worker's slots, as llama-server's /slots,
never any prompt text), GET /status (a live page over /slots and /health, shipped as
status.html), POST /models/load and /models/unload (as llama-server's router mode)."""

from __future__ import annotations

import dataclasses
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse

from loomserve.gateway.api.response_bodies import ModelActionResult, ModelStatus
from loomserve.gateway.api.schemas import ModelAction
from loomserve.gateway.models.registry import ModelEntry, Models
from loomserve.gateway.workers.pool import WorkerPool, WorkerSlots
from loomserve.protocol.messages import SlotsReport, SlotState

# How long a worker may take to answer: its IO thread answers from the loop's latest
# snapshot, without waiting for a tick, so only a dead or unreachable worker takes this long.
SLOTS_TIMEOUT_SECONDS = 2.0


def slots_router(pool: WorkerPool) -> APIRouter:
    """GET /slots; the app puts it behind the API key when keys are set."""
    router = APIRouter()

    @router.get("/slots", tags=["llama.cpp"])
    async def slots(model: str | None = None) -> JSONResponse:
        """Every worker's slots (of `model` only, when given), gathered now: per slot its
        state, request id, tenant, priority, prompt tokens (cached and computed), tokens
        generated, age and tokens/s; per worker its model, health, queue per tenant. Never
        prompt text."""
        workers = await pool.slots(SLOTS_TIMEOUT_SECONDS)
        if model is not None:
            workers = [worker for worker in workers if worker.model == model]
        return JSONResponse({"workers": [worker_body(worker) for worker in workers]})

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
    async def unload(body: ModelAction) -> ModelActionResult:
        """Unload the model: its worker stops taking requests, finishes those it runs, and
        exits. The next request for it loads it again."""
        return result(await models.unload(body.model))

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


def worker_body(worker: WorkerSlots) -> dict[str, Any]:
    """One worker's part of GET /slots."""
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
        body |= _report_body(report)
    return body


def _report_body(report: SlotsReport) -> dict[str, Any]:
    slots = [slot_body(slot) for slot in report.slots]
    return {
        "queue_depth": report.queue_depth,
        "tokens_per_second": round(sum(slot.tokens_per_second for slot in report.slots), 2),
        "tenants": [dataclasses.asdict(tenant) for tenant in report.tenants],
        "slots": slots,
    }


def slot_body(slot: SlotState) -> dict[str, Any]:
    """One slot, in llama-server's terms where it has them (id, is_processing)."""
    busy = slot.state != "idle"
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
