"""llama.cpp's own samplers, as oracles: what the worker's sampling (draw.py, logprobs.py,
guidance.py) must agree with, run through llama.cpp's sampler chain over a token array."""

from __future__ import annotations

import ctypes

import llama_cpp as llama
import numpy as np

from loomserve.protocol import SamplingParams
from loomserve.worker.sampling.backend_sampling import drawing_stages, sampler_chain

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Candidates:
    """A llama_token_data_array over the whole vocabulary, filled from a row of logits.

    llama.cpp's own samplers run over it, as llama_sampler_sample builds it.
    """

    __slots__ = ("_buffer", "_ids", "array", "pointer")

    def __init__(self, n_vocab: int) -> None:
        self._buffer = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.array = llama.llama_token_data_array()
        self.pointer = ctypes.pointer(self.array)

    def fill(self, logits: np.ndarray) -> None:
        """Every token with its logit, unsorted and none selected, as llama_sampler_sample
        builds them."""
        buffer = self._buffer
        buffer["id"] = self._ids  # again each time: samplers sort the entries in place
        buffer["logit"] = logits
        buffer["p"] = 0.0
        array = self.array
        # llama_cpp annotates `data` as an array; the C field is a pointer, which this is.
        pointer = buffer.ctypes.data_as(ctypes.POINTER(llama.llama_token_data))
        array.data = pointer  # type: ignore[assignment]
        array.size = len(buffer)
        array.selected = -1
        array.sorted = False

    def selected(self) -> int:
        """The token the chain's last stage selected."""
        return int(self._buffer["id"][self.array.selected])

    def logits(self) -> np.ndarray:
        """The entries' logits as the samplers left them (a view; in id order unless a stage
        sorted them: logit bias, penalties and greedy do not)."""
        return self._buffer["logit"][: self.array.size]

    def first_maximum(self) -> int:
        """The greedy choice over the entries as they are, which must still be in id order
        (a grammar mask leaves them so): llama.cpp's greedy sampler picks the first maximum."""
        return int(self._buffer["logit"][: self.array.size].argmax())

    def surviving(self) -> np.ndarray:
        """The ids whose logit is not -inf."""
        entries = self._buffer[: self.array.size]
        return entries["id"][entries["logit"] != -np.inf]


def llama_chain(params: SamplingParams, n_vocab: int, slot_context: int) -> llama.llama_sampler_p:
    """llama.cpp's sampler chain for the params: logit bias, penalties, then greedy, or
    top-k, top-p, min-p, temperature and dist."""
    stages: list[llama.llama_sampler_p] = []
    if params.logit_bias:
        biases = (llama.llama_logit_bias * len(params.logit_bias))(
            *(llama.llama_logit_bias(t, b) for t, b in params.logit_bias.items())
        )
        stages.append(llama.llama_sampler_init_logit_bias(n_vocab, len(biases), biases))
    if params.penalized:
        last_n = slot_context if params.repeat_last_n == -1 else params.repeat_last_n
        args = (last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
        stages.append(llama.llama_sampler_init_penalties(n_vocab, *args))
    stages += drawing_stages(params, n_vocab)
    return sampler_chain(stages)
