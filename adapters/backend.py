"""What every framework adapter talks to: one OpenAI-shaped chat call, in-process or remote.

An adapter turns its framework's messages into OpenAI chat messages, asks a backend for
a completion for one agent, and turns the reply back. The backend is either

- ``LocalBackend``: a shared in-process ``Engine`` (the default; every agent of every
  framework in the process uses the same model and caches), or
- ``RemoteBackend``: a running ``kvshelf serve`` (``base_url=...``), so that several
  processes share one engine and its caches.

Both run the same request code (``kvshelf.serving.completions``: tools rendered into the prompt,
tool calls parsed out, JSON mode, stop strings), so an adapter behaves the same in either
mode, and both return the same bodies: an OpenAI ``chat.completion`` dict, or a stream
of ``chat.completion.chunk`` dicts, each with kvshelf's ``kvshelf`` extension (agent,
cache hot|warm|cold, TTFT) on the last one. Errors come out as ``BackendError`` with
the HTTP status and OpenAI error code either way (``kvshelf.errors`` holds the catalog,
``kvshelf.serving.errors_http`` the one mapping both use). Fields a request leaves out
(``max_tokens``, ``temperature``, ``top_p``) take ``GenerationParams``' defaults on both
paths: the in-process one fills them from the same class the server does.

Adapters are written against the ``Backend`` protocol, not the two classes, and pass
agent ids as ``AgentId``: validated once, where the framework's name became an id.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncGenerator, Generator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvshelf.errors import BackendError
from kvshelf.runtime.results import ChatResult
from kvshelf.storage.agent_id import AgentId

if TYPE_CHECKING:  # the engine (MLX, mlx-lm: seconds to import) is imported only in process
    from kvshelf.runtime.engine import Engine

__all__ = ["Backend", "BackendError", "LocalBackend", "RemoteBackend", "connect", "merge_chunks", "shared_engine"]


class Backend(Protocol):
    """What an adapter needs from kvshelf: OpenAI-shaped chat requests for one agent.

    ``agent_id`` None is an ephemeral request (nothing saved). Every method raises
    ``BackendError`` (status and OpenAI code as over HTTP) when the request is refused.
    """

    model_name: str
    context_length: int

    def complete(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> dict:
        """A whole ``chat.completion`` body."""
        ...

    def stream(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> Generator[dict, None, None]:
        """``chat.completion.chunk`` bodies; closing the iterator early cancels the request."""
        ...

    async def acomplete(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> dict:
        """:meth:`complete` for asyncio; cancelling the awaiting task cancels the request."""
        ...

    def astream(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> AsyncGenerator[dict, None]:
        """:meth:`stream` for asyncio; ``aclose()`` early cancels the request."""
        ...

    def append(self, agent_id: AgentId, body: Mapping[str, Any], background: bool = False) -> dict:
        """Prefill the agent's conversation so far without generating (a new phase)."""
        ...

    def fork(self, source: AgentId, new_agent: AgentId) -> dict:
        """Start ``new_agent`` from ``source``'s cache."""
        ...

    def count_tokens(self, body: Mapping[str, Any]) -> int:
        """Prompt tokens of a request as the model sees it (tools and JSON mode rendered)."""
        ...

    def close(self) -> None:
        """Release what this backend holds (a connection; never the shared engine)."""
        ...


# -- one engine per process ------------------------------------------------------------------
_engines: dict[tuple[str, str], Engine] = {}
_engines_lock = threading.Lock()


def shared_engine(
    model: str | Path = "embedded", cache_dir: str | Path | None = None, budget: int | str | None = None
) -> Engine:
    """The process-wide engine for ``(model, cache_dir)``: created once, then shared by
    every adapter instance, so all agents are batched together and no model is loaded twice.
    ``budget`` applies when the engine is created."""
    from kvshelf.runtime.engine import Engine

    key = (str(model), str(Path(cache_dir).resolve()) if cache_dir is not None else "")
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None or engine.closed:
            engine = _engines[key] = Engine(model, cache_dir, budget, progress=False)
        return engine


