"""Images in a prompt as the scheduler sees them: spans of positions. Plain Python.

An image takes a run of prompt positions (its embeddings, from worker/engine/media.py);
each position of it holds a placeholder, a negative id made from its content hash and the
position's offset in it, so the prefix cache and its keys treat an image as its hash at its
position: another image differs at its first position already (a 2**-31 chance that it
does not, and then at the next). The
scheduler plans an image's positions as prompt rows like any other where the worker can
write tokens as embedding rows (engine/token_rows.py): the tick's one pass then carries them
beside the other tokens, as embeddings (`in_token_pass`). Otherwise (a non-causal image,
which must go whole into one pass; M-RoPE's positions; a model whose token rows are not
exact) token runs stop at the next image, and the loop puts each image's embeddings in the
cache in passes of their own (a llama_batch is all tokens or all embeddings) before the
tick's token pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

# Token ids travel as 32-bit integers (prefix keys hash them as such): a placeholder is
# below zero and above -2**31.
PLACEHOLDER_SPAN = 2**31 - 1


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """One image in a prompt: the positions its embeddings take, and the embeddings."""

    start: int  # the prompt position of its first embedding
    embeddings: Any  # a float32 numpy array, one row of n_embd per position
    image_hash: str  # libmtmd's hash of the decoded bitmap
    # M-RoPE (Qwen-VL): the rope positions the image advances by, fewer than its tokens
    # (0: as many as its tokens), and each row's four positions (t, y, x, z): an int32 array
    # of 2 x n_tokens x 4, [0] for the image at rope position 0, [1] what each position
    # further adds (worker/engine/media.py); None for 1-D positions.
    n_pos: int = 0
    rope: Any = None
    # Its rows go in the ticks' token passes, planned as prompt rows (the loop's choice);
    # False: in passes of their own.
    in_token_pass: bool = False

    @property
    def n_tokens(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


def outside_image(media: tuple[MediaSpan, ...], index: int) -> int:
    """`index`, or the start of the image whose positions hold it: a reused prefix never
    ends inside an image, whose rows then go in from its start (a non-causal one must go
    whole into one pass; an M-RoPE one has all its cells at one position)."""
    span = media_at(media, index)
    return span.start if span is not None else index


def rope_position(media: tuple[MediaSpan, ...], index: int) -> int:
    """The rope position of prompt index `index`: the index, less what the images before it
    take in tokens beyond their positions (M-RoPE: an image of n tokens takes fewer). Inside
    an image: its start's, where all its cells sit (M-RoPE gives its rows one t)."""
    shift = 0
    for span in media:
        if index < span.end:
            if index > span.start and span.n_pos:
                return span.start - shift
            break
        if span.n_pos:
            shift += span.n_tokens - span.n_pos
    return index - shift


def placeholders(image_hash: str, n_tokens: int) -> list[int]:
    """The ids an image's positions hold in the scheduler's view of the prompt: negative, so
    never a token, and the image's own, so two images never share cached cells."""
    ids = []
    for offset in range(n_tokens):
        digest = hashlib.blake2b(f"{image_hash}:{offset}".encode(), digest_size=4).digest()
        ids.append(-1 - int.from_bytes(digest, "little") % PLACEHOLDER_SPAN)
    return ids


def media_at(media: tuple[MediaSpan, ...], position: int) -> MediaSpan | None:
    """The image whose positions hold `position`, if one does."""
    for span in media:
        if span.start <= position < span.end:
            return span
    return None


def text_until(media: tuple[MediaSpan, ...], position: int, end: int) -> int:
    """Where the token runs that start at `position` end: the next image that goes in passes
    of its own, else `end`."""
    return min(
        (span.start for span in media if span.start >= position and not span.in_token_pass),
        default=end,
    )
