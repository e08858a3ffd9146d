"""A gateway whose event loop is held by a large request must not look dead to its workers:
the keep-alive thread speaks for it. Raw DEALERs stand for two gateways that say Hello and
then go silent for longer than the worker's --gateway-timeout; only the one whose
connection a KeepAlive names is still served afterwards."""

from __future__ import annotations

import time
from pathlib import Path

from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.workers.keepalive import KeepAlive
from loomserve.protocol.messages import (
    Accepted,
    ErrorCode,
    Generate,
    Hello,
    ModelInfo,
    SamplingParams,
    WorkerError,
)
from tests.procs import start_worker
from tests.worker.io.test_socket import answer, dealer

GATEWAY_TIMEOUT = 1.0


def test_a_silent_gateway_kept_alive_by_its_thread_is_still_served(tiny_model_path: Path) -> None:
    with start_worker(tiny_model_path, gateway_timeout=GATEWAY_TIMEOUT) as worker:
        kept, silent = dealer(worker.endpoint, "gw-kept"), dealer(worker.endpoint, "gw-silent")
        assert answer(kept, Hello("gw-kept"), 30, ModelInfo)
        assert answer(silent, Hello("gw-silent"), 30, ModelInfo)
        config = GatewayConfig(
            worker_endpoints=(worker.endpoint,), heartbeat_interval=0.2, worker_timeout=1.0
        )
        keepalive = KeepAlive(config)
        keepalive.watch({worker.endpoint: "gw-kept"})
        keepalive.start()
        try:
            time.sleep(4 * GATEWAY_TIMEOUT)  # both connections say nothing themselves
            assert keepalive.sent >= 5
            request = Generate("r1", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
            assert isinstance(answer(kept, request, 30, Accepted), Accepted)
            lost = answer(silent, Generate("r2", [1, 2, 3], SamplingParams()), 30, WorkerError)
            assert isinstance(lost, WorkerError) and lost.code == ErrorCode.GATEWAY_LOST
        finally:
            keepalive.close()
            kept.close()
            silent.close()
