"""The wire messages between gateways and the worker: plain dataclasses, nothing else.

Gateway -> worker: Hello, Generate, Embed, Cancel, Ping, SlotsQuery, ImageTokensQuery.
Worker -> gateway: ModelInfo, Accepted, Rejected, Outputs, Embeddings, Heartbeat, WorkerError,
SlotsReport, ImageTokens. A Generate's SamplingParams are in sampling.py; the messages between
gateways and `serve`'s model manager in model_manager.py; all of them make up `Message`.

The worker speaks token ids only; text is the gateway's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .model_manager import (
    LoadModel,
    ModelsQuery,
    ModelStates,
    UnloadModel,
)
from .sampling import SamplingParams

# The tenant of requests with neither a named API key nor a `user`: one name, on both sides.
DEFAULT_TENANT = "default"

# 2: embeddings; 3: logprobs; 4: prompt logprobs; 5: TokenChunk.seq; 6: Generate's priority
# and tenant; 7: SamplingParams.speculative, Heartbeat.prefixes; 8: Cancel.reason,
# Heartbeat.kv_cells_used and kv_cells_total; 9: SlotsQuery, SlotsReport; 10: Finish.code;
# 11: VocabQuery, VocabFile, Heartbeat.idle_seconds, the models control messages,
# Ping.for_gateway; 12: Generate's and Embed's trace and trace_state (W3C trace context,
# docs/metrics.md); 13: Heartbeat.load, one Load in place of its queue_depth, free_slots
# and running; 14: Generate's images and image_at, ModelInfo.vision; 15: SamplingParams.grammar
# is llguidance's grammar (Lark, or its JSON form), no longer GBNF; 16: ImageTokensQuery,
# ImageTokens
PROTOCOL_VERSION = 16
MAX_EMBED_INPUTS = (
    2048  # inputs in one Embed: OpenAI's limit per request; the worker's decode budget
)
MAX_TENANT_CHARS = 128
# A W3C traceparent is 55 characters (version 00); a tracestate at most 32 members of 256.
MAX_TRACE_CHARS = 8192
PRIORITY_LIMIT = 2**31  # |priority| below this
MAX_IMAGES = 64  # images in one Generate


class FinishReason(StrEnum):
    STOP = "stop"  # an end-of-generation token, or a stop string matched by the gateway
    LENGTH = "length"  # max_tokens or the slot's context ran out
    CANCELLED = "cancelled"  # the client went away, the gateway gave up, or its gateway was lost
    ERROR = "error"  # the engine failed this request; see Finish.message


class ErrorCode(StrEnum):
    QUEUE_FULL = "queue_full"
    PROMPT_TOO_LONG = "prompt_too_long"
    INVALID_REQUEST = "invalid_request"
    DUPLICATE_REQUEST = "duplicate_request"
    NOT_READY = "not_ready"
    PROTOCOL_MISMATCH = "protocol_mismatch"
    DECODE_FAILED = "decode_failed"
    GATEWAY_LOST = "gateway_lost"
    ENGINE_DEAD = "engine_dead"  # the worker gave up on its engine and exits; it restarts


# --- gateway -> worker -------------------------------------------------------


@dataclass(slots=True)
class Hello:
    """First message of a gateway; the worker answers with ModelInfo."""

    gateway_id: str
    protocol_version: int = PROTOCOL_VERSION


@dataclass(slots=True)
class Generate:
    """Run one request. request_id is unique per gateway; the worker keys it by (gateway, id)."""

    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first when the worker schedules by priority
    tenant: str = DEFAULT_TENANT  # who it is for, for fair shares
    # The W3C trace context of the gateway's span for this sequence (traceparent, tracestate):
    # the worker's spans become its children. "" when the gateway does not trace.
    trace: str = ""
    trace_state: str = ""
    # Images (encoded files: PNG, JPEG...) for a vision model, and where each goes: before
    # prompt_tokens[image_at[i]] (len(prompt_tokens): after the last). The worker puts the
    # projector's tokens and embeddings for each there (worker/engine/media.py).
    images: list[bytes] = field(default_factory=list)
    image_at: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError("the prompt must hold at least one token")
        if any(t < 0 for t in self.prompt_tokens):
            raise ValueError("token ids are never negative")
        if len(self.images) != len(self.image_at) or len(self.images) > MAX_IMAGES:
            raise ValueError(f"one position per image, and at most {MAX_IMAGES} images")
        if self.image_at != sorted(self.image_at) or any(
            not 0 <= at <= len(self.prompt_tokens) for at in self.image_at
        ):
            raise ValueError("image positions are in order, within the prompt")
        if not -PRIORITY_LIMIT < self.priority < PRIORITY_LIMIT:
            raise ValueError("priority must be a 32-bit integer")
        if len(self.tenant) > MAX_TENANT_CHARS:
            raise ValueError(f"tenant names are at most {MAX_TENANT_CHARS} characters")
        _check_trace(self.trace, self.trace_state)


@dataclass(slots=True)
class Embed:
    """Embed each input. The worker answers with one Embeddings, or Rejected; no Accepted."""

    request_id: str
    inputs: list[list[int]]  # token ids, one list per input
    trace: str = ""  # as Generate's
    trace_state: str = ""

    def __post_init__(self) -> None:
        if not self.inputs or not all(self.inputs):
            raise ValueError("an embedding needs at least one input of at least one token")
        if any(t < 0 for tokens in self.inputs for t in tokens):
            raise ValueError("token ids are never negative")
        _check_trace(self.trace, self.trace_state)


def _check_trace(trace: str, trace_state: str) -> None:
    """Only the size: a malformed context is the tracer's to ignore, never a failed request."""
    if len(trace) + len(trace_state) > MAX_TRACE_CHARS:
        raise ValueError(f"trace context is at most {MAX_TRACE_CHARS} characters")


