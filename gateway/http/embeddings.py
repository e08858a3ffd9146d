"""POST /v1/embeddings: inputs to token ids, one Embed to the worker, OpenAI's response.

The worker computes the vectors in its embedding context (worker/engine/embeddings.py) and sends
them L2-normalized as float32; `encoding_format: base64` sends those bytes as they are, which
is what the `openai` client asks for by default and decodes.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, cast

import numpy as np

from ...protocol import Embed, Embeddings
from ...protocol.messages import MAX_EMBED_INPUTS
from .. import tracing
from ..api.errors import invalid_request
from ..api.schemas import EmbeddingRequest
from ..request import prompts
from ..text.tokenizer import Vocab
from ..workers.pool import ModelWorkers
from ..workers.retries import Tries

MAX_INPUTS = MAX_EMBED_INPUTS  # OpenAI's limit on inputs per request


def _inputs(given: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """The request's inputs one by one: a lone text or list of token ids is one input. The
    schema's lists each hold one kind (pydantic picks one member of the union), so a list
    that starts with an id is a list of ids."""
    if isinstance(given, str):
        return [given]
    if given and isinstance(given[0], int):
        return [cast("list[int]", given)]
    return cast("list[str] | list[list[int]]", given)


async def embed_request(body: EmbeddingRequest, vocab: Vocab) -> Embed:
    """The Embed for a request's inputs; 400 for empty or bad ones."""
    if body.dimensions is not None:
        raise invalid_request("dimensions is not supported", "dimensions")
    raw = _inputs(body.input)
    if not raw:
        raise invalid_request("input must not be empty", "input")
    if len(raw) > MAX_INPUTS:
        raise invalid_request(f"at most {MAX_INPUTS} inputs per request", "input")
    inputs: list[list[int]] = []
    for item in raw:
        if item == "":
            raise invalid_request("an input is an empty string", "input")
        if isinstance(item, str):
            tokens = await prompts.tokenize(vocab, item, add_special=True, parse_special=False)
        else:
            prompts.check_token_ids(vocab, item, "input")
            tokens = list(item)
        if not tokens:
            raise invalid_request("an input is empty", "input")
        inputs.append(tokens)
    return Embed(f"embd-{uuid.uuid4().hex}", inputs)


async def create_embeddings(
    pool: ModelWorkers, body: EmbeddingRequest, vocab: Vocab, model: str
) -> dict[str, Any]:
    """The response body of one embeddings request."""
    embed = await embed_request(body, vocab)
    # The worker's span of it becomes a child of the request's (when tracing is on).
    embed.trace, embed.trace_state = tracing.context_of(tracing.current())
    _, handle = await Tries(pool).submit(embed)
    reply = handle.accepted.result()
    assert isinstance(reply, Embeddings)  # an Embed's answer; a Rejected one was raised
    vectors = np.frombuffer(reply.vectors, dtype="<f4").reshape(len(embed.inputs), reply.size)
    data = []
    for index, vector in enumerate(vectors):
        if body.encoding_format == "base64":
            value: Any = base64.b64encode(vector.tobytes()).decode()
        else:
            value = vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    usage = {"prompt_tokens": reply.prompt_tokens, "total_tokens": reply.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}
