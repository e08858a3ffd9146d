"""Log-probabilities from a logits row, after bias and penalties (worker/sampling/logprobs.py):
pure."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loomserve.protocol import SamplingParams
from loomserve.worker.sampling.logprobs import FLOOR, ROWS, prompt_logprobs, token_logprobs


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


LOGITS = np.array([1.0, 3.0, -2.0, 0.5, 2.0], dtype=np.float32)


def test_the_greedy_token_is_the_top_of_its_list() -> None:
    params = SamplingParams(temperature=0.0, logprobs=3)
    result = token_logprobs(LOGITS, 1, params, [], 64)
    expected = log_softmax(LOGITS)
    assert result.top_ids == [1, 4, 0]
    assert result.logprob == pytest.approx(expected[1], abs=1e-6)
    assert result.logprob == max(result.top_logprobs)
    assert result.top_logprobs == pytest.approx([expected[i] for i in (1, 4, 0)], abs=1e-6)
    assert math.fsum(math.exp(v) for v in log_softmax(LOGITS)) == pytest.approx(1.0)


def test_no_alternatives_when_zero_are_asked() -> None:
    result = token_logprobs(LOGITS, 3, SamplingParams(logprobs=0), [], 64)
    assert result.top_ids == [] and result.top_logprobs == []


def test_bias_and_penalties_as_the_sampler_chain_applies_them() -> None:
    params = SamplingParams(
        logprobs=2,
        logit_bias={2: 10.0, 4: -math.inf},
        repeat_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    generated = [1, 1, 3]  # token 1 twice, token 3 once
    result = token_logprobs(LOGITS, 4, params, generated, 64)
    adjusted = np.array([1.0, 3.0 / 2 - 2 * 0.5 - 0.25, 8.0, 0.5 / 2 - 0.5 - 0.25, -np.inf])
    expected = log_softmax(adjusted)
    assert result.top_ids == [2, 0]
    assert result.top_logprobs == pytest.approx([expected[2], expected[0]], abs=1e-5)
    assert result.logprob == FLOOR  # a token that cannot be chosen: -inf is not JSON


@pytest.mark.parametrize(
    "fields",
    [
        {"logit_bias": {7: 0.1, 300: -3.3, 999: -math.inf}},
        {"repeat_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": -0.4},
        {"logit_bias": {7: 2.5, 12: 0.1}, "repeat_penalty": 0.9, "frequency_penalty": 0.3},
    ],
)
def test_adjusted_logits_are_llama_cpps_bias_and_penalties_to_the_bit(fields) -> None:
    """What sample_rows writes into a row (logit_adjustments) is what llama.cpp's own
    logit_bias and penalties samplers make of it, bit for bit, a biased token penalised too."""
    import llama_cpp as llama

    from loomserve.worker.sampling.logprobs import adjusted_logits, logit_adjustments
    from tests.worker.llama_oracle import Candidates, llama_chain

    n_vocab = 1000
    rng = np.random.default_rng(len(fields))
    logits = (rng.standard_normal(n_vocab) * 4).astype(np.float32)
    generated = [int(t) for t in rng.integers(0, 40, 90)] + [7, 7, 12]  # repeats, in the window
    params = SamplingParams(temperature=0.0, repeat_last_n=64, **fields)
    stages = llama_chain(params, n_vocab, 64)
    candidates = Candidates(n_vocab)
    try:
        for token in generated:
            llama.llama_sampler_accept(stages, token)
        candidates.fill(logits)
        # Every stage but the last (greedy), which would sort nothing but select a token.
        for i in range(llama.llama_sampler_chain_n(stages) - 1):
            llama.llama_sampler_apply(llama.llama_sampler_chain_get(stages, i), candidates.pointer)
        expected = candidates.logits().copy()
    finally:
        llama.llama_sampler_free(stages)
    adjusted = adjusted_logits(logits, params, generated, 64)
    assert adjusted.tobytes() == expected.tobytes()
    found = logit_adjustments(logits, params, generated, 64)
    assert found is not None
    ids, values = found
    assert len(set(ids.tolist())) == len(ids)
    assert np.flatnonzero(adjusted != logits).tolist() <= sorted(ids.tolist())
    assert values.tobytes() == adjusted[ids].tobytes()


def test_penalties_see_only_their_window() -> None:
    params = SamplingParams(logprobs=1, repeat_penalty=3.0, repeat_last_n=1)
    result = token_logprobs(LOGITS, 1, params, [1, 1, 4], 64)  # only the last token, 4
    adjusted = LOGITS.astype(np.float64).copy()
    adjusted[4] /= 3.0
    assert result.logprob == pytest.approx(log_softmax(adjusted)[1], abs=1e-6)
    assert LOGITS[4] == 2.0  # the loop's logits are never written to


def test_prompt_rows_score_the_tokens_that_follow_them_block_by_block() -> None:
    rng = np.random.default_rng(3)
    n_rows = ROWS * 2 + 5  # three blocks, the last one short
    logits = rng.normal(size=(n_rows + 1, 50)).astype(np.float32) * 4  # one row too many
    next_tokens = rng.integers(0, 50, size=n_rows).tolist()
    # Bias and penalties belong to sampling: the prompt's scores ignore them.
    params = SamplingParams(logprobs=3, logit_bias={0: 5.0})
    entries = prompt_logprobs(logits, next_tokens, 3)
    assert len(entries) == n_rows
    for row, (entry, token) in enumerate(zip(entries, next_tokens, strict=True)):
        expected = log_softmax(logits[row])
        assert entry.logprob == pytest.approx(expected[token], abs=1e-5)
        assert entry.top_ids == np.argsort(-expected, kind="stable")[:3].tolist()
        assert entry.top_logprobs == pytest.approx(np.sort(expected)[::-1][:3], abs=1e-5)
        assert entry != token_logprobs(logits[row], token, params, [], 64)
