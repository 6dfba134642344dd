"""The error catalog and its one mapping to HTTP: every kvshelf error answers with the
status and OpenAI code its class declares, wherever it is raised."""

from __future__ import annotations

import errno

import pytest

from kvshelf.adapters.backend import BackendError
from kvshelf.errors import (
    AgentBusy,
    AgentExists,
    ApiError,
    ContextLengthExceeded,
    InvalidAgentId,
    KVShelfError,
    StorageError,
    UnknownAgent,
)
from kvshelf.serving.errors_http import error_response


@pytest.mark.parametrize(
    "exc, status, code, type_, param, message",
    [
        (ContextLengthExceeded("the prompt is 9 tokens"), 400, "context_length_exceeded", "invalid_request_error",
         "messages", "the prompt is 9 tokens. Shorten the messages, or start a new agent."),
        (InvalidAgentId("bad id"), 400, "invalid_agent_id", "invalid_request_error", None, "bad id"),
        (UnknownAgent("no cache for agent 'x'"), 404, "agent_not_found", "invalid_request_error", "agent_id",
         "no cache for agent 'x'."),
        (AgentExists("agent 'x' already has a cache"), 409, "agent_exists", "invalid_request_error", None,
         "agent 'x' already has a cache."),
        (AgentBusy("agent 'x' is busy"), 409, "agent_busy", "invalid_request_error", None,
         "agent 'x' is busy; try again when it has finished."),
        (StorageError(errno.ENOSPC, "disk full"), 503, "unavailable", "server_error", None, "[Errno 28] disk full"),
        (KVShelfError("this engine is closed"), 503, "unavailable", "server_error", None, "this engine is closed"),
        (ApiError("too big", 413, "request_too_large"), 413, "request_too_large", "invalid_request_error", None,
         "too big"),
        (BackendError("remote failed", 502, "bad_gateway"), 502, "bad_gateway", "server_error", None, "remote failed"),
        (ValueError("an agent cannot be forked onto itself"), 400, None, "invalid_request_error", None,
         "an agent cannot be forked onto itself"),
        (RuntimeError("secret detail"), 500, None, "server_error", None,
         "The server had an internal error; see its log."),
    ],
)  # fmt: skip
def test_each_error_is_answered_as_its_class_declares(exc, status, code, type_, param, message):
    answered, body = error_response(exc)
    assert answered == status
    assert body == {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_the_catalog_keeps_the_python_bases_callers_catch():
    assert issubclass(ContextLengthExceeded, ValueError) and issubclass(InvalidAgentId, ValueError)
    assert issubclass(UnknownAgent, KeyError) and issubclass(StorageError, OSError)
    assert all(issubclass(cls, KVShelfError) for cls in (AgentBusy, AgentExists, BackendError, ApiError))
    assert StorageError(errno.ENOSPC, "disk full").errno == errno.ENOSPC
