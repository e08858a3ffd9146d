"""run_worker: load the model, start the IO thread and the metrics, tick until a signal."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from typing import NoReturn

# llama.cpp's libraries are loaded before pyzmq's on purpose: with a CUDA build of llama.cpp a
# process that had loaded other extension modules first died with SIGSEGV in
# llama_model_load_from_file. The `loomserve` command imports llama_cpp before anything else
# (cli/main.py says what a GPU showed); this order is for code that imports the worker itself.
import llama_cpp  # first, see above
import structlog
import zmq

from ..protocol import PROTOCOL_VERSION, ErrorCode, ModelInfo, WorkerError
from ..protocol.vocab import vocab_fingerprint
from .config import MIB, WorkerConfig
from .engine.embeddings import POOLING_NAMES, Embedder, model_pooling
from .engine.engine import Engine, EngineError
from .engine.media import MediaEncoder
from .engine.vocab_file import compressed_metadata
from .io.channels import Inbox, StatsBoard
from .io.curve import ServerKeys, load_server_keys
from .io.ipc_lock import EndpointInUse, claim_endpoint
from .io.sockets import WorkerIO
from .metrics import WorkerMetrics
from .sampling.grammar_compiler import GrammarCompiler
from .sched.strategies import load_strategy
from .tick.loop import TickLoop
from .tick.watchdog import Watchdog, exit_now

log = structlog.get_logger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BLOCK = 1 << 20  # blocks this large come from mmap and go back to the system on free
EXIT_ENGINE_DEAD = 3  # the status of a worker that gave up on its engine: restart it
# A worker whose settings or model cannot work (a --strategy typo, a key file, a model
# llama.cpp cannot load): `serve`'s supervisor does not restart it (sysexits' EX_CONFIG).
EXIT_CONFIG = os.EX_CONFIG
DEAD_NOTICE_SECONDS = 0.5


def run_worker(config: WorkerConfig) -> None:
    """Serve config.model_path on config.bind until SIGINT or SIGTERM, then exit cleanly."""
    _return_large_blocks()
    # What can fail without the model fails before it loads: a typo in --strategy, a
    # missing key file, an ipc path a live worker serves.
    try:
        load_strategy(config.strategy)
        keys = _server_keys(config)
    except (ValueError, OSError) as exc:
        _cannot_start(exc, EXIT_CONFIG)
    try:
        endpoint_lock = claim_endpoint(config.bind)
    except (OSError, EndpointInUse) as exc:
        _cannot_start(exc, 1)  # the worker holding it may be on its way out: try again
    try:
        engine = Engine(config)
    except (ValueError, EngineError) as exc:
        _cannot_start(exc, EXIT_CONFIG)
    try:
        _serve(config, engine, keys)
    finally:
        engine.close()
        if endpoint_lock is not None:
            endpoint_lock.release()


def _cannot_start(error: Exception, status: int) -> NoReturn:
    log.error("worker cannot start", error=str(error))
    raise SystemExit(status) from error


def _return_large_blocks() -> None:
    """Keep a fixed mmap threshold. glibc's adapts upwards when a large block is freed, after
    which blocks of up to 32 MiB (a peer's 12 MB frames) live in its heap and their memory
    stays with the process: forty such frames left 50-100 MB of RSS behind for good."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator decides
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK)


def _server_keys(config: WorkerConfig) -> ServerKeys | None:
    if config.curve_secret_key_file is None or config.curve_allowed_keys is None:
        return None
    return load_server_keys(config.curve_secret_key_file, config.curve_allowed_keys)


