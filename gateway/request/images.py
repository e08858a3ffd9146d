"""A chat's images: each image part's bytes, checked, and where each goes in the prompt.

An image part (`image_url` with a data: URL, an http(s) URL on an allowed domain, or a
file:// URL under --media-path) becomes
libmtmd's media marker in the rendered chat; the prompt is tokenized around the markers and
the Generate carries the images' bytes and positions (protocol Generate.images, image_at):
the worker's projector tokenizes and encodes each one there (worker/engine/media.py). Every
check a gateway can make without decoding pixels is here, so a bad image is a 400 naming
its part: not a PNG, JPEG, GIF or BMP file, too many bytes, too many pixels a side. What
only decoding finds (a truncated file) the worker refuses, also as a 400.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ...protocol import MAX_FRAME_BYTES
from ...protocol.messages import MAX_IMAGES
from ..api.errors import invalid_request
from ..text.tokenizer import Vocab

MEDIA_MARKER = "<__media__>"  # libmtmd's default marker: the worker puts the image there
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
# The images of one Generate and its prompt go in one frame to the worker.
MAX_REQUEST_IMAGE_BYTES = MAX_FRAME_BYTES - 1024 * 1024


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What the gateway takes (GatewayConfig's max_image_bytes, max_image_side,
    allowed_media_domains, media_fetch_timeout)."""

    max_bytes: int = 10 * 1024 * 1024
    max_side: int = 8192
    allowed_domains: tuple[str, ...] = ()
    fetch_timeout: float = 10.0
    media_path: Path | None = None  # file:// URLs may name files under it (--media-path)


def image_parts(messages: list[Any]) -> list[tuple[str, str]]:
    """(param, url) of every image part of the chat's messages, in order."""
    found = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.type in IMAGE_PART_TYPES:
                found.append((f"messages[{i}].content[{j}]", _url_of(part)))
    return found


def _url_of(part: Any) -> str:
    value = getattr(part, "image_url", None)
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else ""


def refuse_images(messages: list[Any], model: str) -> None:
    """400 naming the first image part, for a model that reads no images."""
    parts = image_parts(messages)
    if parts:
        param = parts[0][0]
        raise invalid_request(
            f"{param}: model {model!r} reads no images (its workers have no vision "
            "projector, --mmproj); send text",
            "messages",
        )


def load_images(messages: list[Any], limits: ImageLimits) -> list[bytes]:
    """Every image of the messages, in order, read and checked; 400 naming the bad one.
    An http(s) URL is fetched (blocking: call it in a thread)."""
    parts = image_parts(messages)
    if len(parts) > MAX_IMAGES:
        raise invalid_request(f"at most {MAX_IMAGES} images a request", "messages")
    images = [check_image(read_url(url, param, limits), param, limits) for param, url in parts]
    if sum(map(len, images)) > MAX_REQUEST_IMAGE_BYTES:
        raise invalid_request(
            f"the images hold more than {MAX_REQUEST_IMAGE_BYTES} bytes in all", "messages"
        )
    return images


def read_url(url: str, param: str, limits: ImageLimits) -> bytes:
    """The bytes of a data: URL, or of an http(s) URL on an allowed domain."""
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise invalid_request(
                f"{param}: a data: URL must be base64 (data:image/...;base64,)", param
            )
        if len(payload) > (limits.max_bytes + 2) // 3 * 4 + 4:
            raise invalid_request(f"{param}: the image is over {limits.max_bytes} bytes", param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise invalid_request(f"{param}: the data: URL is not valid base64", param) from None
    parsed = urlsplit(url)
    if parsed.scheme == "file":
        return _local_file(unquote(parsed.path), param, limits)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise invalid_request(f"{param}: an image URL is a data: URL, http(s) or file://", param)
    if parsed.hostname.lower() not in limits.allowed_domains:
        raise invalid_request(
            f"{param}: images are not fetched from {parsed.hostname!r}; send a data: URL "
            "(the server's --allowed-media-domains says which hosts it fetches from)",
            param,
        )
    return _fetch(url, param, limits)


def _local_file(path: str, param: str, limits: ImageLimits) -> bytes:
    """A file:// URL's bytes: only a file under --media-path, links resolved first."""
    root = limits.media_path
    if root is None:
        raise invalid_request(
            f"{param}: file:// URLs are refused (the server's --media-path would allow them)",
            param,
        )
    resolved = Path(os.path.realpath(path))
    if not resolved.is_relative_to(os.path.realpath(root)) or not resolved.is_file():
        raise invalid_request(f"{param}: no image file {path!r} under the media path", param)
    if resolved.stat().st_size > limits.max_bytes:
        raise invalid_request(f"{param}: the image is over {limits.max_bytes} bytes", param)
    return resolved.read_bytes()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect could lead off the allowed domains: it is an error instead."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _fetch(url: str, param: str, limits: ImageLimits) -> bytes:
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(url, timeout=limits.fetch_timeout) as response:
            data = response.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise invalid_request(f"{param}: the image could not be fetched: {exc}", param) from None
    if len(data) > limits.max_bytes:
        raise invalid_request(f"{param}: the image is over {limits.max_bytes} bytes", param)
    return data


def check_image(data: bytes, param: str, limits: ImageLimits) -> bytes:
    """The image's bytes when its size and its header pass; 400 otherwise."""
    if len(data) > limits.max_bytes:
        raise invalid_request(f"{param}: the image is over {limits.max_bytes} bytes", param)
    size = image_size(data)
    if size is None:
        raise invalid_request(f"{param}: not a PNG, JPEG, GIF or BMP image", param)
    width, height = size
    if not (0 < width <= limits.max_side and 0 < height <= limits.max_side):
        raise invalid_request(
            f"{param}: the image is {width}x{height} pixels; at most {limits.max_side} a side",
            param,
        )
    return data


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG, GIF, BMP or JPEG header; None for anything else."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", data[6:10])
        if data.startswith(b"BM"):
            width, height = struct.unpack("<ii", data[18:26])
            return width, abs(height)
        if data.startswith(b"\xff\xd8"):
            return _jpeg_size(data)
    except struct.error:  # shorter than its header
        return None
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The frame header's size: segments are walked from the start to the first SOFn."""
    i = 2
    while i + 9 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return width, height
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        i += 2 + length
    return None


def image_tokens(vocab: Vocab, text: str, n_images: int) -> tuple[list[int], list[int]]:
    """A rendered chat's token ids with BOS once (as prompts.chat_tokens) and where each image
    goes: the text is tokenized around its media markers, as libmtmd tokenizes it."""
    pieces = text.split(MEDIA_MARKER)
    if len(pieces) - 1 != n_images:
        raise invalid_request(
            f"the chat rendered {len(pieces) - 1} image markers for {n_images} images (a "
            f"message's text may not hold {MEDIA_MARKER!r}, and the template must keep every "
            "image)",
            "messages",
        )
    tokens: list[int] = []
    image_at: list[int] = []
    for index, piece in enumerate(pieces):
        if index:
            image_at.append(len(tokens))
        if piece:
            tokens += vocab.tokenize(piece, add_special=False, parse_special=True)
    if vocab.add_bos and vocab.bos_id >= 0 and (not tokens or tokens[0] != vocab.bos_id):
        tokens.insert(0, vocab.bos_id)
        image_at = [at + 1 for at in image_at]
    if not tokens:
        raise invalid_request("the messages render to an empty prompt", "messages")
    return tokens, image_at
