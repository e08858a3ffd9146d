"""run_gateway: load the vocabulary, connect to the workers, serve HTTP until SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

# Before anything imports zmq: see the note on this import in worker/server.py.
import llama_cpp  # noqa: F401
import structlog
import uvicorn

from ..config import GatewayConfig
from ..metrics import GatewayMetrics, mark_dead
from ..models.catalogue import Catalogue
from ..models.manager import ManagerClient
from ..serving.drain import Drain
from ..workers.pool import WorkerPool
from .app import create_app
from .http_protocol import HeaderTimeoutProtocol

log = structlog.get_logger(__name__)

EXIT_CONFIG = os.EX_CONFIG  # 78: the settings or the model are at fault; a restart cannot help


def run_gateway(config: GatewayConfig, sockets: list[socket.socket] | None = None) -> None:
    """Serve on config.host:config.port, or on pre-bound sockets (several gateways, one port).

    A model whose vocabulary or chat template cannot be loaded ends the process with
    EXIT_CONFIG after one log line, which tells `serve`'s supervisor not to restart it."""
    try:  # a model file's vocabulary or chat template
        catalogue = Catalogue(config)
    except ValueError as exc:
        _cannot_start(exc)
    try:
        metrics = GatewayMetrics()
        pool = WorkerPool(config, catalogue, metrics)
        manager = ManagerClient(config.models_control) if config.models_control else None
        app = create_app(config, catalogue, pool, metrics, manager)
        if sockets:
            listen = [_address(s) for s in sockets]
        else:
            listen = [f"http://{config.host}:{config.port}"]
        log.info(
            "gateway starting",
            listen=listen,
            workers=list(config.worker_endpoints),
            models=catalogue.names() or "learned from the workers",
            gateway_id=pool.identity,
            auth=bool(config.api_keys),
        )
        server = DrainingServer(
            app.state.chat.drain,
            config.shutdown_timeout,
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_config=None,  # uvicorn's lines go through our structlog handler
                access_log=False,  # AccessMiddleware logs each request with its id
                lifespan="on",
                # The drain already waited: what is left gets a moment, then is cut.
                timeout_graceful_shutdown=2,  # seconds
                http=HeaderTimeoutProtocol.with_header_timeout(config.header_timeout),
            ),
        )
        with _exit_cleanly_on_signals():
            server.run(sockets=sockets)
        log.info("gateway stopped")
    finally:
        mark_dead(os.getpid())
        catalogue.close()


def _cannot_start(error: ValueError) -> NoReturn:
    log.error("gateway cannot start", error=str(error))
    raise SystemExit(EXIT_CONFIG) from error


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT before its own shutdown (drain.py).

    uvicorn alone stops listening at once and cuts the streams that outlive its graceful
    timeout without a word. A second signal stops at once, as uvicorn does.
    """

    def __init__(self, drain: Drain, timeout: float, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout = timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:
            super().handle_exit(sig, frame)
            return
        self.drain.start(self.drain_timeout)

    async def on_tick(self, counter: int) -> bool:
        stop = await super().on_tick(counter)
        return stop or self.drain.done()


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


@contextlib.contextmanager
def _exit_cleanly_on_signals() -> Iterator[None]:
    """Let SIGTERM/SIGINT end run_gateway with a normal return, after uvicorn's shutdown."""
    # uvicorn re-raises the signal to the handler it found once it has shut down; the
    # default one would kill the process (or raise KeyboardInterrupt) before our clean-up.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
