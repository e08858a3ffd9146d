"""Log-probabilities of a sampled token and its top alternatives, from the logits the tick
loop already reads; only for requests that ask (SamplingParams.logprobs). And those of the
prompt's tokens (SamplingParams.prompt_logprobs), from logits on every prompt token.

They are taken after the request's logit bias and penalties, the distribution its sampler
chain starts from (vLLM's default), and before temperature, top-k/p and grammar. The bias and
penalties are applied here as llama.cpp's logit_bias and penalties samplers apply them; the
chain's own copy of the logits is not reachable from Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loomserve.protocol import SamplingParams, TokenLogprobs

FLOOR = -9999.0  # what a token that cannot be chosen reports (as vLLM's); JSON has no -inf
# Prompt rows are normalised this many at a time: a block's exponentials are a temporary of
# ROWS x vocabulary floats (32 MiB for a 262k vocabulary).
ROWS = 32


def token_logprobs(
    logits: np.ndarray,
    token: int,
    params: SamplingParams,
    generated: Sequence[int],
    slot_context: int,
) -> TokenLogprobs:
    """The sampled token's log-probability and the `params.logprobs` most likely tokens'.

    `generated` is what the request generated before this token: the penalties' history.
    """
    scores = adjusted_logits(logits, params, generated, slot_context)
    peak = float(scores.max())
    # float32 exponentials (a large vocabulary's worth) summed in float64.
    log_total = peak + float(np.log(np.exp(scores - peak).sum(dtype=np.float64)))
    return _entry(scores, log_total, token, params.logprobs or 0)


def prompt_logprobs(
    logits: np.ndarray, next_tokens: Sequence[int], top: int
) -> list[TokenLogprobs]:
    """Row i's log-probability of next_tokens[i] (the prompt token that follows row i's) and
    its `top` most likely tokens'.

    The model's own distribution: no bias and no penalties, which belong to sampling what
    follows the prompt (vLLM's prompt_logprobs are the same).
    """
    result = []
    n_rows = len(next_tokens)
    for start in range(0, n_rows, ROWS):
        block = logits[start : min(start + ROWS, n_rows)]
        peaks = block.max(axis=1, keepdims=True)
        sums = np.exp(block - peaks).sum(axis=1, dtype=np.float64)
        log_totals = peaks[:, 0] + np.log(sums)
        for row, log_total in enumerate(log_totals.tolist()):
            result.append(_entry(block[row], log_total, next_tokens[start + row], top))
    return result


def _entry(scores: np.ndarray, log_total: float, token: int, top: int) -> TokenLogprobs:
    """One position's logprobs from its scores and their log-sum-exp."""
    if top:
        best = np.argpartition(scores, -top)[-top:]
        best = best[np.argsort(-scores[best], kind="stable")]
    else:
        best = np.empty(0, dtype=np.int64)
    return TokenLogprobs(
        logprob=_floor(float(scores[token]) - log_total),
        top_ids=[int(i) for i in best],
        top_logprobs=[_floor(float(scores[i]) - log_total) for i in best],
    )


def adjusted_logits(
    logits: np.ndarray, params: SamplingParams, generated: Sequence[int], slot_context: int
) -> np.ndarray:
    """The logits after logit bias, then penalties, as llama.cpp's sampler chain orders and
    applies them (a copy; the row itself when neither applies)."""
    window = slot_context if params.repeat_last_n == -1 else params.repeat_last_n
    history = list(generated[-window:]) if window > 0 else []
    penalised = history and (
        params.repeat_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )
    if not params.logit_bias and not penalised:
        return logits
    scores = np.array(logits, dtype=np.float32)
    for token_id, bias in params.logit_bias.items():
        scores[token_id] += bias
    if penalised:
        ids, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
        values = scores[ids]
        values = np.where(
            values <= 0, values * params.repeat_penalty, values / params.repeat_penalty
        )
        values -= counts * params.frequency_penalty + params.presence_penalty
        scores[ids] = values
    return scores


def _floor(value: float) -> float:
    return value if value > FLOOR else FLOOR
