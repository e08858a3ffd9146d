"""The gateway's settings, fixed at start-up."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..protocol.messages import DEFAULT_TENANT as DEFAULT_TENANT
from ..protocol.settings import setting
from .endpoints import split_tcp

_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


def unnamed_key_tenant(key: str) -> str:
    """The tenant of a key given without a name: a short hash, never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


_PRIORITY_RANGE = re.compile(r"(-?\d+)?\.\.(-?\d+)?|(-?\d+)")


@dataclass(frozen=True, slots=True)
class PriorityRange:
    """The priorities one API key's requests may claim (lower is served first); None: open."""

    best: int | None = None  # the most urgent (lowest) priority the key may claim
    worst: int | None = None  # the least urgent (highest)

    def clamp(self, priority: int) -> int:
        """The priority, moved into the range (a request beyond it gets the nearest bound)."""
        if self.best is not None and priority < self.best:
            return self.best
        if self.worst is not None and priority > self.worst:
            return self.worst
        return priority


def check_api_key(key: str) -> str:
    """The key as given; ValueError for an empty one or one with whitespace in it.

    A key means the same from --api-key, LOOMSERVE_API_KEY and a key file only if none of
    them can split it: whitespace separates keys (and their settings) there, so no key has it.
    """
    if not key:
        raise ValueError("an API key cannot be empty")
    if any(char.isspace() for char in key):
        raise ValueError(
            "API keys cannot contain whitespace; give each key on its own "
            "(LOOMSERVE_API_KEY takes several one per line)"
        )
    if not key.isprintable():
        raise ValueError("API keys must be printable characters (they travel in a header)")
    return key


def parse_key_line(line: str) -> tuple[str, str]:
    """(key, tenant) from an --api-key-file line's first word: `name:key`, or a bare key."""
    name, sep, key = line.partition(":")
    if sep and not key and _KEY_NAME.fullmatch(name):
        # `carol:` reads as a tenant whose key was left out, not as the key "carol:" (the
        # line is not echoed: it might be a key after all).
        raise ValueError("a name and ':' with no key after it; write name:key")
    if sep and key and _KEY_NAME.fullmatch(name):
        return check_api_key(key), name
    return check_api_key(line), unnamed_key_tenant(line)


def parse_priority_range(text: str) -> PriorityRange:
    """`MIN..MAX`, `MIN..`, `..MAX` or `N` (exactly N); ValueError otherwise."""
    match = _PRIORITY_RANGE.fullmatch(text)
    if match is None or text == "..":
        raise ValueError(f"priority={text!r}: write MIN..MAX, MIN.., ..MAX or one integer")
    low, high, exact = match.groups()
    if exact is not None:
        low = high = exact
    best, worst = (int(low) if low else None), (int(high) if high else None)
    if any(bound is not None and abs(bound) >= 2**31 for bound in (best, worst)):
        raise ValueError(f"priority={text!r}: priorities are 32-bit integers")
    if best is not None and worst is not None and best > worst:
        raise ValueError(f"priority={text!r}: MIN is more than MAX")
    return PriorityRange(best, worst)