# The reasons a gateway may give when it ends a request itself.
CANCEL_REASONS = (FinishReason.CANCELLED.value, FinishReason.STOP.value)


@dataclass(slots=True)
class Cancel:
    """Stop a request: queued or running. Unknown ids are ignored (it may have just finished).

    reason is the finish the worker records: "stop" when the gateway ended the reply on its
    text (a stop string, a finished tool call), as its client is told; "cancelled" when the
    client went away, timed out, or could not be served."""

    request_id: str
    reason: str = FinishReason.CANCELLED.value

    def __post_init__(self) -> None:
        if self.reason not in CANCEL_REASONS:
            raise ValueError(f"a Cancel's reason is one of {', '.join(CANCEL_REASONS)}")


@dataclass(slots=True)
class Ping:
    """Gateway heartbeat. The worker echoes sent_at in its Heartbeat for round-trip time.

    With `for_gateway`, a keep-alive from a gateway's own thread on a socket of its own: the
    worker counts it as word from that gateway (a DEALER identity it knows) and answers
    nothing, so a gateway whose event loop is busy with a large request does not look dead.
    """

    sent_at: float
    for_gateway: str = ""


@dataclass(slots=True)
class SlotsQuery:
    """Ask for the worker's slots (GET /slots); it answers with a SlotsReport of the same id."""

    query_id: str


@dataclass(slots=True)
class ImageTokensQuery:
    """How many prompt positions each image takes on the worker's projector (the count
    endpoints); it answers ImageTokens of the same id, without encoding anything."""

    query_id: str
    images: list[bytes]  # encoded files, as Generate.images

    def __post_init__(self) -> None:
        if len(self.images) > MAX_IMAGES:
            raise ValueError(f"at most {MAX_IMAGES} images")


@dataclass(slots=True)
class VocabQuery:
    """Ask for the worker's vocabulary (a gateway that has not got it); it answers VocabFile."""

    vocab_fingerprint: str  # the one its ModelInfo gave, so an answer is never mismatched


# --- worker -> gateway -------------------------------------------------------


@dataclass(slots=True)
class VocabFile:
    """The worker's model without its weights: a GGUF of its metadata only (vocabulary, chat
    template, sampling defaults), zlib-compressed. A gateway loads it vocab-only, so it
    tokenizes exactly as the worker does without the model file on its own disk."""

    vocab_fingerprint: str
    gguf_zlib: bytes  # empty when the worker cannot send it (see `error`)
    error: str = ""


@dataclass(slots=True)
class ModelInfo:
    """The worker's identity, sent in answer to Hello."""

    protocol_version: int
    model_name: str
    vocab_size: int
    context_train: int  # the model's training context
    slot_context: int  # tokens of context each slot has
    slots: int
    vocab_fingerprint: str  # sha256 over the vocabulary; gateways refuse to serve on a mismatch
    ready: bool
    vision: bool = False  # it reads images (a projector, --mmproj): Generate.images


@dataclass(slots=True)
class Accepted:
    """The worker took the request (queued or running); it will finish exactly once."""

    request_id: str
    queue_depth: int


