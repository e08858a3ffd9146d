"""How one request samples and when it stops: the SamplingParams a Generate carries, checked
where they are made, so a worker never sees values it cannot run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs and vLLM allow


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops. Neutral defaults: plain sampling at T=1."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # None: a fresh random seed per request
    logit_bias: dict[int, float] = field(default_factory=dict)
    # llguidance's grammar: Lark (its dialect, JSON schemas inlined as %json) or its JSON form
    # (several grammars); the gateway writes every request's grammar so (docs/grammar.md)
    grammar: str | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to report per token (0: the sampled only)
    # The same for every prompt token after the first (completions' echo with logprobs);
    # None: no prompt logprobs. Such a prompt is evaluated whole: no prefix reuse.
    prompt_logprobs: int | None = None
    # Whether the worker may draft tokens for it (n-gram speculation, when the worker has it
    # on). The output is the same either way; off spends no compute on drafts.
    speculative: bool = True
    # A thinking budget (--reasoning-budget, thinking_token_budget): once the reply has
    # thought this many tokens, the worker writes the think block's end marker (think_end,
    # the model's tokens for it) in place of what it samples, so the answer still comes.
    # think_start: the tokens that open the block (empty: the prompt opened it already).
    think_budget: int = 0  # 0: none
    think_start: list[int] = field(default_factory=list)
    think_end: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            raise ValueError("temperature must be between 0 and 100")
        if self.top_k < 0:
            raise ValueError("top_k must be 0 (disabled) or positive")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError("min_p must be in [0, 1]")
        if not (0.0 < self.repeat_penalty <= 10.0):
            raise ValueError("repeat_penalty must be in (0, 10]")
        if self.repeat_last_n < -1:
            raise ValueError("repeat_last_n must be -1 (whole context), 0 (off) or positive")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError("presence_penalty must be between -2 and 2")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError("frequency_penalty must be between -2 and 2")
        if self.seed is not None and not (0 <= self.seed < 2**32):
            raise ValueError("seed must be between 0 and 2**32 - 1")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.think_budget < 0:
            raise ValueError("think_budget must be 0 (none) or positive")
        if self.think_budget and not self.think_end:
            raise ValueError("a think_budget needs the think block's end marker (think_end)")
        if any(t < 0 for t in self.think_start) or any(t < 0 for t in self.think_end):
            raise ValueError("think_start and think_end are token ids")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0 or (not math.isfinite(bias) and bias != -math.inf):
                raise ValueError("logit_bias maps token ids to finite biases (or -inf)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a repetition, presence or frequency penalty changes any logit."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
