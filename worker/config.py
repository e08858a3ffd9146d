"""The worker's settings, fixed at start-up."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

MIB = 1024**2

# llama-server's default --cache-ram; the worker takes less on a smaller machine or container.
DEFAULT_CACHE_RAM_MIB = 8192

KV_CACHE_TYPES = ("f16", "q8_0")
# "auto" lets llama.cpp use flash attention where the backend has it, as llama-server does.
FLASH_ATTN_MODES = ("auto", "on", "off")
SCHEDULING_POLICIES = ("fcfs", "priority")


def is_local_endpoint(endpoint: str) -> bool:
    """Whether only this machine can reach the endpoint: ipc, inproc, or tcp on loopback."""
    transport, _, address = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # *, a host name or an interface name: it may face the network
        return False


# How much memory this process may use: its cgroup's limit (a container's, a pod's), else the
# machine's RAM. The RAM prompt cache's default budget is a share of it, so that a default
# worker never outgrows the container it runs in.
# cgroup v2, then v1; "max" (v2) or a huge number (v1) means no limit.
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit_bytes(cgroup_files: tuple[Path, ...] = CGROUP_LIMITS) -> int:
    """The smaller of the machine's RAM and the cgroup's memory limit, if it has one."""
    physical = physical_memory_bytes()
    for path in cgroup_files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(physical, int(text))
        return physical  # "max": no limit at this level
    return physical


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything the worker needs to load its model and serve it."""

    model_path: Path
    bind: str = "tcp://127.0.0.1:5555"  # the ROUTER endpoint gateways connect to
    gpu_layers: int = -1  # -1: all layers when llama.cpp has a GPU backend
    threads: int = 0  # 0: the machine's cores
    flash_attn: str = "auto"
    kv_cache_type: str = "f16"
    slots: int = 8
    ctx_size: int = 4096  # tokens of context per slot, capped by the model's training context
    max_queue: int = 64
    batch_tokens: int = 512  # token budget of one tick's batch
    prefill_chunk: int = 512  # most prompt tokens one slot prefills in one tick
    strategy: str = "decode-maximal"  # a built-in name or a dotted path to a class
    # While a stream generates, a tick carries only the prompt tokens that keep it within
    # this many milliseconds, by the tick-cost model learned online. None: no target.
    itl_target_ms: float | None = None
    scheduling_policy: str = "fcfs"  # or "priority": lower Generate.priority first, preempting
    swap_space: float = 4.0  # GiB of host memory for preempted requests' KV; beyond, recompute
    # MiB of host memory for slots' KV kept after their slots were taken (cache/ram_cache.py), a
    # budget apart from swap_space; 0: off. None: llama-server's 8192, but at most a quarter
    # of the memory the worker may use (ram_cache_bytes), so a default worker fits its box.
    cache_ram: int | None = None
    tenant_weight: tuple[str, ...] = ()  # "NAME=W": a tenant's share of slots (default 1)
    max_slots_per_tenant: int = 0  # most running requests of one tenant; 0: no cap
    metrics_port: int | None = None  # Prometheus endpoint; None: off
    metrics_host: str = "127.0.0.1"
    # The model's name in the metrics' model_name label: the gateways' served name, so both
    # sides label it alike (`serve` gives both the same). None: the file's stem, as theirs.
    served_model_name: str | None = None
    heartbeat_interval: float = 1.0  # seconds between heartbeats to each gateway
    # A gateway silent this long is gone and its requests are cancelled (its slots freed
    # within a tenth of this more). Gateways ping every second by default.
    gateway_timeout: float = 3.0
    # This many ticks failing in a row mean the engine is broken: the worker tells every
    # gateway, and exits (status 3) for its supervisor to restart it. One failing tick
    # fails only the requests it ran.
    max_failed_ticks: int = 3
    # A tick running longer than this many seconds is stuck (a native call that never
    # returns): the worker says it is not ready, tells every gateway, and exits (status 3)
    # for its supervisor to restart it (watchdog.py).
    tick_watchdog: float = 30.0
    # On SIGTERM, running and queued requests get this long to finish; the rest are
    # cancelled with an error. New requests are refused meanwhile.
    shutdown_timeout: float = 5.0
    log_ticks: bool = False  # one structured log event per tick
    # A request's greedy output must not depend on what shares its batch: give each slot its
    # own KV stream and use CPU kernels that compute every row alike (see Engine). Off: one
    # KV cache shared by all slots and the fastest kernels.
    batch_invariant: bool = True
    # Self-speculative n-gram drafting in the tick (worker/sched/speculation.py): each generating
    # slot may draft up to num_speculative_tokens tokens that followed an earlier occurrence
    # of its last prompt_lookup_min..max tokens, where the tick-cost model says they pay.
    # None: on without batch invariance, off with it. It never lost a measured load, but a
    # verified draft is one of several rows of its sequence in a ubatch, which the CPU
    # kernels sum in another order than a lone decode row: greedy output would depend on the
    # batch in its last bits, which batch invariance promises it does not
    # (docs/speculation.md).
    spec_ngram: bool | None = None
    num_speculative_tokens: int = 16
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # /v1/embeddings for a model without a pooling head, mean-pooled, in a second context
    # (worker/engine/embeddings.py); a model with a pooling head serves them whatever this says.
    embeddings: bool = False
    # CURVE: the worker's certificate (a zmq.auth .key_secret file) and the gateways it lets
    # in (a .key file or a directory of them). Without them anything that reaches bind is
    # a gateway, so a bind beyond this machine needs them, or insecure_bind.
    curve_secret_key_file: Path | None = None
    curve_allowed_keys: Path | None = None
    insecure_bind: bool = False

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        if self.ctx_size < 8:
            raise ValueError("ctx_size must be at least 8")
        if self.max_queue < 0:
            raise ValueError("max_queue must not be negative")
        if self.batch_tokens < self.slots:
            raise ValueError("batch_tokens must leave room for one decode token per slot")
        if self.max_failed_ticks < 1:
            raise ValueError("max_failed_ticks must be at least 1")
        if self.tick_watchdog < 1:
            raise ValueError("tick_watchdog must be at least 1 second")
        if self.shutdown_timeout < 0 or self.gateway_timeout <= 0:
            raise ValueError("shutdown_timeout and gateway_timeout must not be negative")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        if self.flash_attn not in FLASH_ATTN_MODES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_MODES)}")
        if self.kv_cache_type not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}")
        if (self.curve_secret_key_file is None) != (self.curve_allowed_keys is None):
            raise ValueError("curve_secret_key_file and curve_allowed_keys go together")
        if self.curve_secret_key_file is None and not (
            self.insecure_bind or is_local_endpoint(self.bind)
        ):
            raise ValueError(
                f"{self.bind} can be reached from other machines, and without CURVE anything "
                "that reaches it is a gateway: give --curve-secret-key-file and "
                "--curve-allowed-keys (`loomserve keygen` makes them), or --insecure-bind"
            )
        if self.itl_target_ms is not None and self.itl_target_ms <= 0:
            raise ValueError("itl_target_ms must be positive")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.swap_space < 0 or self.max_slots_per_tenant < 0 or (self.cache_ram or 0) < 0:
            raise ValueError("swap_space, cache_ram and max_slots_per_tenant must not be negative")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at least 1 and at most prompt_lookup_max")
        self.tenant_weights  # noqa: B018 -- parses them, raising ValueError on a bad one

    @property
    def ram_cache_bytes(self) -> int:
        """The RAM prompt cache's budget in bytes: --cache-ram (at most the memory the worker
        may use: a budget beyond it is a typo, and would be spent until the OOM killer
        came), or its default."""
        if self.cache_ram is not None:
            return min(self.cache_ram * MIB, memory_limit_bytes())
        return min(DEFAULT_CACHE_RAM_MIB * MIB, memory_limit_bytes() // 4)

    @property
    def cache_ram_clamped(self) -> bool:
        """Whether --cache-ram asked for more than the memory the worker may use."""
        return self.cache_ram is not None and self.cache_ram * MIB > self.ram_cache_bytes

    @property
    def speculates(self) -> bool:
        """Whether slots draft: --spec-ngram, or by default wherever batch invariance is off."""
        return self.spec_ngram if self.spec_ngram is not None else not self.batch_invariant

    @property
    def tenant_weights(self) -> dict[str, float]:
        """--tenant-weight NAME=W settings as a mapping."""
        weights = {}
        for spec in self.tenant_weight:
            name, sep, value = spec.rpartition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = 0.0
            if not sep or not name or not weight > 0 or weight == float("inf"):
                raise ValueError(f"tenant weights are NAME=W with W > 0, got {spec!r}")
            weights[name] = weight
        return weights

    @property
    def model_name(self) -> str:
        """The name the model is served under: --served-model-name, else the file's stem."""
        return self.served_model_name or self.model_path.stem

    @property
    def n_threads(self) -> int:
        return self.threads or os.cpu_count() or 1
