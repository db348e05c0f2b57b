"""Images from request URLs, with the guards a server that fetches on its clients' behalf needs.

1. `load_image(source, policy, field)` takes a URL (or, from the offline API, a PIL image) and dispatches
   on the scheme: `data:` (base64, always allowed), `file://` (only under `policy.allowed_local_path`),
   `http(s)://` (`fetch_url`); any other scheme is refused.
2. `fetch_url` resolves the host once and checks every address it resolves to: loopback, link-local,
   private, shared, multicast, reserved and unspecified addresses are refused (image URLs are a known
   server-side request forgery route into an operator's network) unless the operator listed the host in
   `policy.allowed_domains`, which then is the only hosts fetched from. The connection goes to the checked
   address itself, so a second DNS answer cannot swap it (DNS rebinding). One deadline covers the whole
   fetch, redirects included (each redirect's host is checked the same way), and the body stops at
   `policy.max_bytes`.
3. `decode_image` reads the header first and refuses more than `policy.max_pixels` before decoding (a
   decompression bomb is a small file that decodes to gigabytes), then decodes the whole image, so that a
   truncated or corrupt file fails here, naming the field, not later inside preprocessing.
Every refusal is an `InvalidMedia` (a ValueError) naming the request field: the server answers 400.
This module is synchronous (blocking sockets): the server runs it off its event loop.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import http.client
import io
import ipaddress
import socket
import ssl
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from jaxserve.errors import InvalidMedia

# The formats a request may carry: the common web ones (each PIL decoder is attack surface).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
REDIRECTS = (301, 302, 303, 307, 308)


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be (the server's media flags)."""
    allowed_local_path: Path | None = None  # file:// URLs only under this directory; None: refused
    # None: any host whose addresses are all public. A tuple: only these hosts, which may then resolve to
    # private addresses too (the operator vouched for them: an internal image store, a test server).
    allowed_domains: tuple[str, ...] | None = None
    fetch_timeout_s: float = 10.0  # the whole fetch: resolving, connecting, redirects and the body
    max_bytes: int = 20 << 20  # an encoded image, fetched, read or base64-decoded
    max_pixels: int = 50_000_000  # width * height from the header (~150 MB as RGB; a 48-MP photo fits)
    max_redirects: int = 3
    formats: tuple[str, ...] = IMAGE_FORMATS

    def __post_init__(self):
        for name in ("fetch_timeout_s", "max_bytes", "max_pixels"):
            if not getattr(self, name) > 0:
                raise ValueError(f"media policy: {name} must be positive, got {getattr(self, name)!r}")
        if self.allowed_local_path is not None:
            path = Path(self.allowed_local_path).resolve()
            if not path.is_dir():
                raise ValueError(f"--allowed-local-media-path {self.allowed_local_path} is not a directory")
            object.__setattr__(self, "allowed_local_path", path)
        if self.allowed_domains is not None:
            object.__setattr__(self, "allowed_domains", tuple(d.strip().lower().rstrip(".")
                                                                for d in self.allowed_domains if d.strip()))


def load_image(source, policy: MediaPolicy, field: str) -> Image.Image:
    """The decoded image a request's `field` names: a URL (data:, file://, http(s)://) or a PIL image."""
    if isinstance(source, Image.Image):
        check_pixels(source.size, policy, field)
        return source
    if not isinstance(source, str):
        raise InvalidMedia(field, f"{field} must be an image URL (data:, http(s):// or file://), "
                                  f"got {type(source).__name__}")
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        data = read_data_url(source, policy, field)
    elif scheme == "file":
        data = read_local_file(source, policy, field)
    elif scheme in ("http", "https"):
        data = fetch_url(source, policy, field)
    else:
        raise InvalidMedia(field, f"{field}: unsupported image URL scheme {scheme or source[:16]!r} "
                                  f"(use data:, http://, https:// or file://)")
    return decode_image(data, policy, field)


