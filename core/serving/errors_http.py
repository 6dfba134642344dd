"""Any exception as an HTTP status and an OpenAI error body: the one place that decides.

The status, code and type of each kvshelf error are declared on the class itself
(``kvshelf.errors``); this module only reads them, so every endpoint, the app's
exception handlers, the SSE stream and the in-process adapter backend answer an
error identically. A plain ``ValueError`` (an engine argument check) is the request's
fault, 400; anything else is a bug, logged and answered 500 without details.
"""

from __future__ import annotations

import logging

from kvshelf.errors import ApiError, KVShelfError

log = logging.getLogger(__name__)


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 about request field ``param``."""
    return ApiError(message, 400, code, param=param)


def error_response(exc: BaseException) -> tuple[int, dict]:
    """The status and OpenAI error body a client is answered for ``exc``."""
    if isinstance(exc, KVShelfError):
        return exc.status, error_body(exc.client_message, exc.error_type, exc.param, exc.code)
    if isinstance(exc, ValueError):
        return 400, error_body(str(exc))
    log.error("request failed: %s", type(exc).__name__, exc_info=exc)
    return 500, error_body("The server had an internal error; see its log.", "server_error")
