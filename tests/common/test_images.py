"""Images checked on the API's side (llmq/common/images): decoded whole with Pillow within the
limits, links fetched from public addresses only (or an operator's allowlist), every redirect
checked, within a size and time limit. A local HTTP server stands for the image host."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import socket
import struct
import threading
import zlib
from contextlib import contextmanager

import pytest
from PIL import Image

from llmq.common.errors import InvalidRequest
from llmq.common.images.decode import check_image, data_url_bytes
from llmq.common.images.fetch import checked_address, fetch_image
from llmq.common.images.request import ImageRef, checked_images
from llmq.common.settings import get_settings

pytestmark = pytest.mark.unit


def png(width: int = 8, height: int = 6, color=(200, 30, 60)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixels never follow): a pixel bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def settings(monkeypatch):
    def set_(**values):
        for name, value in values.items():
            monkeypatch.setenv(f"LLMQ_{name.upper()}", str(value))
        get_settings.cache_clear()

    yield set_
    monkeypatch.undo()
    get_settings.cache_clear()


def test_a_png_is_checked_and_content_addressed():
    data = png()
    image = check_image(data_url_bytes(data_url(data), "p"), "p")
    assert (image.format, image.width, image.height) == ("PNG", 8, 6)
    assert image.digest == check_image(data, "q").digest
    assert image.digest != check_image(png(color=(0, 0, 0)), "p").digest


@pytest.mark.parametrize(
    "data, problem",
    [
        (png()[:-30], "does not decode"),
        (png_header(20_000, 20_000), "400000000 pixels.*LLMQ_MAX_IMAGE_PIXELS"),
        (png_header(5_000, 5_000), "5000 x 5000 = 25000000 pixels"),
        (b"not an image at all", "not an image"),
        (b"II*\0" + bytes(200), "not an image"),  # a TIFF's magic: not a served format
    ],
    ids=["truncated", "20000x20000", "5000x5000", "not-an-image", "tiff-magic"],
)
def test_a_bad_image_is_a_400_naming_the_problem(data, problem):
    with pytest.raises(InvalidRequest, match=problem) as caught:
        check_image(data, "messages[0].content[1].image_url")
    assert caught.value.status == 400
    assert caught.value.param == "messages[0].content[1].image_url"


def test_a_tiff_is_refused_by_name():
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, "TIFF")
    with pytest.raises(InvalidRequest, match="TIFF images are not served"):
        check_image(out.getvalue(), "p")


def test_size_and_pixel_limits_are_settings(settings):
    settings(max_image_bytes=100, max_image_pixels=40)
    with pytest.raises(InvalidRequest, match="LLMQ_MAX_IMAGE_BYTES"):
        data_url_bytes(data_url(bytes(300)), "p")
    settings(max_image_bytes=10**6)
    with pytest.raises(InvalidRequest, match="8 x 6 = 48 pixels; at most 40"):
        check_image(png(), "p")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://10.1.2.3/a.png",
        "http://localhost/a.png",
        "http://0.0.0.0/a.png",
    ],
)
def test_links_to_non_public_addresses_are_refused(url):
    import httpx

    with pytest.raises(InvalidRequest, match="not fetched"):
        asyncio.run(checked_address(httpx.URL(url), "p"))


def test_other_schemes_are_refused():
    import httpx

    with pytest.raises(InvalidRequest, match="http"):
        asyncio.run(checked_address(httpx.URL("file:///etc/passwd"), "p"))


class _Images(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.hits.append(self.path)
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextmanager
def image_host(routes):
    _Images.routes, _Images.hits = routes, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _Images.hits
    finally:
        server.shutdown()
        server.server_close()


def test_an_allowed_host_is_fetched_and_each_redirect_checked(settings):
    data = png()
    routes = {
        "/a.png": (200, {"Content-Type": "image/png"}, data),
        "/moved": (302, {"Location": "/a.png"}, b""),
        "/metadata": (302, {"Location": "http://169.254.169.254/latest/"}, b""),
        "/big": (200, {}, bytes(5000)),
    }
    with image_host(routes) as (base, hits):
        with pytest.raises(InvalidRequest, match="127.0.0.1.*not fetched"):
            asyncio.run(fetch_image(f"{base}/a.png", "p"))
        assert hits == []  # refused before any connection
        settings(image_fetch_allow="127.0.0.0/8", max_image_bytes=4000)
        assert asyncio.run(fetch_image(f"{base}/moved", "p")) == data
        with pytest.raises(InvalidRequest, match="169.254.169.254"):
            asyncio.run(fetch_image(f"{base}/metadata", "p"))
        with pytest.raises(InvalidRequest, match="larger than 4000 bytes"):
            asyncio.run(fetch_image(f"{base}/big", "p"))
        with pytest.raises(InvalidRequest, match="HTTP 404"):
            asyncio.run(fetch_image(f"{base}/none", "p"))
        assert hits == ["/moved", "/a.png", "/metadata", "/big", "/none"]


def test_a_host_that_never_answers_is_a_400_after_the_timeout(settings):
    settings(image_fetch_allow="127.0.0.1", image_fetch_timeout=0.3)
    with socket.socket() as listener:  # accepts (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/a.png"
        with pytest.raises(InvalidRequest, match="longer than 0.3 s"):
            asyncio.run(fetch_image(url, "p"))


def test_a_text_model_refuses_by_name_after_the_checks_and_before_any_fetch(settings):
    with image_host({"/a.png": (200, {}, png())}) as (base, hits):
        settings(image_fetch_allow="127.0.0.1")
        refs = [ImageRef("m[0]", data_url(png())), ImageRef("m[1]", f"{base}/a.png")]
        with pytest.raises(InvalidRequest, match="'tiny' is a text model") as caught:
            asyncio.run(checked_images(refs, "tiny", takes_images=False))
        assert caught.value.param == "m[0]" and hits == []
        bad = [ImageRef("m[0]", data_url(png()[:-30])), *refs]
        with pytest.raises(InvalidRequest, match="m\\[0\\].*does not decode"):
            asyncio.run(checked_images(bad, "tiny", takes_images=False))
        images = asyncio.run(checked_images(refs, "vlm", takes_images=True))
        assert [i.digest for i in images] == [images[0].digest] * 2 and hits == ["/a.png"]


def test_more_images_than_allowed_is_a_400(settings):
    settings(max_images=3)
    refs = [ImageRef(f"m[{i}]", "data:,") for i in range(4)]
    with pytest.raises(InvalidRequest, match="4 images; at most 3"):
        asyncio.run(checked_images(refs, "tiny", takes_images=True))


def test_a_link_by_name_is_resolved_only_for_a_model_that_takes_images():
    refs = [ImageRef("m[0]", "http://no-such-host.invalid/a.png")]
    with pytest.raises(InvalidRequest, match="text model"):
        asyncio.run(checked_images(refs, "tiny", takes_images=False))
    with pytest.raises(InvalidRequest, match="does not resolve"):
        asyncio.run(checked_images(refs, "vlm", takes_images=True))
