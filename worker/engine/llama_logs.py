"""What llama.cpp says while the worker runs: its log, which arrives in pieces, as whole
structlog lines at the right level (LlamaLogLines), and a long model load's progress
(LoadProgress)."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import llama_cpp as llama
import structlog

log = structlog.get_logger(__name__)

PROGRESS_EVERY_S = 2.0  # a load this long gets a progress line; a quicker one says nothing


class LoadProgress:
    """Logs the start of a model load, then its progress every PROGRESS_EVERY_S seconds: a
    large model onto a GPU takes long enough to wonder. A mapped file on a CPU loads in
    milliseconds; `model loaded` (server.py) then follows at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = self.logged_at = time.monotonic()
        # Held here so the C callback outlives the load.
        self.callback = llama.llama_progress_callback(self._on_progress)
        log.info("loading model", path=str(path))

    def _on_progress(self, progress: float, _user_data: ctypes.c_void_p) -> bool:
        now = time.monotonic()
        if now - self.logged_at >= PROGRESS_EVERY_S and progress < 1.0:
            self.logged_at = now
            log.info(
                "loading model",
                path=str(self.path),
                percent=int(progress * 100),
                seconds=round(now - self.started, 1),
            )
        return True  # false would abort the load


# ggml's levels: 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous line.
GGML_LOG_DEBUG, GGML_LOG_INFO, GGML_LOG_WARN, GGML_LOG_ERROR, GGML_LOG_CONT = 1, 2, 3, 4, 5
_llama_log = structlog.get_logger("llama.cpp")
# With one KV cache shared by all slots, llama.cpp compares the whole cache with the training
# context and warns; each slot is held to its own share, so the warning says nothing true.
UNIFIED_CACHE_FALSE_ALARM = "possible training context overflow"
# Warnings with nothing in them for whoever serves the model, so debug lines: about the model
# file, which llama.cpp corrects as it loads it (a token's type); and that the sliding-window
# layers keep a full-size cache, llama_context's default, which a cached prefix needs whole.
EXPECTED_WARNINGS = ("was not control-type", "using full-size SWA cache")


class LlamaLogLines:
    """llama.cpp's log, which arrives in pieces (a line may end in a later CONT call), as
    whole lines to structlog: errors as errors, warnings as warnings (less the false alarm and
    the expected ones), its chatty info and debug lines at debug."""

    def __init__(self) -> None:
        self.level = GGML_LOG_INFO
        self.partial = ""

    def feed(self, level: int, text: str) -> None:
        if level != GGML_LOG_CONT:
            if self.partial:
                self._emit(self.partial)
                self.partial = ""
            self.level = level
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        for line in lines:
            self._emit(line)

    def _emit(self, line: str) -> None:
        message = line.strip()
        if not message or UNIFIED_CACHE_FALSE_ALARM in message:
            return
        if self.level == GGML_LOG_ERROR:
            _llama_log.error(message)
        elif self.level == GGML_LOG_WARN and not any(s in message for s in EXPECTED_WARNINGS):
            _llama_log.warning(message)
        else:
            _llama_log.debug(message)


_llama_lines = LlamaLogLines()


@llama.llama_log_callback
def _forward_llama_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    _llama_lines.feed(level, text.decode(errors="replace"))


def route_llama_logs() -> None:
    """Send llama.cpp's log to structlog (LlamaLogLines) instead of raw lines on stderr."""
    llama.llama_log_set(_forward_llama_log, ctypes.c_void_p(0))
