"""Request fields to the worker's SamplingParams and stop strings; 400 for bad ones.

Everything a request can get wrong is caught here, before anything reaches the worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from typing import Any

from ...protocol.limits import MAX_LOGIT_BIAS
from ...protocol.messages import MAX_TENANT_CHARS, PRIORITY_LIMIT, SamplingParams
from ...protocol.sampling import MAX_TOP_LOGPROBS
from ..api.errors import APIError, invalid_request
from ..api.schemas import ChatCompletionRequest, CompletionRequest, GenerationFields
from ..text.grammar import request_grammar
from ..text.tokenizer import Vocab

MAX_STOP_STRINGS = 4  # OpenAI's limit
# Matching holds back the longest tail that starts a stop string, checked per token.
MAX_STOP_CHARS = 512
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
LOGIT_BIAS_LIMIT = 100.0
MAX_CHOICES = 128  # choices (prompts × n) in one request; OpenAI caps n at 128
# The sampling defaults a GGUF may carry (llama.cpp's general.sampling.* keys), by the
# SamplingParams field each one fills when a request leaves it out.
MODEL_SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repeat_penalty",
    "penalty_last_n": "repeat_last_n",
}
NEUTRAL = SamplingParams()


# OpenAI's fields this server cannot honour, with the values that ask for nothing (accepted).
# Anything else in them gets a 400 naming the field: never a silent ignore.
UNSUPPORTED_CHAT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or list(v) == ["text"],
    "prediction": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "functions": lambda v: not v,
    "function_call": lambda v: v is None or v == "none",
    "store": lambda v: not v,
    "service_tier": lambda v: v in (None, "auto", "default"),
}


def reject_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for features this server does not have, rather than silently ignoring them."""
    if request.n is not None and request.n < 1:
        raise invalid_request("n must be at least 1", "n")
    top_logprobs(request)  # raises for a bad logprobs / top_logprobs
    options = request.stream_options
    if options is not None and options.include_obfuscation:
        raise invalid_request(
            "stream obfuscation is not supported", "stream_options.include_obfuscation"
        )
    if isinstance(request, CompletionRequest):
        if request.best_of not in (None, 1, request.n or 1):
            raise invalid_request("best_of is supported only equal to n", "best_of")
        if request.suffix:
            raise invalid_request("suffix (insertion) is not supported", "suffix")
        return
    for name, asks_nothing in UNSUPPORTED_CHAT_FIELDS.items():
        if not asks_nothing(getattr(request, name)):
            raise invalid_request(f"{name} is not supported by this server", name)


def top_logprobs(request: GenerationFields) -> int | None:
    """Alternatives per token the request wants logprobs for (0: the sampled token's only);
    None when it wants none. Completions say it in `logprobs`, chat in `top_logprobs`."""
    if isinstance(request, CompletionRequest):
        wanted, param = request.logprobs, "logprobs"
        if isinstance(wanted, bool):
            raise invalid_request("logprobs is the number of alternatives (0 to 20)", param)
        if request.top_logprobs is not None:
            raise invalid_request("top_logprobs is chat's; completions take logprobs", param)
    else:
        param = "top_logprobs"
        if not request.logprobs:
            if request.top_logprobs is not None:
                raise invalid_request("top_logprobs needs logprobs: true", param)
            return None
        wanted = request.top_logprobs or 0
    if wanted is not None and not (0 <= wanted <= MAX_TOP_LOGPROBS):
        raise invalid_request(f"{param} must be between 0 and {MAX_TOP_LOGPROBS}", param)
    return wanted


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's stop strings, empty ones dropped."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid_request(f"stop strings may be at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(s for s in stops if s)


def score_only(request: CompletionRequest | ChatCompletionRequest) -> bool:
    """Completions' echo with max_tokens 0: answer the prompt alone (with its logprobs when
    asked), as eval harnesses score a text; OpenAI's legacy completions allowed it."""
    return isinstance(request, CompletionRequest) and bool(request.echo) and request.max_tokens == 0


def max_new_tokens(requested: int | None, default: int | None, prompt_len: int, ctx: int) -> int:
    """Tokens to generate: as asked, or the default capped by what the slot's context leaves.

    A max_tokens the context cannot hold is a 400, as vLLM and llama-server answer; only a
    default (the client asked for nothing) is capped quietly.
    """
    room = ctx - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room to generate. Shorten the prompt.",
            code="context_length_exceeded",
        )
    if requested is not None and requested < 1:
        raise invalid_request("max_tokens must be at least 1", "max_tokens")
    if requested is not None and requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            f"completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if requested is not None:
        return requested
    return room if default is None else min(default, room)


