"""OpenAI-style API errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status."""

from __future__ import annotations

from typing import Optional


class APIError(Exception):
    """An error answer: ``status``, the OpenAI error body, and extra response ``headers`` (e.g. ``Retry-After``).
    ``message`` is shown to the client: it names the client's problem, never the server's internals."""

    def __init__(self, status: int, message: str, *, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _default_type(status: int) -> str:
    if status in (400, 401, 403, 404, 409, 413, 422):
        return "invalid_request_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error"


INTERNAL_ERROR = "internal server error"  # the whole body of a 500: the details go to the server's log only


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
