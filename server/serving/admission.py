"""The queue limit and shutdown: whether a request may come in, and how many engine requests the server holds.

1. A handler takes its places before it tokenizes (`admit(n)`: one per choice of every prompt). Beyond
   the engine's running slots (--max-num-seqs) plus --max-queued-requests the answer is 429 with
   Retry-After; once the server drains (SIGTERM) every new request gets 503.
2. The `Places` a request holds go back once: when its engine requests end (the engine client releases
   them as its stream or batch finishes, is aborted or fails), or at once when the request fails before
   reaching the engine (`failed_before_engine`, which also turns the failure into its error response).
"""

from __future__ import annotations

from typing import Callable

from starlette.responses import Response

from server.http.errors import APIError, error_response


class Places:
    """The queue places one request holds; `release` gives them back (a second call gives nothing)."""

    def __init__(self, admission: Admission | None = None, count: int = 0):
        self._admission, self.count = admission, count

    def release(self) -> None:
        if self.count:
            self._admission.in_flight -= self.count
            self.count = 0


class Admission:
    def __init__(self, max_queued: int | None, running_slots: Callable[[], int]):
        self.max_queued = max_queued  # None: no limit
        self._running_slots = running_slots  # the engine's (known once it is built)
        self.in_flight = 0  # engine requests admitted (or about to be) and not yet finished
        self.draining = False

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")

    def admit(self, n: int) -> Places:
        """Places for n new engine requests (a prompt list counts each prompt, each of its n choices)."""
        limit = self.max_queued
        if limit is not None and self.in_flight + n > self._running_slots() + limit:
            raise APIError(429, f"the server is at capacity ({self.in_flight} requests running or queued); "
                                f"retry later", "rate_limit_error", code="too_many_requests",
                           headers={"Retry-After": "1"})
        self.in_flight += n
        return Places(self, n)

    def drain(self) -> None:
        """Shutting down: refuse new requests; the running ones finish (or are aborted at the deadline)."""
        self.draining = True


def failed_before_engine(places: Places, error: BaseException) -> Response:
    """A request failed before it reached the engine: its places go back. An APIError becomes its error
    response; anything else propagates (a 500 from the app)."""
    places.release()
    if isinstance(error, APIError):
        return error_response(error)
    raise error
