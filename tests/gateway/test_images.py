"""The gateway's image parts (gateway/request/images.py): URLs read, headers checked, and the
prompt tokenized around the media markers. Pure, but for the tiny model's vocabulary."""

from __future__ import annotations

import base64
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from loomserve.gateway.api.errors import APIError
from loomserve.gateway.request import images
from loomserve.gateway.request.images import MEDIA_MARKER, ImageLimits
from loomserve.gateway.text.tokenizer import Vocab
from tests.tiny_vision_model import png_bytes, png_header

LIMITS = ImageLimits(max_bytes=4096, max_side=64)


def jpeg_header(width: int, height: int) -> bytes:
    app0 = (
        b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    )
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof


@pytest.mark.parametrize(
    ("data", "size"),
    [
        (png_bytes(40, 24), (40, 24)),
        (png_header(20_000, 20_000), (20_000, 20_000)),
        (jpeg_header(33, 17), (33, 17)),
        (b"GIF89a" + struct.pack("<HH", 5, 6) + b"\x00" * 8, (5, 6)),
        (b"BM" + b"\x00" * 16 + struct.pack("<ii", 7, -9) + b"\x00" * 8, (7, 9)),
        (b"hello", None),
        (b"\x89PNG\r\n\x1a\n", None),  # cut before its header
        (b"\xff\xd8\xff", None),
    ],
)
def test_image_sizes_come_from_the_header(data: bytes, size: tuple[int, int] | None) -> None:
    assert images.image_size(data) == size


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def refusal(url: str, limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(APIError) as error:
        images.check_image(images.read_url(url, "messages[0].content[0]", limits), "p", limits)
    assert error.value.status == 400
    return str(error.value.message)


def test_data_urls_are_read_and_checked() -> None:
    good = png_bytes(32, 32)
    assert images.check_image(images.read_url(data_url(good), "p", LIMITS), "p", LIMITS) == good
    assert "not a PNG" in refusal(data_url(b"plain text"))
    assert "65x65" in refusal(data_url(png_header(65, 65)))
    assert "over 4096 bytes" in refusal(data_url(png_bytes(64, 64, seed=3)))
    assert "base64" in refusal("data:image/png;base64,!!")
    assert "base64" in refusal("data:image/png,rawbytes")


def test_remote_urls_only_from_allowed_domains() -> None:
    assert "not fetched from 'example.com'" in refusal("https://example.com/cat.png")
    assert "data: URL, http(s) or file://" in refusal("ftp://example.com/cat.png")
    assert "--media-path" in refusal("file:///etc/passwd")
    allowed = ImageLimits(allowed_domains=("127.0.0.1",), fetch_timeout=2.0)
    assert "could not be fetched" in refusal("http://127.0.0.1:1/cat.png", allowed)


def test_parts_are_found_in_order_and_refused_for_a_text_model() -> None:
    part = SimpleNamespace(type="image_url", image_url={"url": "data:x"})
    text = SimpleNamespace(type="text", text="hi")
    messages = [
        SimpleNamespace(content="plain"),
        SimpleNamespace(content=[text, part]),
        SimpleNamespace(content=[part]),
    ]
    assert images.image_parts(messages) == [
        ("messages[1].content[1]", "data:x"),
        ("messages[2].content[0]", "data:x"),
    ]
    with pytest.raises(APIError, match=r"messages\[1\]\.content\[1\]: model 'm' reads no images"):
        images.refuse_images(messages, "m")


@pytest.fixture(scope="module")
def vocab(tiny_model_path: Path) -> Vocab:
    return Vocab(tiny_model_path)


def test_the_prompt_is_tokenized_around_the_markers(vocab: Vocab) -> None:
    text = f"look{MEDIA_MARKER}{MEDIA_MARKER} at it{MEDIA_MARKER}"
    tokens, image_at = images.image_tokens(vocab, text, 3)
    look = vocab.tokenize("look", add_special=False, parse_special=True)
    at_it = vocab.tokenize(" at it", add_special=False, parse_special=True)
    assert tokens == [vocab.bos_id, *look, *at_it]
    assert image_at == [1 + len(look), 1 + len(look), len(tokens)]
    with pytest.raises(APIError, match="rendered 3 image markers for 2 images"):
        images.image_tokens(vocab, text, 2)


def test_local_files_only_under_the_media_path(tmp_path: Path) -> None:
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "cat.png").write_bytes(png_bytes(16, 16))
    (tmp_path / "secret.png").write_bytes(png_bytes(16, 16))
    (folder / "link.png").symlink_to(tmp_path / "secret.png")
    allowed = ImageLimits(max_bytes=4096, max_side=64, media_path=folder)
    read = images.read_url(f"file://{folder / 'cat.png'}", "p", allowed)
    assert read == png_bytes(16, 16)
    assert "--media-path" in refusal(f"file://{folder / 'cat.png'}")  # none given
    for outside in (tmp_path / "secret.png", folder / "link.png", folder / "../secret.png"):
        assert "no image file" in refusal(f"file://{outside}", allowed)


def test_an_allowed_host_is_fetched_and_its_redirects_are_not_followed() -> None:
    import http.server
    import threading

    image = png_bytes(16, 16, seed=4)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/cat.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(image)))
                self.end_headers()
                self.wfile.write(image)
            else:  # elsewhere: a redirect, which could lead off the allowed hosts
                self.send_response(302)
                self.send_header("Location", "http://example.com/cat.png")
                self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        allowed = ImageLimits(allowed_domains=("127.0.0.1",), fetch_timeout=5.0)
        assert images.read_url(f"{base}/cat.png", "p", allowed) == image
        assert "could not be fetched" in refusal(f"{base}/moved.png", allowed)
        small = ImageLimits(max_bytes=100, allowed_domains=("127.0.0.1",), fetch_timeout=5.0)
        assert "over 100 bytes" in refusal(f"{base}/cat.png", small)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
