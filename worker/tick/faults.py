"""Test-only fault injection: make the tick loop's forward pass raise.

The fault tests (tests/e2e/test_faults.py) start a worker with LOOMSERVE_TEST_FAIL_DECODE set:
`once` makes the first forward pass raise, `every` makes every one raise. It exists to test
how the worker fails; never set it on a server.
"""

from __future__ import annotations

import os

ENV_VAR = "LOOMSERVE_TEST_FAIL_DECODE"
MODES = ("once", "every")


class InjectedFault(RuntimeError):
    """The exception an injected fault raises inside a tick."""


class DecodeFaults:
    """Raises InjectedFault before forward passes, as the environment asks."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"{ENV_VAR} must be one of {', '.join(MODES)}")
        self.mode = mode
        self.raised = 0

    @classmethod
    def from_env(cls) -> DecodeFaults | None:
        mode = os.environ.get(ENV_VAR)
        return cls(mode) if mode else None

    def before_forward(self) -> None:
        if self.mode == "every" or self.raised == 0:
            self.raised += 1
            raise InjectedFault(f"fault injected by {ENV_VAR}={self.mode}")
