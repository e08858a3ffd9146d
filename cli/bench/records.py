"""One request's outcome: the record the client fills and the metrics read."""

from __future__ import annotations

from dataclasses import dataclass, field

# Failure kinds besides "http_<status>".
TIMEOUT = "timeout"  # the request ran past --timeout
BROKEN_STREAM = "broken_stream"  # the connection closed, or the stream ended before [DONE]
CONNECT_ERROR = "connect_error"
TRANSPORT_ERROR = "transport_error"  # any other HTTP-level failure
STREAM_ERROR = "stream_error"  # the server sent an error event inside the stream
BAD_RESPONSE = "bad_response"  # an event that is not JSON, or not shaped like OpenAI's
NO_OUTPUT = "no_output"  # a complete stream without a single text chunk
UNFINISHED = "unfinished"  # still running when --duration ended the benchmark
NOT_SENT = "not_sent"  # never sent: --duration ended the benchmark first


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds; offsets count from the benchmark start."""

    index: int
    expected_prompt_len: int  # the dataset's estimate
    max_tokens: int
    scheduled_s: float = 0.0  # when the arrival schedule wanted it sent
    dispatched_s: float | None = None  # when the generator released it; None: never
    start_s: float = 0.0  # when it went on the wire (later still if waiting for a slot)
    taken_up_s: float | None = None  # when the client took it up, after any slot wait
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks
    e2e_s: float | None = None
    output_tokens: int = 0  # usage.completion_tokens; without usage, client.fallback_token_count
    prompt_tokens: int | None = None  # usage.prompt_tokens when the server reports it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    usage_reported: bool = False
    chunks: int = 0  # events that carried a token: text, or an empty one (is_token_event)
    finish_reason: str | None = None  # the stream's, when it gave one ("length", "stop")
    error_kind: str | None = None
    error: str | None = None
    request_id: str | None = None  # the x-request-id header sent
    label: str | None = None  # the request's class (--class)

    @property
    def success(self) -> bool:
        return self.error_kind is None

    @property
    def input_tokens(self) -> int:
        """The server's prompt token count when it told us, else the dataset's estimate."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.expected_prompt_len
