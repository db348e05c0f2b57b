"""The HTTP/1.1 connection under the app: uvicorn's httptools protocol, with a limit on a request's head.

1. uvicorn's parser (httptools) keeps a request's line and headers in memory until the blank line that
   ends them, however long that takes: one 8 MB header is read in full and the request answered. No
   ASGI middleware can help, since the app sees a request only once its head is complete.
2. `HeaderLimitedProtocol` therefore feeds the parser at most `--max-header-bytes` (+1) bytes of a
   request's head (request line and headers together): a head that outgrows the limit is answered with
   431 Request Header Fields Too Large (OpenAI error JSON) and the connection is closed, so no more than
   the limit is ever buffered for it. When an earlier response on the same connection is still being
   written, the connection is closed without an answer rather than interleaving one into that response.
3. `uvicorn_config` builds the uvicorn `Config` with this protocol, for `serve` and for the tests.
"""

from __future__ import annotations

import functools
import json
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from server.http.errors import error_body
from server.options import ServerOptions

logger = logging.getLogger(__name__)


class HeaderLimitedProtocol(HttpToolsProtocol):
    def __init__(self, *args, max_header_bytes: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_header_bytes = max_header_bytes
        self._head_left: int | None = max_header_bytes  # bytes the current head may still have; None in a body

    def data_received(self, data: bytes) -> None:
        while data and self._head_left is not None and not self.transport.is_closing():
            piece = data[:self._head_left + 1]  # one byte past the limit shows that the head outgrew it
            data = data[len(piece):]
            self._head_left -= len(piece)
            super().data_received(piece)
            if self._head_left is not None and self._head_left < 0:
                return self._refuse_head()
        if data and not self.transport.is_closing():
            super().data_received(data)

    def on_headers_complete(self) -> None:
        self._head_left = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        # The next request on this connection starts a new head. Bytes of it that came in the same piece as
        # this message's end were not counted: at most one piece (the limit) more is ever buffered.
        self._head_left = self.max_header_bytes

    def _refuse_head(self) -> None:
        self._head_left = None
        logger.warning("refused a request whose header fields exceed %d bytes (--max-header-bytes)",
                       self.max_header_bytes)
        if self.cycle is None or self.cycle.response_complete:
            body = json.dumps(error_body(
                f"Request header fields exceed the limit of {self.max_header_bytes} bytes (--max-header-bytes)",
                code="request_header_fields_too_large")).encode()
            head = [STATUS_LINE[431]]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                     b"\r\nconnection: close\r\n\r\n"]
            self.transport.write(b"".join(head) + body)
        self.transport.close()


def uvicorn_config(app, options: ServerOptions, **kwargs) -> uvicorn.Config:
    """uvicorn's Config for `app`: the server's HTTP protocol (header limit), TLS, the root path behind a
    proxy, uvicorn's log level and access log from `options`; `kwargs` (host, port, ...) go to the Config
    as they are and win."""
    protocol = functools.partial(HeaderLimitedProtocol, max_header_bytes=options.max_header_bytes)
    settings = dict(log_level=options.uvicorn_log_level, access_log=options.log_requests,
                    root_path=options.root_path, ssl_keyfile=options.ssl_keyfile, ssl_certfile=options.ssl_certfile)
    return uvicorn.Config(app, http=protocol, **(settings | kwargs))