def _serve(config: WorkerConfig, engine: Engine, keys: ServerKeys | None) -> None:
    # IO and the loop share these and the outbox, never each other (channels.py).
    inbox, board = Inbox(), StatsBoard(config.slots)
    media = _media_encoder(config, engine, inbox)
    grammars = GrammarCompiler(engine.grammars, inbox.compiled)  # grammars off the tick
    info = ModelInfo(
        protocol_version=PROTOCOL_VERSION,
        model_name=config.model_name,  # the name gateways serve it under
        vocab_size=engine.n_vocab,
        context_train=engine.description.context_train,
        slot_context=engine.slot_context,
        slots=config.slots,
        vocab_fingerprint=vocab_fingerprint(engine.vocab_tokens()),
        ready=True,
        vision=media is not None,
    )
    _log_start(config, engine, info)
    metrics = WorkerMetrics(config.metrics_tenants) if config.metrics_port is not None else None
    try:
        io = WorkerIO(
            config,
            info,
            inbox,
            board,
            on_gateways=metrics.on_gateways if metrics else None,
            keys=keys,
            on_reject=metrics.on_reject if metrics else None,
            vocab_file=compressed_metadata(config.model_path),
            count_images=media.submit_count if media is not None else None,
        )
    except zmq.ZMQError as exc:
        log.error("cannot bind", bind=config.bind, error=str(exc))
        raise SystemExit(1) from exc
    if media is not None:
        media.answer = io.outbox.post  # counts go straight to the gateway, not via the loop
    embedder = _embedder(config, engine)
    tracer = None
    if config.otlp_endpoint is not None:  # imported only then: off, no OpenTelemetry at all
        from .tick.tracing import RequestTracer

        tracer = RequestTracer(config.model_name)
        if embedder is not None:
            embedder.on_done = tracer.embedded
    loop = TickLoop(
        engine,
        config,
        io.outbox,
        on_tick=metrics.on_tick if metrics else None,
        on_finish=metrics.on_finish if metrics else None,
        on_reject=metrics.on_reject if metrics else None,
        embedder=embedder,
        inbox=inbox,
        board=board,
        tracer=tracer,
        media=media,
        on_media=metrics.on_media if metrics else None,
        grammars=grammars,
    )
    if metrics is not None and config.metrics_port is not None:  # both or neither
        metrics.watch(
            board,
            model_name=config.model_name,
            architecture=engine.description.architecture,
            slots=config.slots,
            slot_context=engine.slot_context,
            io_counters=io.counters,
        )
        metrics.serve(config.metrics_host, config.metrics_port)
        log.info("metrics", url=f"http://{config.metrics_host}:{config.metrics_port}/metrics")

    def on_signal(signum: int, _frame: object) -> None:
        # It runs on the main thread between any two bytecodes, perhaps inside the same calls:
        # only reentrant work here (logging's locks are RLocks; the inbox's put is reentrant).
        log.info(
            "stopping: draining requests",
            signal=signal.Signals(signum).name,
            timeout_s=config.shutdown_timeout,
        )
        io.ready = False
        inbox.stop()

    def on_stuck(why: str) -> None:
        # From the watchdog's thread: the main thread is stuck in the tick and cannot help.
        io.ready = False
        io.outbox.broadcast(WorkerError(ErrorCode.ENGINE_DEAD.value, why))
        time.sleep(DEAD_NOTICE_SECONDS)
        exit_now(EXIT_ENGINE_DEAD)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    io.start()
    watchdog = Watchdog(loop, config.tick_watchdog, config.shutdown_timeout, on_stuck)
    watchdog.start()
    log.info(
        "worker listening",
        bind=io.endpoint,
        slots=config.slots,
        curve=keys is not None,
        allowed_keys=len(keys.allowed) if keys else None,
    )
    try:
        loop.run()  # on this, the main thread, so signals reach it at once
        if loop.dead is not None:
            # Every gateway fails its open requests and answers 503 until we are back.
            io.ready = False
            io.outbox.broadcast(WorkerError(ErrorCode.ENGINE_DEAD.value, loop.dead))
            # Stay connected a moment: a gateway that sees the connection drop before it
            # has read these gives its requests the vaguer "connection closed".
            time.sleep(DEAD_NOTICE_SECONDS)
    finally:
        watchdog.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        io.close()
        if embedder is not None:
            embedder.close()
        if media is not None:
            media.close()
        grammars.close()
        if metrics is not None:
            metrics.close()
        if tracer is not None:
            tracer.close()  # its last spans made; cli/tracing.py exports them on exit
        log.info("worker stopped", ticks=loop.tick_count)
    if loop.dead is not None:
        raise SystemExit(EXIT_ENGINE_DEAD)


