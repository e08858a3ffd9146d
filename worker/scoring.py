"""After the forward pass, what the scheduler's update takes: each slot's sampled tokens with
their log-probabilities (SamplingParams.logprobs) as a Sampled; and, for a request that scores
its prompt (SamplingParams.prompt_logprobs), its prompt tokens' from the logits on every prompt
token. logprobs.py computes them; this reads the rows of a step's output logits.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from loomserve.protocol import PromptLogprobs, TokenChunk
from loomserve.worker.logprobs import prompt_logprobs, token_logprobs
from loomserve.worker.outputs import PendingOutputs
from loomserve.worker.slots import Run, Sampled, Slot, Step


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
    step: Step, output_logits: Callable[[int], np.ndarray], outputs: PendingOutputs
) -> np.ndarray:
    """Send the prompt logprobs of the step's scoring runs; return the logits rows of the
    sampled slots (in batch order, as the loop's _sample reads them)."""
    n_outputs = sum(len(run.tokens) if run.score else run.sample for run in step.runs)
    logits = output_logits(n_outputs)
    rows, sampled_rows = 0, []
    for run in step.runs:
        if run.score:
            _send_prompt_logprobs(run, logits[rows : rows + len(run.tokens)], outputs)
            rows += len(run.tokens)
            if run.sample:
                sampled_rows.append(rows - 1)
        elif run.sample:
            sampled_rows.append(rows)
            rows += 1
    return logits[sampled_rows]


def _send_prompt_logprobs(run: Run, rows: np.ndarray, outputs: PendingOutputs) -> None:
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
    outputs.to(request.gateway).tokens.append(chunk)
