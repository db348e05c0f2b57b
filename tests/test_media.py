"""Image loading and its guards (jaxserve/multimodal/media.py): data: and file:// URLs, fetching over HTTP
from a loopback server (address checks, allowed domains, byte limit, deadline, redirects), decompression
bombs refused from the header, truncated and undecodable images, each an InvalidMedia naming the field."""

import base64
import io
import socket
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from jaxserve.errors import InvalidMedia, InvalidParameter
from jaxserve.multimodal.media import MediaPolicy, image_hash, load_image, public_address

FIELD = "messages[0].content[1].image_url.url"
LOCAL = MediaPolicy(allowed_domains=("127.0.0.1",), fetch_timeout_s=2.0)


def png_bytes(size=(24, 16), mode="RGB", seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = rng.integers(0, 256, size=(size[1], size[0], channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def refused(source, policy=MediaPolicy(), match: str = "") -> InvalidMedia:
    with pytest.raises(InvalidMedia, match=match) as info:
        load_image(source, policy, FIELD)
    assert info.value.param == FIELD and FIELD in str(info.value)
    return info.value


def test_invalid_media_is_a_400_naming_the_field():
    assert issubclass(InvalidMedia, InvalidParameter) and issubclass(InvalidMedia, ValueError)


# --------------------------------------------------------------------------- data: URLs
def test_data_url_decodes_and_tolerates_wrapped_base64():
    data = png_bytes()
    image = load_image(data_url(data), MediaPolicy(), FIELD)
    assert image.size == (24, 16) and image.mode == "RGB"
    encoded = base64.b64encode(data).decode()
    wrapped = "data:image/png;base64," + "\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))
    assert load_image(wrapped, MediaPolicy(), FIELD).size == (24, 16)


def test_bad_data_urls_are_refused():
    refused("data:image/png," + "abc", match="must be base64")
    refused("data:image/png;base64,@@@not base64@@@", match="not valid base64")
    refused(data_url(b"hello", "text/plain"), match="not an image")
    refused(data_url(png_bytes()), MediaPolicy(max_bytes=100), match="larger than 100 bytes")


def test_unsupported_schemes_and_types_are_refused():
    refused("ftp://example.com/cat.png", match="unsupported image URL scheme 'ftp'")
    refused("cat.png", match="unsupported image URL scheme")
    with pytest.raises(InvalidMedia, match="must be an image URL"):
        load_image(12, MediaPolicy(), FIELD)


# --------------------------------------------------------------------------- decoding
def bomb_header(width: int, height: int) -> bytes:
    """A PNG whose header announces width x height pixels, with no pixel data at all."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_decompression_bombs_are_refused_from_the_header():
    refused(data_url(bomb_header(9000, 9000)), match="9000x9000 pixels, more than the limit of 50000000")
    refused(data_url(bomb_header(200_000, 200_000)), match="more than")  # past PIL's own bomb limit too
    refused(data_url(png_bytes((24, 16))), MediaPolicy(max_pixels=300), match="24x16 pixels")


def test_truncated_and_undecodable_images_are_refused():
    data = png_bytes((64, 64))
    refused(data_url(data[: len(data) // 2]), match="truncated or corrupt")
    refused(data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 40), match="not an image that can be decoded")
    refused(data_url(b"certainly not an image" * 4), match="not an image that can be decoded")


def test_pil_images_pass_through_with_the_pixel_limit():
    image = Image.new("RGB", (30, 20))
    assert load_image(image, MediaPolicy(), FIELD) is image
    refused(image, MediaPolicy(max_pixels=100), match="30x20 pixels")


def test_image_hash_follows_the_pixels_not_the_encoding():
    data = png_bytes(seed=1)
    from_png = load_image(data_url(data), MediaPolicy(), FIELD)
    assert image_hash(from_png) == image_hash(Image.open(io.BytesIO(data)).copy())
    assert image_hash(from_png) != image_hash(load_image(data_url(png_bytes(seed=2)), MediaPolicy(), FIELD))


# --------------------------------------------------------------------------- file://
def test_file_urls_only_under_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    url = (allowed / "cat.png").as_uri()
    refused(url, match="without --allowed-local-media-path")
    policy = MediaPolicy(allowed_local_path=allowed)
    assert load_image(url, policy, FIELD).size == (24, 16)
    refused((tmp_path / "secret.png").as_uri(), policy, match="not a file under the allowed")
    refused(f"file://{allowed}/../secret.png", policy, match="not a file under the allowed")
    refused((allowed / "escape.png").as_uri(), policy, match="not a file under the allowed")
    refused((allowed / "missing.png").as_uri(), policy, match="no such file")
    refused(allowed.as_uri(), policy, match="not a file under the allowed")
    refused("file://example.com/etc/passwd", policy, match="local files only")
    with pytest.raises(ValueError, match="is not a directory"):
        MediaPolicy(allowed_local_path=tmp_path / "nowhere")


# --------------------------------------------------------------------------- http(s)://
def test_public_address_judgement():
    for address in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
                    "0.0.0.0", "224.0.0.1", "::1", "fe80::1%eth0", "fc00::1", "::ffff:127.0.0.1", "::"):
        assert not public_address(address), address
    for address in ("8.8.8.8", "1.1.1.1", "2001:4860:4860::8888", "::ffff:8.8.8.8"):
        assert public_address(address), address


IMAGE = png_bytes((40, 30))


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output quiet
        pass

    def send_body(self, body: bytes, length: bool = True):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        port = self.server.server_address[1]
        if self.path == "/cat.png":
            self.send_body(IMAGE)
        elif self.path == "/big-declared":
            self.send_body(b"\0" * 5000)
        elif self.path == "/big-undeclared":
            self.send_body(b"\0" * 5000, length=False)
        elif self.path == "/slow":
            time.sleep(1.5)
            self.send_body(IMAGE)
        elif self.path == "/drip":
            self.send_response(200)
            self.end_headers()
            for byte in IMAGE[:40]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.05)
        elif self.path.startswith("/to/"):
            self.send_response(302)
            self.send_header("Location", self.path[len("/to"):].replace("/HOST", f"http://localhost:{port}"))
            self.end_headers()
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
        else:
            self.send_error(404)


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client that gave up (the deadline tests) is expected
        pass


@pytest.fixture(scope="module")
def server():
    httpd = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_loopback_is_refused_unless_its_host_is_allowed(server):
    refused(f"{server}/cat.png", match="non-public address")
    port = server.rsplit(":", 1)[1]
    refused(f"http://localhost:{port}/cat.png", match="non-public address")
    assert load_image(f"{server}/cat.png", LOCAL, FIELD).size == (40, 30)
    refused(f"http://localhost:{port}/cat.png", LOCAL, match="not one of the allowed media domains")


def test_fetch_limits(server):
    small = MediaPolicy(allowed_domains=("127.0.0.1",), max_bytes=1000)
    refused(f"{server}/big-declared", small, match="larger than 1000 bytes")
    refused(f"{server}/big-undeclared", small, match="larger than 1000 bytes")
    fast = MediaPolicy(allowed_domains=("127.0.0.1",), fetch_timeout_s=0.5)
    start = time.monotonic()
    refused(f"{server}/slow", fast, match="longer than 0.5s")
    refused(f"{server}/drip", fast, match="longer than 0.5s")  # bytes keep coming, the deadline holds
    assert time.monotonic() - start < 2.5
    refused(f"{server}/missing.png", LOCAL, match="HTTP 404")


def test_redirects_are_followed_and_each_hop_checked(server):
    assert load_image(f"{server}/to/cat.png", LOCAL, FIELD).size == (40, 30)
    refused(f"{server}/to/HOST/cat.png", LOCAL, match="not one of the allowed media domains")
    refused(f"{server}/loop", LOCAL, match="more than 3 redirects")


def test_unresolvable_hosts_are_refused(monkeypatch):
    """(Resolution is faked: tests never reach beyond loopback.)"""
    def fail(*args, **kwargs):
        raise socket.gaierror("Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", fail)
    refused("http://no-such-host.invalid/cat.png", match="cannot resolve host")


def test_hosts_resolving_to_any_private_address_are_refused(monkeypatch):
    """One public and one private answer: refused (a DNS answer must not smuggle an internal address in)."""
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 80)) for a in ("8.8.8.8", "10.0.0.5")]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: answers)
    refused("http://mixed.example/cat.png", match=r"non-public address \(10.0.0.5\)")