class LocalBackend:
    """Requests served by an ``Engine`` in this process."""

    def __init__(self, engine: Engine) -> None:
        from kvshelf.serving import completions  # pydantic: only needed once an adapter is used
        from kvshelf.serving.openai_api import ChatCompletionRequest

        self.engine = engine
        self.model_name = completions.model_id(engine)
        self.context_length = engine.loaded.context_length
        self._c, self._Request = completions, ChatCompletionRequest

    def _turn(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> Any:
        """Validate ``body`` as the server does and prepare it with the same defaults
        (``GenerationParams()``), so a local request is the one a server would run."""
        from pydantic import ValidationError

        from kvshelf.serving.openai_api import invalid_request

        try:
            req = self._Request.model_validate(dict(body))
        except ValidationError as exc:
            raise self._error(invalid_request(exc.errors())) from None
        try:
            return req, self._c.prepare(req, agent_id, None, self.engine.native_tools)
        except Exception as exc:
            raise self._error(exc) from None

    @staticmethod
    def _error(exc: BaseException) -> BackendError:
        """``exc`` as the server would answer it (``errors_http.error_response``)."""
        if isinstance(exc, BackendError):
            return exc
        from kvshelf.serving.errors_http import error_response

        status, body = error_response(exc)
        err = body["error"]
        return BackendError(err["message"], status, err["code"], param=err["param"], error_type=err["type"])

    def complete(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> dict:
        _, turn = self._turn(agent_id, body)
        try:
            items = list(self.engine.stream(turn.agent_id, turn.messages, **turn.options))
        except Exception as exc:
            raise self._error(exc) from exc
        return self._c.completion(items, turn, self.model_name)

    def stream(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> Generator[dict, None, None]:
        """Chunk dicts; closing the iterator early cancels the request (the cache is kept)."""
        req, turn = self._turn(agent_id, body)
        builder = self._c.ChunkBuilder(turn, self.model_name, _include_usage(body))
        try:
            items = self.engine.stream(turn.agent_id, turn.messages, **turn.options)
        except Exception as exc:
            raise self._error(exc) from exc
        return self._chunks(builder, items)

    def _chunks(self, builder: Any, items: Generator[str | ChatResult, None, None]) -> Generator[dict, None, None]:
        try:
            yield from builder.start()
            for item in items:
                yield from builder.feed(item)
        except BackendError:
            raise
        except Exception as exc:
            raise self._error(exc) from exc
        finally:
            items.close()

    async def acomplete(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> dict:
        """Cancelling the awaiting task cancels the engine request."""
        _, turn = self._turn(agent_id, body)
        stream = self.engine.astream(turn.agent_id, turn.messages, **turn.options)
        try:
            items = [item async for item in stream]
        except Exception as exc:
            raise self._error(exc) from exc
        finally:
            await stream.aclose()
        return self._c.completion(items, turn, self.model_name)

    async def astream(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> AsyncGenerator[dict, None]:
        _, turn = self._turn(agent_id, body)
        builder = self._c.ChunkBuilder(turn, self.model_name, _include_usage(body))
        stream = self.engine.astream(turn.agent_id, turn.messages, **turn.options)
        try:
            for chunk in builder.start():
                yield chunk
            async for item in stream:
                for chunk in builder.feed(item):
                    yield chunk
        except BackendError:
            raise
        except Exception as exc:
            raise self._error(exc) from exc
        finally:
            await stream.aclose()

    def append(self, agent_id: AgentId, body: Mapping[str, Any], background: bool = False) -> dict:
        """Prefill the agent's conversation so far without generating (``Engine.append``);
        ``background`` queues it as prefill ahead and returns at once."""
        _, turn = self._turn(agent_id, body)
        try:
            future = self.engine.prefill_ahead(turn.agent_id, turn.messages, background=background)
            if background:
                return {"agent_id": turn.agent_id, "queued": True}
            usage = future.result()
        except Exception as exc:
            raise self._error(exc) from exc
        return {
            "agent_id": turn.agent_id,
            "queued": False,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
        }

    def fork(self, source: AgentId, new_agent: AgentId) -> dict:
        """Start ``new_agent`` from ``source``'s cache, sharing its whole blocks."""
        try:
            return asdict(self.engine.fork(source, new_agent))
        except Exception as exc:
            raise self._error(exc) from exc

    def count_tokens(self, body: Mapping[str, Any]) -> int:
        """Prompt tokens of a request as the model will see it (tools and JSON mode rendered)."""
        _, turn = self._turn(None, body)
        return len(self.engine.loaded.tokenizer.encode_prompt(self.engine.loaded.template.render(turn.messages)))

    def close(self) -> None:
        """The shared engine outlives any one adapter; it is closed at interpreter exit."""


class RemoteBackend:
    """Requests sent to a running ``kvshelf serve``; the agent goes in the X-Agent-Id header."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._aclient_args: dict[str, Any] = {"base_url": self.base_url, "headers": headers, "timeout": timeout}
        info = self._get("/v1/models")["data"][0]
        self.model_name = info["id"]
        self.context_length = int(info.get("context_length") or 8192)

    @staticmethod
    def _headers(agent_id: AgentId | None) -> dict[str, str]:
        return {"X-Agent-Id": agent_id} if agent_id is not None else {}

    def _get(self, path: str) -> dict:
        response = self._client.get(path)
        _raise_for(response.status_code, response.content)
        return response.json()

    def complete(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> dict:
        response = self._client.post(
            "/v1/chat/completions", json={**body, "stream": False}, headers=self._headers(agent_id)
        )
        _raise_for(response.status_code, response.content)
        return response.json()

    def stream(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> Generator[dict, None, None]:
        """Closing the iterator early closes the connection, and the server cancels the request."""
        with self._client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=self._headers(agent_id)
        ) as response:
            if response.status_code >= 400:
                _raise_for(response.status_code, response.read())
            for line in response.iter_lines():
                if (chunk := _sse_data(line)) is not None:
                    yield chunk

    async def acomplete(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> dict:
        import httpx

        async with httpx.AsyncClient(**self._aclient_args) as client:
            response = await client.post(
                "/v1/chat/completions", json={**body, "stream": False}, headers=self._headers(agent_id)
            )
        _raise_for(response.status_code, response.content)
        return response.json()

    async def astream(self, agent_id: AgentId | None, body: Mapping[str, Any]) -> AsyncGenerator[dict, None]:
        import httpx

        async with httpx.AsyncClient(**self._aclient_args) as client:
            async with client.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=self._headers(agent_id)
            ) as response:
                if response.status_code >= 400:
                    _raise_for(response.status_code, await response.aread())
                async for line in response.aiter_lines():
                    if (chunk := _sse_data(line)) is not None:
                        yield chunk

    def append(self, agent_id: AgentId, body: Mapping[str, Any], background: bool = False) -> dict:
        response = self._client.post(f"/v1/agents/{agent_id}/append", json={**body, "background": background})
        _raise_for(response.status_code, response.content)
        return response.json()

    def fork(self, source: AgentId, new_agent: AgentId) -> dict:
        response = self._client.post(f"/v1/agents/{source}/fork", json={"new_agent": new_agent})
        _raise_for(response.status_code, response.content)
        return response.json()

    def count_tokens(self, body: Mapping[str, Any]) -> int:
        response = self._client.post("/v1/tokenize", json=dict(body))
        _raise_for(response.status_code, response.content)
        return int(response.json()["prompt_tokens"])

    def close(self) -> None:
        self._client.close()


def connect(
    model: str | Path = "embedded",
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    cache_dir: str | Path | None = None,
    budget: int | str | None = None,
    engine: Engine | None = None,
) -> Backend:
    """A remote backend when ``base_url`` is given, else the shared in-process engine
    (or ``engine``, when the caller owns one).

    Every adapter comes through here, so all of them read the same environment: without
    ``engine`` or ``base_url``, ``$KVSHELF_BASE_URL`` names a running ``kvshelf serve``;
    without ``api_key``, ``$KVSHELF_API_KEY`` is its key. Only the in-process mode
    imports the engine (and MLX), so a remote client starts in a fraction of a second."""
    if engine is None and not base_url:
        base_url = os.environ.get("KVSHELF_BASE_URL") or None
    if base_url:
        return RemoteBackend(base_url, api_key if api_key is not None else os.environ.get("KVSHELF_API_KEY"))
    return LocalBackend(engine or shared_engine(model, cache_dir, budget))


# -- helpers ---------------------------------------------------------------------------------
def _include_usage(body: Mapping[str, Any]) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _raise_for(status: int, content: bytes) -> None:
    if status < 400:
        return
    try:
        err = json.loads(content)["error"]
        message, code = err.get("message") or f"HTTP {status}", err.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = content.decode("utf-8", "replace")[:500] or f"HTTP {status}", None
    raise BackendError(message, status, code)


def _sse_data(line: str) -> dict | None:
    """One chunk from an SSE line; errors sent inside the stream are raised."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    body = json.loads(data)
    if "error" in body:
        err = body["error"]
        raise BackendError(err.get("message", "stream failed"), 500, err.get("code"))
    return body


def merge_chunks(chunks: list[dict]) -> dict:
    """A whole ``chat.completion``-like message from stream chunks (content, tool calls,
    finish_reason, usage, kvshelf extension): adapters that stream still report one result."""
    content, finish, usage = "", None, None
    calls: list[dict] = []
    ext: dict = {}
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        ext = chunk.get("kvshelf") or ext
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            calls.extend(delta.get("tool_calls") or [])
            finish = choice.get("finish_reason") or finish
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return {"message": message, "finish_reason": finish, "usage": usage, "kvshelf": ext}