def parse_template_kwargs(text: str) -> dict[str, Any]:
    """--chat-template-kwargs as a dict ("" for none); ValueError when not a JSON object."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    return value


def served_names(text: str) -> list[str]:
    """The names of a --served-model-name value: the name, then its aliases."""
    return [name.strip() for name in text.split(",")]


@dataclass(frozen=True, slots=True)
class KeyFile:
    """An --api-key-file's keys: each key's tenant, and the priorities bounded per key."""

    tenants: dict[str, str]  # key -> its tenant
    priorities: dict[str, PriorityRange]  # key -> its bounds, for the keys that have some
    admins: frozenset[str] = frozenset()  # keys with role=admin: they see every tenant's slots


def parse_key_file(text: str) -> KeyFile:
    """The keys of an --api-key-file; ValueError naming the line for a bad one.

    One key a line, `name:key` or a bare key, optionally followed by `priority=MIN..MAX` and
    `role=admin`; blank lines and lines whose first non-blank character is `#` are skipped.
    """
    tenants: dict[str, str] = {}
    priorities: dict[str, PriorityRange] = {}
    admins: set[str] = set()
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        try:
            key, tenant = parse_key_line(words[0])
            for setting in words[1:]:
                name, sep, value = setting.partition("=")
                if setting == "role=admin":
                    admins.add(key)
                elif name == "priority" and sep:
                    priorities[key] = parse_priority_range(value)
                else:
                    raise ValueError(
                        f"unknown setting {setting!r}: API keys cannot contain whitespace, "
                        "and after the key only priority=MIN..MAX and role=admin may follow"
                    )
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
        tenants[key] = tenant
    return KeyFile(tenants, priorities, frozenset(admins))


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything one gateway process needs: where the workers are, and how to speak HTTP."""

    # The one-model gateway's file (--model PATH): every worker serves it, under
    # served_model_name, if its vocabulary is the same. The gateway loads the vocabulary only.
    model_path: Path | None = None
    # Models by name (--model NAME=PATH): a worker named NAME serves that one. Workers of
    # other names serve models the gateway learns from them (gateway/models/catalogue.py).
    models: tuple[tuple[str, Path], ...] = ()
    # `serve`'s model manager (its ROUTER endpoint): asked to load a model no worker serves.
    models_control: str | None = None
    # The workers' ROUTER endpoints; a tcp:// host name stands for each address it resolves to.
    worker_endpoints: tuple[str, ...] = ("tcp://127.0.0.1:5555",)
    host: str = setting(
        "127.0.0.1",
        help="HTTP address to listen on.",
    )
    port: int = setting(
        8000,
        help="HTTP port to listen on.",
    )
    # served name in /v1/models; default: the file's stem. "a,b,c": a, and aliases b and c
    model_name: str | None = setting(
        None,
        help=(
            "Model name in the API, for a single --model. Several, comma-separated (NAME,ALIAS,"
            "...): answers and /v1/models carry the first, a request may name any. Default: the "
            "model file's name."
        ),
        flag="--served-model-name",
    )
    # A `model` nobody serves runs on the default model instead of a 404 (llama-server's way)
    any_model_name: bool = setting(
        False,
        help=(
            "Answer a request whose `model` no model is served under with the default model "
            "(the one model, or serve's first), as llama-server does, instead of a 404; for "
            "clients that send a fixed name."
        ),
        negatable=False,
    )
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> its tenant; empty: no auth
    # key -> the priorities its requests may claim (clamped into); keys not here: any
    key_priorities: dict[str, PriorityRange] = field(default_factory=dict)
    # keys that see every tenant's requests in /slots (a key file's role=admin); the others
    # see their own tenant's and only counts of the rest
    admin_keys: frozenset[str] = frozenset()
    chat_template: str | None = None  # a Jinja template overriding the model's own
    # Where chat_template came from, as the log names it: "--chat-template FILE", a built-in
    # name or "--chat-template (Jinja text)"; "" without one.
    chat_template_from: str = ""
    # The tool-call syntax (gateway/tools/format.py's families) or auto: the one the chat
    # template's text shows. cli/options.py checks the name, which this layer cannot import.
    tool_call_parser: str = setting(
        "auto",
        help=(
            "Tool-call syntax parsed from replies and forced by tool_choice: auto (detected from "
            "the chat template) or a family: hermes, qwen3_coder, glm, minimax_m2, harmony, "
            "deepseek_v3_1, deepseek_r1, deepseek_v3_2, deepseek_v4, kimi_k2, mistral_args, "
            "mistral, llama3, granite, "
            "firefunction, command_r7b, command_r_plus, functionary_v3_1, functionary_v3_2, "
            "gemma4, phi4, "
            "lfm2, pythonic, json, generic."
        ),
    )
    # Which think-block markers split a reply into reasoning and answer (text/reasoning.py);
    # cli/options.py checks the name, which this layer cannot import.
    reasoning_parser: str = setting(
        "auto",
        help=(
            "Reasoning family whose think block is split from the answer (into "
            "message.reasoning_content): auto (detected from the chat template), none (raw "
            "text), or a family: deepseek_r1 "
            "(alias qwen3, glm45, ...), gpt_oss, mistral, seed_oss, kimi_vl, gemma4, apriel, "
            "solar_open, command_r7b."
        ),
    )
    # Tokens a reply may think before the worker closes its think block (request/thinking.py).
    reasoning_budget: int = setting(
        -1,
        help=(
            "Tokens of thinking a chat reply may spend before its think block is closed with "
            "the model's end marker, so that the answer comes (a request's "
            "thinking_token_budget or reasoning_budget overrides it); -1: no budget. Only for "
            "a model with a reasoning family (--reasoning-parser)."
        ),
        low=-1,
    )
    # Variables every chat's template render gets (a JSON object), under the request's own.
    chat_template_kwargs: str = setting(
        "",
        help=(
            "JSON object of chat template variables for every request (e.g. "
            "'{\"enable_thinking\": false}'); a request's chat_template_kwargs override them."
        ),
    )
    # CORS: browser origins allowed to call the API (http/app.py answers their preflights)
    cors_origins: tuple[str, ...] = setting(
        (),
        help=(
            "Browser origin allowed to call the API (CORS: a web page served from it, such as a "
            "chat UI, may send requests), as scheme://host[:port]; repeatable, `*` for any. "
            "Without any, no cross-origin request is allowed."
        ),
        aliases=("--allowed-origins",),
    )
    # Images (gateway/request/images.py), for models whose workers have a vision projector.
    max_image_bytes: int = setting(
        10 * 1024 * 1024,
        help="Largest image (its encoded file) a request may carry; a larger one gets 400.",
        low=1,
    )
    max_image_side: int = setting(
        8192,
        help="Largest width or height of an image, in pixels; a larger one gets 400.",
        low=1,
    )
    allowed_media_domains: tuple[str, ...] = setting(
        (),
        help=(
            "Host an http(s) image URL may name (repeatable; the gateway fetches it). Without "
            "any, only data: URLs are taken."
        ),
    )
    media_path: Path | None = setting(
        None,
        help=(
            "Folder whose image files a request may name as file:// URLs (with everything under "
            "it). Without it, file:// URLs are refused."
        ),
        path="any",
    )
    media_fetch_timeout: float = setting(
        10.0,
        help="Seconds an image fetched from an allowed domain may take.",
        low=0.01,
    )
    max_body_bytes: int = setting(
        8 * 1024 * 1024,
        help="Largest request body accepted; a larger one gets 413.",
        low=1,
    )
    heartbeat_interval: float = setting(
        1.0,
        help="Seconds between the gateway's pings to the worker.",
        low=0.01,
    )
    # no heartbeat this long: the worker is gone
    worker_timeout: float = setting(
        3.0,
        help="Seconds without a word from the worker before it counts as down (503).",
        low=0.05,
    )
    # a generation running longer ends with a 504
    request_timeout: float = setting(
        600.0,
        help="Longest a generation may run before it is cut off with a 504.",
        low=0.1,
    )
    # on SIGTERM, open streams get this long before they are cut
    shutdown_timeout: float = setting(
        5.0,
        help="On SIGTERM, seconds open streams get to finish before they are cut off.",
        low=0,
    )
    # CURVE, for a worker that has it: the worker's public certificate (.key) and this
    # gateway's own (.key_secret), whose public key the worker's allow-list must hold.
    curve_server_key_file: Path | None = None
    curve_secret_key_file: Path | None = None
    # a connection's request headers must arrive within this
    header_timeout: float = setting(
        10.0,
        help="Seconds a connection gets to send a request's headers before it is closed.",
        low=0.1,
    )
    # and its body within this after them, or 408
    body_timeout: float = setting(
        60.0,
        help="Seconds a request gets to send its body after the headers (else 408).",
        low=0.1,
    )
    # Tokens of one sequence the gateway holds for a client that does not read them (its
    # socket is full); past this the request is cancelled in the worker, freeing its slot.
    stream_buffer_tokens: int = setting(
        2048,
        help=(
            "Tokens held for a client that does not read its stream; past them the request is "
            "cancelled."
        ),
        low=1,
    )
    # The GGUF's general.sampling.* (temperature, top_k, top_p, min_p, repeat penalty) fill
    # the fields a request leaves out, as vLLM's --generation-config auto; False: neutral.
    model_sampling_defaults: bool = setting(
        True,
        help=(
            "Let the GGUF's general.sampling.* (temperature, top_k, top_p, min_p, repeat penalty) "
            "fill the fields a request leaves out; off: neutral defaults."
        ),
    )
    # Where request traces go, resolved (cli/tracing.py, whose --otlp-endpoint the worker,
    # the gateway and serve share); None: off, and no span is made.
    otlp_endpoint: str | None = None
    # A request for a model no worker serves waits this long for `serve` to load it (503
    # after), and at most this many requests wait at once (503 beyond).
    model_load_timeout: float = setting(
        120.0,
        help=(
            "Seconds a request for a model that is not loaded waits for `serve` to load it; then "
            "503 with Retry-After."
        ),
        low=0.1,
    )
    max_waiting_for_load: int = setting(
        256,
        help="Requests one gateway lets wait for models to load; beyond them, 503.",
        low=0,
    )

    def __post_init__(self) -> None:
        if self.model_path is not None and self.models:
            raise ValueError("give one model file (--model PATH) or named ones (NAME=PATH)")
        if self.model_name is not None and not all(served_names(self.model_name)):
            raise ValueError(f"--served-model-name {self.model_name!r} has an empty name")
        if self.model_name and self.model_path is None:
            raise ValueError(
                "--served-model-name names the model of a single --model PATH; without one, "
                "each model is served under its workers' --served-model-name (or NAME=PATH)"
            )
        names = [name for name, _ in self.models]
        if len(set(names)) != len(names):
            raise ValueError("two models have one name")
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
        if self.model_load_timeout <= 0 or self.max_waiting_for_load < 0:
            raise ValueError(
                "model_load_timeout must be positive, max_waiting_for_load not negative"
            )
        self.template_kwargs()  # a bad --chat-template-kwargs fails at start-up
        if self.max_body_bytes < 1 or self.request_timeout <= 0 or self.shutdown_timeout < 0:
            raise ValueError("body size and timeouts must be positive")

    def template_kwargs(self) -> dict[str, Any]:
        """--chat-template-kwargs as a dict."""
        return parse_template_kwargs(self.chat_template_kwargs)

    @property
    def served_model_name(self) -> str:
        """The one-model gateway's name for its model: --served-model-name, else the stem."""
        if self.model_name:
            return served_names(self.model_name)[0]
        return self.model_path.stem if self.model_path is not None else ""

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """The other names of --served-model-name, which requests may use for the model."""
        return tuple(served_names(self.model_name)[1:]) if self.model_name else ()

    def model_files(self) -> list[tuple[str, Path]]:
        """The gateway's own model files, by served name."""
        if self.model_path is not None:
            return [(self.served_model_name, self.model_path)]
        return list(self.models)
