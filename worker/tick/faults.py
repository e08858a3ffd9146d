"""Test-only fault injection: make the tick loop's forward pass raise, or stick in native code.

The fault tests start a worker with:
- LOOMSERVE_TEST_FAIL_DECODE: `once` makes the first forward pass raise, `every` makes every
  one raise (tests/e2e/test_faults.py);
- LOOMSERVE_TEST_STUCK_TICK=N: the forward pass after N others blocks for good in a native
  call (libc's sleep, which holds the tick's thread as a native loop would: Python's signal
  handlers cannot run there), so that the watchdog and the stop signals are tested on a tick
  that is stuck for real (tests/e2e/test_grammar_faults.py).
They exist to test how the worker fails; never set them on a server.
"""

from __future__ import annotations

import ctypes
import os

ENV_VAR = "LOOMSERVE_TEST_FAIL_DECODE"
STUCK_ENV = "LOOMSERVE_TEST_STUCK_TICK"
MODES = ("once", "every")
STUCK_SECONDS = 3600


class InjectedFault(RuntimeError):
    """The exception an injected fault raises inside a tick."""


class DecodeFaults:
    """Raises InjectedFault before forward passes, or sticks one, as the environment asks."""

    def __init__(self, mode: str | None, stuck_after: int | None = None) -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"{ENV_VAR} must be one of {', '.join(MODES)}")
        self.mode = mode
        self.stuck_after = stuck_after
        self.raised = 0
        self.passes = 0

    @classmethod
    def from_env(cls) -> DecodeFaults | None:
        mode = os.environ.get(ENV_VAR) or None
        stuck = os.environ.get(STUCK_ENV)
        if mode is None and not stuck:
            return None
        return cls(mode, int(stuck) if stuck else None)

    def before_forward(self) -> None:
        self.passes += 1
        if self.stuck_after is not None and self.passes > self.stuck_after:
            ctypes.CDLL(None).sleep(STUCK_SECONDS)
        if self.mode == "every" or (self.mode == "once" and self.raised == 0):
            self.raised += 1
            raise InjectedFault(f"fault injected by {ENV_VAR}={self.mode}")
