"""Images in a prompt as the scheduler sees them: spans of positions. Plain Python.

An image takes a run of prompt positions (its embeddings, from worker/engine/media.py);
every position of it holds the image's placeholder, a negative id made from its content
hash, so the prefix cache and its keys treat an image as its hash at its position. The
scheduler plans token runs up to the next image only (Slot.prompt_remaining); the loop puts
each image's embeddings in the cache in passes of their own (a llama_batch is all tokens or
all embeddings) before the tick's token pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PLACEHOLDER_BITS = 60  # of the image's hash, in its placeholder id


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One image in a prompt: the positions its embeddings take, and the embeddings."""

    start: int  # the prompt position of its first embedding
    embeddings: Any  # a float32 numpy array, one row of n_embd per position
    image_hash: str  # libmtmd's hash of the decoded bitmap

    @property
    def n_tokens(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


def placeholder(image_hash: str) -> int:
    """The id every position of an image holds in the scheduler's view of the prompt: negative,
    so never a token, and the image's own, so two images never share cached cells."""
    return -1 - (int(image_hash[:16], 16) >> (64 - PLACEHOLDER_BITS))


def media_at(media: tuple[MediaSpan, ...], position: int) -> MediaSpan | None:
    """The image whose positions hold `position`, if one does."""
    for span in media:
        if span.start <= position < span.end:
            return span
    return None


def text_until(media: tuple[MediaSpan, ...], position: int, end: int) -> int:
    """Where the text that starts at `position` ends: the next image's start, else `end`."""
    return min((span.start for span in media if span.start >= position), default=end)
