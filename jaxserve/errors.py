"""Errors the engine raises: for bad requests (the server turns them into 400s naming the parameter), and
when it cannot start."""


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (the server reports it in the error body)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class InvalidMedia(InvalidParameter):
    """An image in a request cannot be used: an unsupported URL scheme, a refused address or path, a fetch
    that timed out or ran past the byte limit, too many pixels, or bytes that do not decode. `param` names
    the field that carried it (`messages[0].content[1].image_url.url`): the server answers 400."""


class ImagesNotServed(InvalidParameter):
    """Images for a model or an engine that cannot take them (a 400 naming the first image's field)."""


class WrongRunner(ValueError):
    """The request needs the other runner: embeddings from a generating model, or text from a pooling one."""


class EngineStartError(RuntimeError):
    """The engine could not start for a reason the device or the compiler gave (out of memory, a failed
    compilation); the message says which options to change (`engine/startup.py`). A bad file or option
    is a ValueError / OSError naming it instead."""


# The errors whose message alone tells a user what to change (a file, an option, a missing package): the
# command line prints just that line, and a server that fails to start with one logs no traceback for it.
ACTIONABLE_ERRORS = (ValueError, OSError, ImportError, EngineStartError)
