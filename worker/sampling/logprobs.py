"""Log-probabilities of a sampled token and its top alternatives, from the logits the tick
loop already reads; only for requests that ask (SamplingParams.logprobs). And those of the
prompt's tokens (SamplingParams.prompt_logprobs), from logits on every prompt token.

They are taken after the request's logit bias and penalties, the distribution its sampler
chain starts from (vLLM's default), and before temperature, top-k/p and grammar. The bias and
penalties are applied here as llama.cpp's logit_bias and penalties samplers apply them; the
chain's own copy of the logits is not reachable from Python.

After the forward pass, sampled() gives the scheduler's update each slot's sampled tokens with
their log-probabilities as a Sampled, and score_prompts() sends a scoring request's prompt
logprobs from the rows of a step's output logits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from ...protocol import Outputs, PromptLogprobs, SamplingParams, TokenChunk, TokenLogprobs
from ..sched.slots import Run, Sampled, Slot, Step

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
    adjustments = logit_adjustments(logits, params, generated, slot_context)
    if adjustments is None:
        return logits
    scores = np.array(logits, dtype=np.float32)
    ids, values = adjustments
    scores[ids] = values
    return scores


def logit_adjustments(
    logits: np.ndarray, params: SamplingParams, generated: Sequence[int], slot_context: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """What adjusted_logits changes: the tokens the bias and penalties touch (each once) and
    their new logits, or None where neither applies. A few hundred tokens at most, where the
    whole row is 262,144 on Gemma: sample_rows writes them into the row and back. A token
    with both is biased first, then penalised, as in llama.cpp's chain."""
    window = slot_context if params.repeat_last_n == -1 else params.repeat_last_n
    history = generated[-window:] if window > 0 else ()
    penalised = bool(history) and (
        params.repeat_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )
    bias = params.logit_bias
    if not bias and not penalised:
        return None
    counts = Counter(history) if penalised else Counter()
    tokens = [*bias, *(token for token in counts if token not in bias)]
    ids = np.array(tokens, dtype=np.int64)
    values = np.asarray(logits[ids], dtype=np.float32)  # a copy: indexed by an array
    if bias:  # float32, as llama.cpp's logit_bias sampler adds them
        values[: len(bias)] += np.array(list(bias.values()), dtype=np.float32)
    if penalised:
        if bias:
            position = {token: i for i, token in enumerate(tokens)}
            at: np.ndarray | slice = np.array([position[token] for token in counts])
        else:
            at = slice(None)  # every token, in counts' order
        penalised_values = values[at]
        if params.repeat_penalty != 1.0:
            penalised_values = np.where(
                penalised_values <= 0,
                penalised_values * params.repeat_penalty,
                penalised_values / params.repeat_penalty,
            )
        # float32 throughout, as llama.cpp's penalties sampler computes them
        times = np.array(list(counts.values()), dtype=np.float32)
        penalised_values -= times * np.float32(params.frequency_penalty) + np.float32(
            params.presence_penalty
        )
        values[at] = penalised_values
    return ids, values


def _floor(value: float) -> float:
    return value if value > FLOOR else FLOOR


def sampled(
    slot: Slot, rows: np.ndarray, tokens: list[int], is_eog: Callable[[int], bool], context: int
) -> Sampled:
    """A slot's new tokens (sampled from `rows`, one row each) as the scheduler's update takes
    them, with their logprobs when the request asked and what its grammar said."""
    request = slot.occupant
    sampler = request.chain
    logprobs = None
    if request.params.logprobs is not None:
        # Each token's penalty history is what the slot generated before it.
        history = slot.tokens[len(request.prompt) :]  # resumed ones too
        logprobs = []
        for row, token in zip(rows, tokens, strict=False):
            logprobs.append(token_logprobs(row, token, request.params, history, context))
            history = [*history, token]
    return Sampled(
        slot,
        tokens,
        [is_eog(token) for token in tokens],
        logprobs,
        sampler.failure,
        sampler.grammar_complete,
    )


def score_prompts(
    step: Step, output_logits: Callable[[int], np.ndarray], outputs_to: Callable[[bytes], Outputs]
) -> np.ndarray:
    """Send the prompt logprobs of the step's scoring runs (in `outputs_to(gateway)`, the
    tick's Outputs for a gateway: PendingOutputs.to); return the logits rows of the sampled
    slots (in batch order, as the loop's _sample reads them)."""
    n_outputs = sum(len(run.tokens) if run.score else run.sample for run in step.runs)
    logits = output_logits(n_outputs)
    rows, sampled_rows = 0, []
    for run in step.runs:
        if run.score:
            _send_prompt_logprobs(run, logits[rows : rows + len(run.tokens)], outputs_to)
            rows += len(run.tokens)
            if run.sample:
                sampled_rows.append(rows - 1)
        elif run.sample:
            sampled_rows.append(rows)
            rows += 1
    return logits[sampled_rows]


def _send_prompt_logprobs(
    run: Run, rows: np.ndarray, outputs_to: Callable[[bytes], Outputs]
) -> None:
    """Row i scores prompt token run.start + i + 1; the prompt's last row scores nothing
    (its logits sample the first generated token)."""
    request = run.slot.occupant
    prompt, top = request.prompt, request.params.prompt_logprobs
    assert top is not None, "a scoring run is of a request that asked for prompt logprobs"
    n_scored = min(len(run.tokens), len(prompt) - 1 - run.start)
    if n_scored <= 0:
        return
    first = run.start + 1
    entries = prompt_logprobs(rows[:n_scored], prompt[first : first + n_scored], top)
    chunk = TokenChunk(request.request_id, [], prompt_logprobs=PromptLogprobs(first, entries))
    outputs_to(request.gateway).tokens.append(chunk)
