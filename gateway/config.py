"""The gateway's settings, fixed at start-up."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from loomserve.gateway.endpoints import split_tcp
from loomserve.protocol.messages import DEFAULT_TENANT as DEFAULT_TENANT

_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


def unnamed_key_tenant(key: str) -> str:
    """The tenant of a key given without a name: a short hash, never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_key_line(line: str) -> tuple[str, str]:
    """(key, tenant) from an --api-key-file line: `name:key`, or a bare key."""
    name, sep, key = line.partition(":")
    if sep and key and _KEY_NAME.fullmatch(name):
        return key, name
    return line, unnamed_key_tenant(line)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything one gateway process needs: where the workers are, and how to speak HTTP."""

    model_path: Path  # the gateway loads the vocabulary only, to own the text
    # The workers' ROUTER endpoints; a tcp:// host name stands for each address it resolves to.
    worker_endpoints: tuple[str, ...] = ("tcp://127.0.0.1:5555",)
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # served name in /v1/models; default: the file's stem
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> its tenant; empty: no auth
    chat_template: str | None = None  # a Jinja template overriding the model's own
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API
    max_body_bytes: int = 8 * 1024 * 1024
    heartbeat_interval: float = 1.0
    worker_timeout: float = 3.0  # no heartbeat this long: the worker is gone
    request_timeout: float = 600.0  # a generation running longer ends with a 504
    shutdown_timeout: float = 5.0  # on SIGTERM, open streams get this long before they are cut
    # CURVE, for a worker that has it: the worker's public certificate (.key) and this
    # gateway's own (.key_secret), whose public key the worker's allow-list must hold.
    curve_server_key_file: Path | None = None
    curve_secret_key_file: Path | None = None
    header_timeout: float = 10.0  # a connection's request headers must arrive within this
    body_timeout: float = 60.0  # and its body within this after them, or 408
    # Tokens of one sequence the gateway holds for a client that does not read them (its
    # socket is full); past this the request is cancelled in the worker, freeing its slot.
    stream_buffer_tokens: int = 2048
    # The GGUF's general.sampling.* (temperature, top_k, top_p, min_p, repeat penalty) fill
    # the fields a request leaves out, as vLLM's --generation-config auto; False: neutral.
    model_sampling_defaults: bool = True

    def __post_init__(self) -> None:
        if not self.worker_endpoints:
            raise ValueError("at least one worker endpoint is needed")
        for endpoint in self.worker_endpoints:
            split_tcp(endpoint)  # a malformed tcp:// endpoint fails here, not at connect time
        if self.heartbeat_interval <= 0 or self.worker_timeout <= 0:
            raise ValueError("heartbeat_interval and worker_timeout must be positive")
        if self.worker_timeout < self.heartbeat_interval:
            raise ValueError("worker_timeout must be at least heartbeat_interval")
        if (self.curve_server_key_file is None) != (self.curve_secret_key_file is None):
            raise ValueError("curve_server_key_file and curve_secret_key_file go together")
        if self.header_timeout <= 0 or self.body_timeout <= 0:
            raise ValueError("header_timeout and body_timeout must be positive")
        if self.stream_buffer_tokens < 1:
            raise ValueError("stream_buffer_tokens must be at least 1")
        if self.max_body_bytes < 1 or self.request_timeout <= 0 or self.shutdown_timeout < 0:
            raise ValueError("body size and timeouts must be positive")

    @property
    def served_model_name(self) -> str:
        return self.model_name or self.model_path.stem
