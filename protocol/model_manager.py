"""The messages between gateways and `loomserve serve`'s model manager."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

# `loomserve serve` with several models owns their workers; its gateways ask it for a model
# that is not loaded, and operators unload one, through these (answered by ModelStates).


class ModelPhase(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"  # its worker is starting
    LOADED = "loaded"
    UNLOADING = "unloading"  # its worker drains and exits


# Each question also says which models have requests in flight in the asking gateway (`busy`):
# the manager never evicts one of them, nor stops an unloading one before they end. The
# workers' heartbeats lag what the gateway knows (a request sent is not yet a running one).


@dataclass(slots=True)
class LoadModel:
    """Start the model's worker (evicting the least recently used idle one past the cap)."""

    name: str
    busy: list[str] = field(default_factory=list)


@dataclass(slots=True)
class UnloadModel:
    """Stop the model's worker (its requests in flight finish first)."""

    name: str
    busy: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ModelsQuery:
    """What models the manager has, and their phases."""

    busy: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ModelState:
    name: str
    phase: str  # a ModelPhase value
    endpoint: str  # its worker's address
    since: float  # time.time() it entered this phase
    error: str = ""  # why its latest load failed


@dataclass(slots=True)
class ModelStates:
    """The manager's models; `error` says why a LoadModel or UnloadModel was refused."""

    models: list[ModelState]
    error: str = ""
    code: str = ""  # "model_not_found", "models_busy" (no room: every loaded one is busy)