def _media_encoder(config: WorkerConfig, engine: Engine, inbox: Inbox) -> MediaEncoder | None:
    """The vision projector and its encoding thread, with --mmproj; a projector libmtmd
    cannot load for this model stops the start."""
    if config.mmproj is None or engine.model is None:  # a closed engine reads nothing
        return None
    try:
        media = MediaEncoder(
            config.mmproj,
            engine.model,
            config.n_threads,
            config.gpu_layers != 0,
            inbox.encoded,
            engine.lend_threads if config.gpu_layers == 0 else None,  # a CPU's threads only
        )
    except ValueError as exc:
        _cannot_start(exc, EXIT_CONFIG)
    log.info(
        "vision projector",
        mmproj=str(config.mmproj),
        whole_image_passes=media.non_causal,
    )
    return media


def _embedder(config: WorkerConfig, engine: Engine) -> Embedder | None:
    """The embedding context: for a model with a pooling head, or mean-pooled on request."""
    pooling = model_pooling(engine)
    if pooling == llama_cpp.LLAMA_POOLING_TYPE_NONE:
        if not config.embeddings:
            return None
        pooling = llama_cpp.LLAMA_POOLING_TYPE_MEAN
    embedder = Embedder(engine, config, pooling)
    log.info(
        "embeddings",
        pooling=POOLING_NAMES.get(pooling, str(pooling)),
        size=embedder.size,
        max_input_tokens=embedder.max_tokens,
    )
    return embedder


def _log_start(config: WorkerConfig, engine: Engine, info: ModelInfo) -> None:
    model = engine.description
    log.info(
        "model loaded",
        model=model.name,
        path=str(config.model_path),
        architecture=model.architecture,
        description=model.description,
        params=f"{model.n_params / 1e6:.1f}M",
        size=f"{model.size_bytes / 2**20:.1f} MiB",
        vocab=model.n_vocab,
        context_train=model.context_train,
        layers=model.n_layers,
        runs_on=model.runs_on,
        threads=config.n_threads,
        threads_from=config.thread_budget.source,  # option, affinity, or a cgroup quota
        vocab_fingerprint=info.vocab_fingerprint[:16],
    )
    log.info(
        "serving",
        slots=config.slots,
        slot_context=engine.slot_context,
        kv_cells=engine.kv_cells_total(),
        kv_cache_type=config.kv_cache_type,
        flash_attn=config.flash_attn,
        # host; graph (llama.cpp's chains) or draw (the C draw) inside llama_decode
        sampling=engine.sampling,
        batch_tokens=config.batch_tokens,
        prefill_chunk=config.prefill_chunk,
        max_queue=config.max_queue,
        strategy=config.strategy,
        batch_invariant=config.batch_invariant,
        cpu_matmul=engine.cpu_matmul,
        cpu_kernels=engine.cpu_kernels,  # loomserve: its kernels swapped into draw passes
    )
    if config.ctx_size > engine.slot_context:
        log.warning(
            "ctx_size capped at the model's training context",
            ctx_size=config.ctx_size,
            slot_context=engine.slot_context,
        )
    if config.cache_ram_clamped:
        log.warning(
            "--cache-ram is more than the memory this worker may use (its cgroup limit or "
            "the RAM); clamped to it",
            cache_ram_mib=config.cache_ram,
            clamped_mib=config.ram_cache_bytes // MIB,
        )
    if config.batch_invariant and config.flash_attn == "off":
        # Without flash attention the softmax sums a row over the whole padded KV window.
        log.warning(
            "batch invariance needs flash attention: with --flash-attn off a greedy output "
            "can differ alone and batched"
        )
