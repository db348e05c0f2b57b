"""The built-in web playground: a chat and completion page at `/` and `/playground`, served from files
shipped inside the package (no CDN, no build step, nothing fetched from the network).

1. At import the HTML, CSS and JavaScript files are read once from the package and each gets an ETag
   (a hash of its bytes). The page's links to its stylesheet and entry script carry that hash as `?v=`,
   so a browser may keep those for a year and still sees a new release at once; the page itself and the
   modules the script imports are revalidated on every load (`no-cache`: a 304 when unchanged).
2. Every URL the page uses is relative (`playground/app.js`, `v1/models`), so it works behind a reverse
   proxy that mounts the server under a prefix (`--root-path`): `/` and `/playground` both resolve them
   against the same directory.
3. The page and its files are public even with `--api-key` (server/http/guards.py says where they live;
   the routes here take their paths from it): the page asks for the key, keeps it in the tab
   (sessionStorage) and sends it as a Bearer token to the API routes.
4. The page answers with a Content-Security-Policy that allows scripts, styles and connections to this
   origin only; the scripts write model output with `textContent`, never as HTML.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.http.errors import error_body
from server.http.guards import PLAYGROUND_FILES as ASSET_PREFIX  # where the page's files live
from server.http.guards import PLAYGROUND_PAGES as PAGE_PATHS  # public, like the page's files

_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                  ".js": "text/javascript; charset=utf-8"}
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_IMMUTABLE = "public, max-age=31536000, immutable"
_SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


@dataclass(frozen=True)
class _File:
    body: bytes
    etag: str  # quoted, as the header carries it
    content_type: str


def _load(name: str, text: bytes | None = None) -> _File:
    body = text if text is not None else importlib.resources.files(__name__).joinpath(name).read_bytes()
    digest = hashlib.sha256(body).hexdigest()[:20]
    return _File(body, f'"{digest}"', _CONTENT_TYPES[name[name.rfind("."):]])


def _load_all() -> tuple[_File, dict[str, _File]]:
    """(the page, {file name: file}); the page's `{{name}}` placeholders become `playground/name?v=hash`."""
    assets = {entry.name: _load(entry.name) for entry in importlib.resources.files(__name__).iterdir()
              if entry.name.endswith((".css", ".js"))}
    page = importlib.resources.files(__name__).joinpath("index.html").read_text(encoding="utf-8")
    for name, asset in assets.items():
        page = page.replace("{{" + name + "}}", f"playground/{name}?v={asset.etag.strip(chr(34))}")
    if "{{" in page:
        raise RuntimeError(f"playground/index.html names a file the package lacks: {page[page.index('{{'):][:60]}")
    return _load("index.html", page.encode("utf-8")), assets


_PAGE, _ASSETS = _load_all()


def _respond(request: Request, file: _File, cache_control: str, extra: dict[str, str]) -> Response:
    headers = {"ETag": file.etag, "Cache-Control": cache_control, **_SECURITY_HEADERS, **extra}
    if file.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(file.body if request.method == "GET" else b"", media_type=file.content_type,
                    headers={**headers, "Content-Length": str(len(file.body))})


async def page(request: Request) -> Response:
    return _respond(request, _PAGE, "no-cache", {"Content-Security-Policy": _CSP})


async def asset(request: Request) -> Response:
    file = _ASSETS.get(request.path_params["name"])
    if file is None:
        return JSONResponse(error_body(f"no playground file {request.path_params['name']!r}", code="not_found"),
                            status_code=404)
    # Only the exact version the page links to may be kept without asking again.
    versioned = request.query_params.get("v") == file.etag.strip('"')
    return _respond(request, file, _IMMUTABLE if versioned else "no-cache", {})


def routes() -> list[Route]:
    return [*(Route(path, page, methods=["GET", "HEAD"]) for path in PAGE_PATHS),
            Route(ASSET_PREFIX + "{name}", asset, methods=["GET", "HEAD"])]
