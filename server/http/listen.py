"""The server's listening sockets, bound before the engine loads anything.

1. `listen(host, port, backlog)` binds every address `host` resolves to, as asyncio's `create_server` does
   when uvicorn binds for itself, and starts listening; uvicorn then serves on these sockets. Connections
   that arrive before uvicorn accepts wait in the backlog.
2. Binding first means a server that cannot listen (the port in use, a privileged port, a host that is not
   this machine's) says so with the option to change, in well under a second, instead of after the model
   has loaded (or, as uvicorn does, in a log line that names no option).
"""

from __future__ import annotations

import errno
import socket


class ListenError(OSError):
    """The server cannot listen where --host / --port say; the message says which and why."""


def listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"--host {host!r} is not a name or address this machine can resolve ({e.strerror})") \
            from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):  # a resolver may list one twice
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # A restarted server may take the port while connections of the last one are in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: "::" takes IPv6 only, beside a socket of its own for IPv4
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise ListenError(_reason(e, host, port)) from None
    return sockets


def _reason(error: OSError, host: str, port: int) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is in use on {host} (pass --port with a free port, or stop the process holding it)"
    if error.errno == errno.EACCES:
        return f"no permission to listen on port {port} (ports below 1024 need privileges: pass --port)"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: it is not an address of this machine (pass --host)"
    return f"cannot listen on {host}:{port}: {error.strerror or error} (check --host and --port)"