@dataclass(slots=True)
class Rejected:
    """The worker refused the request; it never ran."""

    request_id: str
    code: str  # an ErrorCode value
    message: str


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one generated position, after logit bias and penalties."""

    logprob: float  # of the sampled token
    top_ids: list[int]  # the most likely tokens, most likely first (SamplingParams.logprobs)
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    """Log-probabilities of consecutive prompt tokens, each given the tokens before it."""

    first: int  # the prompt position of logprobs[0]: 1 or more (nothing precedes token 0)
    logprobs: list[TokenLogprobs]  # of the model's own distribution: no bias, no penalties


@dataclass(slots=True)
class TokenChunk:
    """New tokens of one request since the previous Outputs (none when it only carries
    prompt logprobs: a prompt scored over several ticks)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token; only for requests that ask
    # Only for requests with SamplingParams.prompt_logprobs, before their first token.
    prompt_logprobs: PromptLogprobs | None = None
    # How many tokens of this request were sent before this chunk: the gateway turns a gap
    # or a repeat into an error for the request instead of garbled text.
    seq: int = 0


@dataclass(slots=True)
class Finish:
    """The end of one request, with usage and timings."""

    request_id: str
    reason: str  # a FinishReason value
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_seconds: float
    message: str = ""  # why, when reason is error
    # An ErrorCode value when the request's own settings failed it (its grammar grew too
    # complex or too slow): its gateway answers as to a bad request, not a server fault.
    code: str = ""


@dataclass(slots=True)
class Outputs:
    """Everything one tick produced for one gateway, coalesced into one message."""

    tokens: list[TokenChunk]
    finishes: list[Finish]


@dataclass(slots=True)
class Embeddings:
    """The vectors of an Embed, L2-normalized, in input order: float32, little-endian."""

    request_id: str
    size: int  # dimensions of one vector
    vectors: bytes  # len(inputs) * size float32 values
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Load:
    """A worker's load, or several workers' summed: the one type for these three numbers, in
    heartbeats, in the worker's SchedulerStats and in the gateway's routing and /health."""

    queue_depth: int  # requests waiting for a slot
    free_slots: int  # slots without a request
    running: int  # requests in a slot


@dataclass(slots=True)
class Heartbeat:
    """Worker liveness and load, sent to every gateway every second and in answer to Ping."""

    sent_at: float
    ping_sent_at: float  # the gateway's Ping.sent_at it answers, 0.0 if unsolicited
    ready: bool
    load: Load
    # prefix_keys.prefix_keys of the sequences the worker caches, in slots or in RAM, most
    # recently used first, at most MAX_ADVERTISED_KEYS.
    prefixes: list[int] = field(default_factory=list)
    # KV cache cells holding tokens (running and reusable), and all cells: the gateways
    # export them per worker, so one /metrics shows the worker's cache.
    kv_cells_used: int = 0
    kv_cells_total: int = 0
    # Seconds since the worker last had a request queued or running (0 while it has one):
    # what `serve` reads to unload an idle model.
    idle_seconds: float = 0.0


@dataclass(slots=True)
class SlotState:
    """One slot as the loop last published it: who runs there and how far it got. Never any
    prompt or output text (the worker has none), nor token ids."""

    index: int
    state: str  # "idle", "prefilling" or "generating"
    request_id: str = ""  # "" when idle
    gateway: str = ""  # the gateway's identity: request ids are unique per gateway only
    tenant: str = ""
    priority: int = 0
    prompt_tokens: int = 0  # the prompt's length
    cached_tokens: int = 0  # prompt tokens whose KV was reused
    computed_tokens: int = 0  # prompt tokens evaluated so far (besides the cached ones)
    generated_tokens: int = 0
    age_seconds: float = 0.0  # since the worker accepted the request
    tokens_per_second: float = 0.0  # generated tokens per second since the first one


@dataclass(slots=True)
class TenantQueue:
    """One tenant's requests in a worker: in slots and waiting for one."""

    tenant: str
    running: int
    waiting: int


@dataclass(slots=True)
class SlotsReport:
    """The answer to a SlotsQuery: every slot of the worker and its queue, per tenant."""

    query_id: str
    queue_depth: int
    slots: list[SlotState]
    tenants: list[TenantQueue]


@dataclass(slots=True)
class ImageTokens:
    """The answer to an ImageTokensQuery: each image's positions (its tokens and any begin
    and end tokens the projector wraps it in), or why they cannot be counted."""

    query_id: str
    counts: list[int]  # one per image; empty with an error
    error: str = ""  # an image that cannot be read, or no projector


@dataclass(slots=True)
class WorkerError:
    """An error not tied to one request: protocol mismatch, engine failure."""

    code: str  # an ErrorCode value
    message: str


Message = (
    Hello
    | Generate
    | Embed
    | Cancel
    | Ping
    | SlotsQuery
    | ImageTokensQuery
    | VocabQuery
    | ModelInfo
    | Accepted
    | Rejected
    | Outputs
    | Embeddings
    | Heartbeat
    | WorkerError
    | SlotsReport
    | ImageTokens
    | VocabFile
    | LoadModel
    | UnloadModel
    | ModelsQuery
    | ModelStates
)
