"""Every kvshelf error, and what a client is told about it: the one catalog.

Every kvshelf error derives from :class:`KVShelfError` so that a caller can catch
"anything kvshelf raised" in one clause, while the second base class keeps the
error catchable the way Python code already expects (a bad id is a
``ValueError``, a failed write is an ``OSError`` that carries its ``errno``).

Each class also says how it is answered over HTTP, as class attributes: ``status``,
the OpenAI error ``code`` and ``error_type``, the request field it is about
(``param``) and a ``hint`` appended to its message. ``kvshelf.serving.errors_http``
reads them to build every error response, so adding an error here is all it takes
to answer it correctly; nothing else keeps a table of statuses.
"""

from __future__ import annotations


class KVShelfError(Exception):
    """Base class of all errors raised by kvshelf.

    Without a more specific class it is the service failing rather than the request
    (a closed engine, a store in use): 503, which clients retry.
    """

    status: int = 503
    code: str | None = "unavailable"
    error_type: str = "server_error"
    param: str | None = None
    hint: str = ""

    @property
    def client_message(self) -> str:
        """The message a client is shown: the error's own text plus its ``hint``."""
        text = str(self.args[0]) if len(self.args) == 1 else str(self)
        return f"{text}{self.hint}"


class _RequestError(KVShelfError):
    """Base of the errors that are the request's fault (4xx)."""

    status: int = 400
    code: str | None = None
    error_type: str = "invalid_request_error"


class InvalidAgentId(_RequestError, ValueError):
    """An agent id that cannot safely name a file.

    Raised before any filesystem access, so a bad id never touches the disk.
    """

    code = "invalid_agent_id"


class StorageError(KVShelfError, OSError):
    """A record could not be written or read because of the filesystem.

    Typical causes are a full disk (``ENOSPC``), missing permissions
    (``EACCES``) or a lock that could not be taken in time. ``errno`` and
    ``filename`` are set when known. When a *save* fails the previously stored
    record is left untouched. Answered 503: the request was fine, the server is not.
    """


class StaleWrite(StorageError):
    """A save refused because the agent's record in a shared store changed since this
    node last read or wrote it: another node took the agent over, or it was deleted.

    Raised by the store's conditional write (``kvshelf.storage.records``: the ETag on S3,
    the record's identity under the agent's lock on a filesystem), so an old writer never
    puts an older state over a newer one nor brings back a deleted agent. The engine
    drops its RAM copy of the agent and logs why; the turn is answered ``saved: false``.
    ``errno`` is ``ESTALE``. Answered 409 where it reaches a client (a fork of a stale agent).
    """

    status = 409
    code = "stale_write"
    error_type = "invalid_request_error"
    hint = "; the agent moved to another node or was deleted: send the request again."


class RecordRejected(KVShelfError):
    """Why a stored record was judged unusable (and moved to quarantine).

    Internal to the store: ``RecordStore.load`` catches it, quarantines the file
    and returns ``None`` so that the caller simply recomputes the cache.
    """

    @property
    def reason(self) -> str:
        """The human-readable reason (also written to the ``.reason`` file)."""
        return str(self.args[0]) if self.args else "unknown reason"


class ContextLengthExceeded(_RequestError, ValueError):
    """The prompt does not fit the model's context window."""

    code = "context_length_exceeded"
    param = "messages"
    hint = ". Shorten the messages, or start a new agent."


class InvalidSchema(_RequestError, ValueError):
    """A JSON schema (``response_format`` or a tool's ``parameters``) that constrained
    decoding cannot enforce: an unsupported keyword, a bad type or pattern, recursion the
    grammar library refuses. Refused before any generation, never silently loosened."""

    code = "invalid_json_schema"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AgentBusy(_RequestError):
    """The agent has a request in flight; erase or evict it once that finishes."""

    status = 409
    code = "agent_busy"
    hint = "; try again when it has finished."


class AgentExists(_RequestError):
    """A fork would overwrite an agent that already has a cache; forget it first."""

    status = 409
    code = "agent_exists"
    hint = "."


class UnknownAgent(_RequestError, KeyError):
    """No cache for this agent, in RAM or on disk."""

    status = 404
    code = "agent_not_found"
    param = "agent_id"
    hint = "."


class ApiError(_RequestError):
    """A refusal whose status and code are decided where it is raised (a bad request
    field, a missing API key, a body too large), with its OpenAI fields given per instance."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        code: str | None = None,
        *,
        param: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param
        self.error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")


class BackendError(ApiError):
    """What an adapter's backend raises when the engine or the server refused or failed a
    request: ``status`` and ``code`` as in HTTP, the same in process and remote."""