# --------------------------------------------------------------------------- data: and file://
def read_data_url(url: str, policy: MediaPolicy, field: str) -> bytes:
    """The bytes of a `data:[image/...];base64,...` URL (base64 only, as vLLM and OpenAI take them)."""
    meta, sep, payload = url[len("data:"):].partition(",")
    media_type, *params = meta.split(";") if meta else [""]
    if not sep or "base64" not in params:
        raise InvalidMedia(field, f"{field}: a data: URL must be base64 (data:image/png;base64,...)")
    if media_type and not media_type.lower().startswith("image/"):
        raise InvalidMedia(field, f"{field}: data: URL of type {media_type!r}, not an image")
    payload = "".join(payload.split())  # clients wrap long base64 lines
    if len(payload) // 4 * 3 > policy.max_bytes:
        raise InvalidMedia(field, f"{field}: the image is larger than {policy.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidMedia(field, f"{field}: the data: URL is not valid base64") from None


def read_local_file(url: str, policy: MediaPolicy, field: str) -> bytes:
    """A file:// URL's bytes, only for a regular file under `policy.allowed_local_path` (symlinks and `..`
    resolved first, so neither leads out of it)."""
    if policy.allowed_local_path is None:
        raise InvalidMedia(field, f"{field}: file:// URLs are refused (the server was started without "
                                  f"--allowed-local-media-path)")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidMedia(field, f"{field}: file:// URLs name local files only, not host {parts.netloc!r}")
    try:
        path = Path(urllib.request.url2pathname(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise InvalidMedia(field, f"{field}: no such file {parts.path!r}") from None
    if not path.is_relative_to(policy.allowed_local_path) or not path.is_file():
        raise InvalidMedia(field, f"{field}: {parts.path!r} is not a file under the allowed local media path")
    if path.stat().st_size > policy.max_bytes:
        raise InvalidMedia(field, f"{field}: the image is larger than {policy.max_bytes} bytes")
    return path.read_bytes()


# --------------------------------------------------------------------------- http(s)://
def public_address(address: str) -> bool:
    """Whether an IP address is on the public internet (not loopback, private, link-local, shared, reserved,
    unspecified or multicast); an IPv4 address written as IPv6 (::ffff:a.b.c.d) is judged as IPv4."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone (fe80::1%eth0)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def checked_address(host: str, port: int, policy: MediaPolicy, field: str) -> str:
    """The address to connect to for `host`, after checking every address it resolves to."""
    host = host.lower().rstrip(".")
    listed = policy.allowed_domains is not None
    if listed and host not in policy.allowed_domains:
        raise InvalidMedia(field, f"{field}: host {host!r} is not one of the allowed media domains")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise InvalidMedia(field, f"{field}: cannot resolve host {host!r}") from None
    addresses = [info[4][0] for info in infos]
    if not listed:
        refused = [a for a in addresses if not public_address(a)]
        if refused:
            raise InvalidMedia(field, f"{field}: host {host!r} resolves to a non-public address ({refused[0]}); "
                                      f"fetching from loopback, private or link-local addresses is refused")
    return addresses[0]


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to an address checked beforehand (the Host header still names the host)."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self):
        # Kept beside `sock`, which http.client drops once a response says the connection will close.
        self.sock = self.pinned_sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a checked address, the certificate verified against the host name (SNI too)."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        self.tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=self.tls)
        self.address = address

    def connect(self):
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.pinned_sock = self.tls.wrap_socket(sock, server_hostname=self.host)


def fetch_url(url: str, policy: MediaPolicy, field: str) -> bytes:
    """The body of an http(s) URL: every hop's host checked, one deadline, at most `max_bytes`."""
    deadline = time.monotonic() + policy.fetch_timeout_s

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise InvalidMedia(field, f"{field}: fetching the image took longer than {policy.fetch_timeout_s:g}s")
        return left

    for _ in range(policy.max_redirects + 1):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidMedia(field, f"{field}: cannot fetch {url[:80]!r} (http:// or https:// with a host)")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise InvalidMedia(field, f"{field}: bad port in {url[:80]!r}") from None
        address = checked_address(parts.hostname, port, policy, field)
        pinned = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        conn = pinned(parts.hostname, port, address, remaining())
        try:
            conn.request("GET", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                         headers={"Accept": "image/*", "User-Agent": "jaxserve"})
            response = conn.getresponse()
            if response.status in REDIRECTS and response.getheader("Location"):
                url = urllib.parse.urljoin(url, response.getheader("Location"))
                continue
            if response.status != 200:
                raise InvalidMedia(field, f"{field}: fetching the image answered HTTP {response.status}")
            return _read_body(response, conn, policy, field, remaining)
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, TimeoutError) or "timed out" in str(e):
                raise InvalidMedia(field, f"{field}: fetching the image took longer than "
                                          f"{policy.fetch_timeout_s:g}s") from None
            raise InvalidMedia(field, f"{field}: fetching the image failed ({type(e).__name__}: {e})") from None
        finally:
            conn.close()
    raise InvalidMedia(field, f"{field}: more than {policy.max_redirects} redirects")


def _read_body(response, conn, policy: MediaPolicy, field: str, remaining) -> bytes:
    too_big = InvalidMedia(field, f"{field}: the image is larger than {policy.max_bytes} bytes")
    declared = response.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > policy.max_bytes:
        raise too_big
    body = bytearray()
    while True:
        conn.pinned_sock.settimeout(remaining())  # a server that drips bytes cannot stretch the deadline
        chunk = response.read1(64 << 10)
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > policy.max_bytes:
            raise too_big


# --------------------------------------------------------------------------- decoding
def check_pixels(size: tuple[int, int], policy: MediaPolicy, field: str) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidMedia(field, f"{field}: the image is empty ({width}x{height})")
    if width * height > policy.max_pixels:
        raise InvalidMedia(field, f"{field}: the image is {width}x{height} pixels, more than the limit of "
                                  f"{policy.max_pixels}")


def decode_image(data: bytes, policy: MediaPolicy, field: str) -> Image.Image:
    """`data` decoded, refused by its header's size before the pixels are decoded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit decides, below
        try:
            image = Image.open(io.BytesIO(data), formats=policy.formats)
        except Image.DecompressionBombError:
            raise InvalidMedia(field, f"{field}: the image has more than {policy.max_pixels} pixels") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError):
            raise InvalidMedia(field, f"{field}: not an image that can be decoded "
                                      f"({', '.join(policy.formats)})") from None
    check_pixels(image.size, policy, field)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        raise InvalidMedia(field, f"{field}: the image is truncated or corrupt ({e})") from None
    return image


def image_hash(image: Image.Image) -> str:
    """A digest of the decoded pixels (mode, size and data): the same picture sent as PNG by one client and
    from a file by another hashes the same. The key of the encoder cache and of prefix-cache pages."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
