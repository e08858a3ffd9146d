"""The worker's settings, fixed at start-up."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from ..protocol.settings import setting
from .host_cpus import CpuBudget, thread_budget
from .host_memory import memory_limit_bytes

MIB = 1024**2

# llama-server's default --cache-ram; the worker takes less on a smaller machine or container.
DEFAULT_CACHE_RAM_MIB = 8192

KV_CACHE_TYPES = ("f16", "q8_0")
# "auto" lets llama.cpp use flash attention where the backend has it, as llama-server does.
FLASH_ATTN_MODES = ("auto", "on", "off")
BACKEND_SAMPLING_MODES = ("auto", "on", "draw", "off")
# ggml's CPU matmul for K-quant weights (worker/engine/engine.py: cpu_matmul_environment).
CPU_MATMUL_MODES = ("auto", "dot", "tiled")
CPU_KERNELS = ("loomserve", "ggml")
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


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything the worker needs to load its model and serve it."""

    model_path: Path
    bind: str = setting(
        "tcp://127.0.0.1:5555", help="ZeroMQ endpoint gateways connect to.", alone=True
    )
    # -1: all layers when llama.cpp has a GPU backend
    gpu_layers: int = setting(
        -1,
        help="Layers to offload to the GPU; -1 for all (when built with a GPU backend).",
    )
    # 0: the CPUs this worker may use: its affinity mask, or its cgroup's CPU quota where
    # that is smaller (host_cpus.py)
    threads: int = setting(
        0,
        help="CPU threads for llama.cpp; 0: the CPUs this worker may use (its affinity mask, "
        "or its container's CPU quota where that is smaller).",
    )
    # Fewer threads while other processes take the worker's CPUs (engine/threads.py).
    adaptive_threads: bool = setting(
        True,
        help="Run passes on fewer threads while other processes keep the worker's CPUs busy "
        "(read four times a second), and on all of them again once they are free or it idles: "
        "threads that wait at llama.cpp's barriers for a partner without a core collapse a "
        "pass.",
    )
    # 0: one a llama.cpp thread, up to sampling/samplers.py's MAX_SAMPLING_THREADS
    sampling_threads: int = setting(
        0,
        help="Threads that draw a tick's host-sampled rows; 0: one per llama.cpp thread, at "
        "most a few (docs/sampling.md).",
    )
    flash_attn: str = setting(
        "auto",
        help="Flash attention; auto: where the backend has it, as llama-server does.",
        choices=FLASH_ATTN_MODES,
    )
    backend_sampling: str = setting(
        "auto",
        help=(
            "Sample inside llama_decode for requests without a grammar, logprobs, logit bias "
            "or penalties. draw: the host's C draw on llama.cpp's threads, straight from the "
            "output layer's logits, so llama.cpp copies none (a CPU's output layer; the same "
            "tokens as the host sampler, docs/sampling.md). on: llama.cpp's own sampler chains "
            "(backend sampling), on the device. off: the host sampler. auto: draw where the "
            "output layer runs on the CPU and slots do not draft (--spec-ngram); where the whole "
            "model runs on a GPU, the host sampler, the faster there (docs/gpu.md); otherwise "
            "the host sampler."
        ),
        choices=BACKEND_SAMPLING_MODES,
    )
    kv_cache_type: str = setting(
        "f16",
        help="Data type of the KV cache.",
        choices=KV_CACHE_TYPES,
    )
    slots: int = setting(
        8,
        help="Sequences decoded at once.",
    )
    # tokens of context per slot, capped by the model's training context
    ctx_size: int = setting(
        4096,
        help="Context tokens per slot, capped by the model's training context.",
    )
    max_queue: int = setting(
        64,
        help="Requests that may wait for a slot; beyond that they are rejected.",
    )
    # token budget of one tick's batch
    batch_tokens: int = setting(
        512,
        help="Token budget of one tick's batch.",
    )
    # most prompt tokens one slot prefills in one tick
    prefill_chunk: int = setting(
        512,
        help="Most prompt tokens one slot prefills per tick.",
    )
    # a built-in name or a dotted path to a class
    strategy: str = setting(
        "decode-maximal",
        help=(
            "Batching strategy: decode-maximal, prefill-priority, balanced, or a dotted path to "
            "your own class (package.module:Class)."
        ),
    )
    # While a stream generates, a tick carries only the prompt tokens that keep it within
    # this many milliseconds, by the tick-cost model learned online. None: no target.
    itl_target_ms: float | None = setting(
        None,
        help=(
            "While streams generate, prompt tokens per tick are capped to keep a tick within this "
            "many ms (by a tick-cost model learned online). Default: no target."
        ),
        low=0,
        low_open=True,
    )
    # or "priority": lower Generate.priority first, preempting
    scheduling_policy: str = setting(
        "fcfs",
        help=(
            "fcfs: arrival order. priority: lower request `priority` first; a waiting request "
            "preempts a running one of lower priority."
        ),
        choices=SCHEDULING_POLICIES,
    )
    # GiB of host memory for preempted requests' KV; beyond, recompute
    swap_space: float = setting(
        4.0,
        help="GiB of host memory for preempted requests' KV state; beyond it they recompute.",
        low=0,
    )
    # MiB of host memory for slots' KV kept after their slots were taken (cache/ram_cache.py), a
    # budget apart from swap_space; 0: off. None: llama-server's 8192, but at most a quarter
    # of the memory the worker may use (ram_cache_bytes), so a default worker fits its box.
    cache_ram: int | None = setting(
        None,
        help=(
            "MiB of host memory for prompt caches: a slot's KV state is saved there when the slot "
            "is taken for another request, and restored for a prompt that starts with it (apart "
            "from --swap-space); 0: off. Default: 8192 (as llama-server), at most a quarter of "
            "the memory the worker may use (its cgroup limit or the RAM); more than that memory "
            "is clamped to it, with a warning."
        ),
        low=0,
    )
    # "NAME=W": a tenant's share of slots (default 1)
    tenant_weight: tuple[str, ...] = setting(
        (),
        help="NAME=W: a tenant's weight in the round-robin for free slots (default 1); repeatable.",
    )
    # most running requests of one tenant; 0: no cap
    max_slots_per_tenant: int = setting(
        0,
        help="Most slots one tenant's requests hold at once; 0: no cap.",
        low=0,
    )
    # Prometheus endpoint; None: off
    metrics_port: int | None = setting(
        None,
        help="Serve the worker's Prometheus metrics on this port.",
    )
    metrics_host: str = setting(
        "127.0.0.1",
        help="Address of the metrics endpoint (0.0.0.0 for Prometheus in another container).",
    )
    # The endpoint needs no key: whoever reaches it reads the per-tenant gauges' labels.
    metrics_tenants: str = setting(
        "name",
        help=(
            "How the metrics' per-tenant series name a tenant: name (its API key's name), hash "
            "(a short hash of it, the same on every worker), or off (no per-tenant series)."
        ),
        choices=("name", "hash", "off"),
    )
    # The name gateways serve the model under (they place the worker by it, ModelInfo) and
    # the metrics' model_name label. None: the file's stem.
    served_model_name: str | None = setting(
        None,
        help="The name the model is served under: a gateway sends this worker the requests "
        "whose `model` is this name (and labels the metrics with it). Default: the model "
        "file's name.",
        alone=True,
    )
    heartbeat_interval: float = setting(
        1.0,
        help="Seconds between the worker's heartbeats to each gateway.",
        low=0.01,
        alone=True,
    )
    # Where request traces go, resolved (cli/tracing.py, whose --otlp-endpoint the worker,
    # the gateway and serve share); None: off, and no span is made.
    otlp_endpoint: str | None = None
    # A gateway silent this long is gone and its requests are cancelled (its slots freed
    # within a tenth of this more). Gateways ping every second by default.
    gateway_timeout: float = setting(
        3.0,
        help="Seconds a gateway may be silent before its requests are cancelled.",
        low=0.1,
    )
    # This many ticks failing in a row mean the engine is broken: the worker tells every
    # gateway, and exits (status 3) for its supervisor to restart it. One failing tick
    # fails only the requests it ran.
    max_failed_ticks: int = setting(
        3,
        help=(
            "Ticks failing in a row after which the worker declares its engine dead and exits "
            "(status 3) to be restarted."
        ),
        low=1,
    )
    # A tick that has used no CPU for this many seconds is stuck (waiting for what will not
    # come); one that keeps using CPU is slow (a starved host) and may run 10 times as long
    # (watchdog.py). Stuck, the worker says it is not ready, tells every gateway, and exits
    # (status 3) for its supervisor to restart it.
    tick_watchdog: float = setting(
        30.0,
        help=(
            "Seconds a tick may run without using CPU before the worker calls it stuck, "
            "declares its engine dead and exits (status 3) to be restarted; a tick that keeps "
            "using CPU (a slow pass on a starved host) may run 10 times as long."
        ),
        low=1.0,
    )
    # On SIGTERM, running and queued requests get this long to finish; the rest are
    # cancelled with an error. New requests are refused meanwhile.
    shutdown_timeout: float = setting(
        5.0,
        help="On SIGTERM, seconds running requests get to finish before they are cancelled.",
        low=0,
        alone=True,
    )
    # one structured log event per tick
    log_ticks: bool = setting(
        False,
        help="Log one structured event per tick.",
    )
    # A request's greedy output must not depend on what shares its batch: give each slot its
    # own KV stream and use CPU kernels that compute every row alike (see Engine). Off: one
    # KV cache shared by all slots and the fastest kernels.
    batch_invariant: bool = setting(
        True,
        help=(
            "Greedy output the same alone and batched: a KV stream per slot and per-row CPU "
            "kernels. Off: one KV cache shared by all slots and the fastest kernels."
        ),
    )
    # Which of ggml's CPU kernels multiply K-quant weights (Q4_K, Q6_K, ...). Both "dot" and
    # "tiled" compute a row alike whatever shares its pass, so both keep batch invariance;
    # ggml's own choice (tiled from 8 rows up, dot products below) does not.
    cpu_matmul: str = setting(
        "auto",
        help=(
            "CPU kernel for quantized (K-quant) weights: dot, ggml's dot product a row, which "
            "passes that draw run as loomserve's AVX-512 VNNI kernel (the same numbers, the "
            "fastest there for any number of streams); tiled, ggml's tiled matmul for every "
            "pass, one row included (ggml's fastest for many streams and long prompts); both "
            "batch-invariant. auto: dot with --batch-invariant, else ggml's own choice, tiled "
            "from 8 rows up (docs/scheduling.md)."
        ),
        choices=CPU_MATMUL_MODES,
    )
    cpu_kernels: str = setting(
        "loomserve",
        help=(
            "Whose kernels multiply the quantized weights (Q8_0, Q5_0, Q4_0, Q4_K, Q5_K, Q6_K) "
            "in passes that draw inside llama_decode: loomserve, its kernels, ggml's numbers "
            "to the bit, sooner (with AVX-512 VNNI, every type from two rows up; with AVX2, "
            "Q8_0 by up to 8 rows, decodes of up to 8 sequences; on a llama.cpp loomserve has "
            "verified); ggml, ggml's own (docs/sampling.md)."
        ),
        choices=CPU_KERNELS,
    )
    # Self-speculative n-gram drafting in the tick (worker/sched/speculation.py): each generating
    # slot may draft up to num_speculative_tokens tokens that followed an earlier occurrence
    # of its last prompt_lookup_min..max tokens, where the tick-cost model says they pay.
    # None: on without batch invariance, off with it. It never lost a measured load, but a
    # verified draft is one of several rows of its sequence in a ubatch, which the CPU
    # kernels sum in another order than a lone decode row: greedy output would depend on the
    # batch in its last bits, which batch invariance promises it does not
    # (docs/speculation.md).
    spec_ngram: bool | None = setting(
        None,
        help=(
            "Self-speculative n-gram drafting: generating slots draft tokens that followed an "
            "earlier occurrence of their last tokens, verified in the same pass where the learned "
            "tick cost says they pay. Default: on with --no-batch-invariant; off with "
            "--batch-invariant, whose promise it would break (a verified row's logits differ from "
            "a lone decode's in their last bits)."
        ),
    )
    num_speculative_tokens: int = setting(
        16,
        help="Most drafted tokens per slot and tick.",
        low=1,
    )
    prompt_lookup_min: int = setting(
        2,
        help="Shortest n-gram matched to draft from.",
        low=1,
    )
    prompt_lookup_max: int = setting(
        4,
        help="Longest n-gram matched to draft from (the longest match wins).",
        low=1,
    )
    # /v1/embeddings for a model without a pooling head, mean-pooled, in a second context
    # (worker/engine/embeddings.py); a model with a pooling head serves them whatever this says.
    embeddings: bool = setting(
        False,
        help=(
            "Serve /v1/embeddings (mean pooling) for a model without a pooling head; a model with "
            "one serves them anyway."
        ),
    )
    # A vision projector (llama.cpp's mmproj GGUF) for the model: the worker then reads
    # images (worker/engine/media.py); without one an image part is a 400 at the gateway.
    mmproj: Path | None = setting(
        None,
        help="Vision projector (mmproj GGUF) for the model: requests may carry images. Under "
        "serve, NAME=PATH (repeatable) gives the model served as NAME its projector.",
        path="file",
        alone=True,  # serve has its own --mmproj, NAME=PATH for one of several models
    )
    # CURVE: the worker's certificate (a zmq.auth .key_secret file) and the gateways it lets
    # in (a .key file or a directory of them). Without them anything that reaches bind is
    # a gateway, so a bind beyond this machine needs them, or insecure_bind.
    curve_secret_key_file: Path | None = setting(
        None,
        help="The worker's CURVE certificate (.key_secret); with --curve-allowed-keys, CURVE "
        "is on.",
        path="file",
        alone=True,
    )
    curve_allowed_keys: Path | None = setting(
        None,
        help="Public certificates of the gateways let in: one .key file, or a directory of them.",
        path="any",
        alone=True,
    )
    insecure_bind: bool = setting(
        False,
        help="Allow a --bind other machines can reach without CURVE: anyone there is a gateway.",
        negatable=False,
        alone=True,
    )

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
        if self.sampling_threads < 0:
            raise ValueError("sampling_threads must not be negative")
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        if self.flash_attn not in FLASH_ATTN_MODES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_MODES)}")
        if self.cpu_matmul not in CPU_MATMUL_MODES:
            raise ValueError(f"cpu_matmul must be one of {', '.join(CPU_MATMUL_MODES)}")
        if self.backend_sampling not in BACKEND_SAMPLING_MODES:
            raise ValueError(f"backend_sampling must be one of {', '.join(BACKEND_SAMPLING_MODES)}")
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
        """The name the model is served under: --served-model-name (its first name, where
        serve's gateways take aliases after it: NAME,ALIAS,...), else the file's stem."""
        if self.served_model_name:
            return self.served_model_name.split(",")[0].strip()
        return self.model_path.stem

    @property
    def n_threads(self) -> int:
        """llama.cpp's threads: --threads, else the CPUs this worker may use (host_cpus.py)."""
        return self.thread_budget.count

    @property
    def thread_budget(self) -> CpuBudget:
        """n_threads and where it came from (the option, the affinity mask, a CPU quota)."""
        return thread_budget(self.threads)