def model_sampling_defaults(meta: Callable[[str], str]) -> dict[str, Any]:
    """The sampling defaults in a GGUF's metadata (`meta` reads a key), by SamplingParams
    field. A value that does not parse, or that SamplingParams refuses, is left out."""
    found: dict[str, Any] = {}
    for key, name in MODEL_SAMPLING_KEYS.items():
        text = meta(f"general.sampling.{key}").strip()
        if not text:
            continue
        try:
            value: Any = int(text) if name in ("top_k", "repeat_last_n") else float(text)
            dataclasses.replace(NEUTRAL, **{name: value})  # its checks
        except ValueError:
            continue
        found[name] = value
    return found


def sampling_params(
    request: GenerationFields,
    max_tokens: int,
    vocab: Vocab,
    defaults: SamplingParams = NEUTRAL,
) -> SamplingParams:
    """The worker's SamplingParams: the request's fields, `defaults` for those it leaves out
    (the model's own, when it has them); their own checks become 400s."""
    return with_max_tokens(sampling_fields(request, vocab, defaults), max_tokens)


def sampling_fields(
    request: GenerationFields, vocab: Vocab, defaults: SamplingParams = NEUTRAL
) -> dict[str, Any]:
    """Every SamplingParams field but max_tokens (which the prompt's length decides): the
    request's, or `defaults` for those it leaves out. Compiles a JSON schema's grammar."""
    logprobs = top_logprobs(request)
    # Completions' echo with logprobs: the prompt's tokens get theirs too, as in OpenAI's.
    echo = isinstance(request, CompletionRequest) and bool(request.echo)
    return {
        "temperature": _or(request.temperature, defaults.temperature),
        "top_k": _or(request.top_k, defaults.top_k),
        "top_p": _or(request.top_p, defaults.top_p),
        "min_p": _or(request.min_p, defaults.min_p),
        "repeat_penalty": _or(request.repeat_penalty, defaults.repeat_penalty),
        "repeat_last_n": _or(request.repeat_last_n, defaults.repeat_last_n),
        "presence_penalty": _or(request.presence_penalty, defaults.presence_penalty),
        "frequency_penalty": _or(request.frequency_penalty, defaults.frequency_penalty),
        "seed": request.seed,
        "logit_bias": _logit_bias(request.logit_bias, vocab),
        "grammar": request_grammar(request),
        "ignore_eos": bool(request.ignore_eos),
        "speculative": _or(request.speculative, defaults.speculative),
        "logprobs": logprobs,
        "prompt_logprobs": logprobs if echo else None,
    }


def with_max_tokens(fields: dict[str, Any], max_tokens: int) -> SamplingParams:
    """SamplingParams of sampling_fields and a max_tokens; their own checks become 400s."""
    try:
        return SamplingParams(max_tokens=max_tokens, **fields)
    except ValueError as exc:
        raise invalid_request(str(exc)) from exc


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None, vocab: Vocab) -> dict[int, float]:
    result: dict[int, float] = {}
    param = "logit_bias"
    if bias and len(bias) > MAX_LOGIT_BIAS:
        raise invalid_request(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", param)
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid_request(f"logit_bias key {key!r} is not a token id", param) from None
        if not vocab.is_valid(token_id):
            raise invalid_request(f"logit_bias token {token_id} is not in the vocabulary", param)
        if not (-LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT) or math.isnan(value):
            raise invalid_request("logit_bias values must be between -100 and 100", param)
        result[token_id] = value
    return result


def request_priority(priority: int | None) -> int:
    """The request's scheduling priority (lower first, as vLLM); 400 beyond 32 bits."""
    if priority is None:
        return 0
    if not -PRIORITY_LIMIT < priority < PRIORITY_LIMIT:
        raise invalid_request("priority must be a 32-bit integer", "priority")
    return priority


def user_tenant(user: str | None) -> str | None:
    """The tenant a `user` field names; a very long one is named by a hash of it."""
    if not user:
        return None
    if len(user) <= MAX_TENANT_CHARS:
        return user
    return "user-" + hashlib.sha256(user.encode()).hexdigest()[:16]
