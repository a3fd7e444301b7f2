"""The gateway's errors, built one way: OpenAI's error body, the ApiError that carries one to the client (a JSON
response before a stream starts, an in-band event after), and the Triton client's failures as ApiErrors."""
from __future__ import annotations

import contextlib
import logging

from starlette.responses import JSONResponse

from backend.gateway.client import InvalidRequest, TritonUnavailable

log = logging.getLogger(__name__)
# What a client is told of a failure that is not its request's: the details (a traceback, paths, addresses) are
# the operator's, in the gateway's log.
INTERNAL_ERROR = "internal error (the gateway's log has the details)"


def error_body(message: str, type_: str, code: int | str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code  # OpenAI's error code where it has one (e.g. model_not_found); else the status, as vLLM's

    @classmethod
    def of(cls, error: Exception) -> "ApiError":
        """Any failure as the error a client is told of: the Triton client's as their HTTP errors, anything else a
        500 that names nothing of it (it goes to the log)."""
        if isinstance(error, ApiError):
            return error
        if isinstance(error, InvalidRequest):
            return cls(400, str(error))
        if isinstance(error, TritonUnavailable):
            return cls(503, str(error), "service_unavailable")
        log.error("internal error", exc_info=error)
        return cls(500, INTERNAL_ERROR, "internal_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code or self.status, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


@contextlib.contextmanager
def triton_errors():
    """Failures reported by the Triton client, as the gateway's HTTP errors."""
    try:
        yield
    except (InvalidRequest, RuntimeError) as e:  # (TritonUnavailable is a RuntimeError)
        raise ApiError.of(e) from None
