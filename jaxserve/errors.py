"""Errors the engine raises for bad requests (the server turns them into 400s naming the parameter)."""


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (the server reports it in the error body)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class WrongRunner(ValueError):
    """The request needs the other runner: embeddings from a generating model, or text from a pooling one."""
