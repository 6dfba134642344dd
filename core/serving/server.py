"""``kvshelf serve``: an OpenAI-compatible HTTP server in which every agent keeps its cache.

Agent identity: the ``X-Agent-Id`` header names the agent whose cache a request uses;
without it, the body's ``user`` field does. A request with neither is served
correctly but ephemerally: nothing is saved, and no agent's cache is read or touched.
The id must be 1-128 of ``[A-Za-z0-9._:@-]`` (it becomes a file name); anything else
is a 400, never a silent rewrite.

Endpoints: ``POST /v1/chat/completions`` (JSON or SSE), ``GET /v1/models``,
``GET /v1/agents`` (paged the OpenAI way: ``limit``, ``after``, ``has_more``),
``GET``/``DELETE /v1/agents/{id}``, ``GET /health`` and ``GET /metrics`` (Prometheus,
``kvshelf.serving.metrics``). With an API key set, every endpoint but ``/health`` wants
``Authorization: Bearer KEY``.

Behind a load balancer (``deploy/haproxy.cfg``, ``deploy/nginx.conf``): every response
carries ``X-KVShelf-Node``, the node's id, and SIGTERM drains the node before it stops
(``kvshelf.serving.drain``).

Every error is an OpenAI-style ``{"error": {message, type, param, code}}`` object with
a 4xx status for a bad request, so clients raise the usual exception types.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvshelf.errors import ApiError, InvalidAgentId, KVShelfError, UnknownAgent
from kvshelf.model.blas import openblas_threads, usable_cpus
from kvshelf.model.blas_check import announce as announce_blas
from kvshelf.model.few_rows import blis_threads
from kvshelf.model.loader import fingerprint_of
from kvshelf.paths import default_cache_dir
from kvshelf.runtime.anonymous import MAX_ENTRIES as ANONYMOUS_ENTRIES
from kvshelf.runtime.engine import AgentInfo, ChatResult, Engine
from kvshelf.runtime.params import GenerationParams
from kvshelf.serving.completions import completion, events, model_id, prepare
from kvshelf.serving.drain import DRAIN_S_DEFAULT, RETRY_AFTER_S, Drain
from kvshelf.serving.errors_http import bad_request, error_body, error_response
from kvshelf.serving.metrics import CONTENT_TYPE, NodeMetrics
from kvshelf.serving.openai_api import AppendRequest, ChatCompletionRequest, ForkRequest, invalid_request
from kvshelf.storage import exclusive
from kvshelf.storage.agent_id import AgentId
from kvshelf.storage.location import parse_store
from kvshelf.storage.records import RecordStore

log = logging.getLogger(__name__)

AGENT_HEADER = "x-agent-id"
NODE_HEADER = "X-KVShelf-Node"
MAX_BODY_BYTES = 32 << 20
LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX = 20, 100  # OpenAI's for its paged lists
EXIT_UNSAVED = 1
"""``kvshelf serve``'s exit status when it stopped with turns that are not on disk."""
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class EventStream(StreamingResponse):
    """An SSE response that closes the engine's stream however it ends (done, error or
    disconnect): closing it cancels the request, and the engine keeps the agent's cache
    as far as it got."""

    def __init__(self, content: AsyncIterator[str], engine_stream: AsyncGenerator) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._engine_stream = engine_stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._engine_stream.aclose()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, unless the client goes away first: then cancel it and raise ClientGone.

    Cancelling a task that waits on ``Engine.astream`` cancels the engine's request.
    """
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    with suppress(asyncio.CancelledError):
        await task
    raise ClientGone


# -- the app ---------------------------------------------------------------------------------
class Guard:
    """Checks the API key (constant-time) and the body size before anything else runs,
    and answers what no handler did (a bug) as a 500 through ``error_response``.

    The size is counted on the bytes received, not on what ``Content-Length`` claims, so
    a chunked body (which has no length) is held to the same limit: the body is read
    here, before the app sees a byte of it, and refused with a 413 as soon as it passes
    ``max_body_bytes``. The rest of an oversized body is never read into memory (uvicorn
    discards it), and the connection stays open for the client's next request.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.key, self.max_body = app, (api_key or "").encode(), max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = self._refusal(scope["path"], headers)
        body = b""
        if refusal is None:
            try:
                body = await self._read_body(receive)
            except ClientGone:
                return None  # nobody is left to answer
            except _BodyTooLarge:
                refusal = self._too_large()
        if refusal is not None:
            status, error = error_response(refusal)
            extra = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            return await JSONResponse(error, status, headers=extra)(scope, receive, send)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _replay(body, receive), tracked)
        except Exception as exc:  # a bug: answered here, never re-raised (see _install_error_handlers)
            status, error = error_response(exc)  # logs it, with its traceback
            if not started:
                await JSONResponse(error, status)(scope, receive, send)

    def _refusal(self, path: str, headers: Headers) -> ApiError | None:
        """A missing or wrong API key, or a declared length over the limit (refused unread)."""
        if self.key and path != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if not token and not scheme:
                return ApiError(
                    "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' "
                    "(the key given to 'kvshelf serve --api-key').",
                    401,
                )
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                return ApiError("Incorrect API key provided.", 401, "invalid_api_key")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return self._too_large()
        return None

    def _too_large(self) -> ApiError:
        return ApiError(f"The request body is over {self.max_body} bytes.", 413, "request_too_large")

    async def _read_body(self, receive: Receive) -> bytes:
        """The whole body, whatever its framing; _BodyTooLarge as soon as it passes the limit."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _BodyTooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


class _BodyTooLarge(Exception):
    """The body passed the guard's limit."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body read by the guard, then the client's own
    messages (a disconnect, which streaming answers watch for)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class NodeFront:
    """The outermost layer: names this node on every response (``X-KVShelf-Node``, so a
    client or a balancer's log can see which node answered) and counts every answer's
    status for ``/metrics``, the guard's refusals included."""

    def __init__(self, app: ASGIApp, node_id: str, metrics: NodeMetrics) -> None:
        self.app, self.node, self.metrics = app, node_id.encode(), metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def named(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-kvshelf-node", self.node)]}
            await send(message)

        try:
            await self.app(scope, receive, named)
        finally:
            self.metrics.observe_request(scope["method"], scope["path"], status)


async def _observed(
    stream: AsyncGenerator[str | ChatResult, None], metrics: NodeMetrics
) -> AsyncGenerator[str | ChatResult, None]:
    """The engine's stream, with its final result counted in the metrics (TTFT, cached share)."""
    try:
        async for item in stream:
            if isinstance(item, ChatResult):
                metrics.observe_turn(item)
            yield item
    finally:
        await stream.aclose()


def _agent_body(a: AgentInfo) -> dict[str, Any]:
    return {
        "id": a.agent_id,
        "object": "agent",
        "tokens": a.tokens,
        "ram_bytes": a.ram_bytes,
        "disk_bytes": a.disk_bytes,
        "last_used": a.last_used,
        "resident": a.resident,
    }


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    close_engine: bool = True,
    defaults: GenerationParams | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    owner: exclusive.Ownership | None = None,
    node_id: str | None = None,
    drain: Drain | None = None,
) -> FastAPI:
    """The ASGI app over ``engine``. On shutdown (after uvicorn's grace period has let open
    requests finish or cancelled them) it closes the engine with ``close_engine``, which
    flushes pending saves; the agents it could not save are then in
    ``app.state.unsaved_at_exit``.

    ``node_id`` is sent as ``X-KVShelf-Node`` on every response (default: the host
    name); ``drain`` is the state ``kvshelf serve`` sets on SIGTERM (``kvshelf.serving.drain``).

    A sampling field a request leaves out takes its value from ``defaults``
    (``GenerationParams()``: 2048 tokens, greedy), as in the engine and the adapters."""
    defaults = defaults or GenerationParams()
    name = model_id(engine)
    node = node_id or socket.gethostname()
    drain = drain or Drain()
    metrics = NodeMetrics(node, engine.residency, engine.store_counters.snapshot, lambda: drain.draining)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.unsaved_at_exit = []
        yield
        if close_engine:
            app.state.unsaved_at_exit = await asyncio.to_thread(engine.close)

    app = FastAPI(title="kvshelf", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.drain, app.state.metrics, app.state.node_id = drain, metrics, node
    router = APIRouter()

    def refused_while_draining(aid: AgentId | None) -> JSONResponse | None:
        """While draining, a 503 with Retry-After for an agent this node does not hold in
        RAM (or a request naming none), so the balancer sends it to another node; None
        when the request may be served here."""
        if not drain.draining:
            return None
        if aid is not None and (info := engine.agent(aid)) is not None and info.resident:
            return None
        message = f"This kvshelf node ({node}) is draining before it stops; retry (another node will serve it)."
        return JSONResponse(
            error_body(message, "server_error", code="draining"), 503, headers={"Retry-After": str(RETRY_AFTER_S)}
        )

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_max_tokens(body, engine.loaded.context_length)
        turn = prepare(body, request.headers.get(AGENT_HEADER), defaults, engine.native_tools)
        if (refusal := refused_while_draining(turn.agent_id)) is not None:
            return refusal
        engine_stream = engine.astream(turn.agent_id, turn.messages, **turn.options)
        assert isinstance(engine_stream, AsyncGenerator)  # astream is an async generator: it can be closed
        stream = _observed(engine_stream, metrics)

        async def first() -> str | ChatResult:
            return await anext(stream)

        async def whole() -> list[str | ChatResult]:
            return [item async for item in stream]

        try:
            if not body.stream:
                return JSONResponse(completion(await unless_disconnected(request, whole()), turn, name))
            head = await unless_disconnected(request, first())
        except ClientGone:
            return Response(status_code=499)  # nobody is left to answer
        except Exception:
            await stream.aclose()
            raise  # answered by the app's error handlers
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(events(stream, head, turn, name, include_usage), stream)

    @router.get("/v1/models")
    def list_models() -> dict:
        model = {"id": name, "object": "model", "created": 0, "owned_by": "kvshelf"}
        return {"object": "list", "data": [{**model, "context_length": engine.loaded.context_length}]}

    @router.post("/v1/tokenize")
    def tokenize(body: ChatCompletionRequest) -> dict:
        """How many prompt tokens a chat request is, as rendered for the model (tools and
        JSON mode included): what clients need for count_tokens / remaining_tokens."""
        turn = prepare(body, None, defaults, engine.native_tools)
        text = engine.loaded.template.render(turn.messages, tools=turn.options.get("tools"))
        ids = engine.loaded.tokenizer.encode_prompt(text)
        return {"object": "tokenize", "prompt_tokens": len(ids), "context_length": engine.loaded.context_length}

    @router.get("/v1/agents")
    def list_agents(limit: int = LIST_LIMIT_DEFAULT, after: str | None = None) -> dict:
        """A page of agents in id order, as OpenAI pages its lists: ``limit`` (1-100,
        default 20), ``after`` (the last id of the previous page), ``has_more``.

        Served from the store's metadata index in the server's thread pool, so a
        listing never waits for generation nor holds it up."""
        if not 1 <= limit <= LIST_LIMIT_MAX:
            raise bad_request(f"limit must be between 1 and {LIST_LIMIT_MAX}, got {limit}", "limit", "invalid_value")
        page = engine.agents_page(limit, path_agent_id(after) if after is not None else None)
        return {
            "object": "list",
            "data": [_agent_body(a) for a in page.data],
            "first_id": page.first_id,
            "last_id": page.last_id,
            "has_more": page.has_more,
        }

    def not_found(aid: AgentId) -> UnknownAgent:
        return UnknownAgent(f"No agent {aid!r} has a cache here")

    @router.get("/v1/agents/{agent_id}")
    def get_agent(agent_id: str) -> dict:
        aid = path_agent_id(agent_id)
        info = engine.agent(aid)  # one agent's metadata, not a listing
        if info is None:
            raise not_found(aid)
        return _agent_body(info)

    @router.delete("/v1/agents/{agent_id}")
    def delete_agent(agent_id: str) -> dict:
        """Erase whatever the agent left, listed or not: a record that was quarantined as
        corrupt, or a temp file from a crashed save, is the agent's data too."""
        aid = path_agent_id(agent_id)
        removed = asdict(engine.forget(aid))  # busy 409, storage 503: answered by the error handlers
        if not (removed["files_removed"] or removed["tokens_freed"] or removed["ram_bytes_freed"]):
            raise not_found(aid)
        return {
            "id": aid,
            "object": "agent.deleted",
            "deleted": True,
            "tokens_freed": removed["tokens_freed"],
            "ram_bytes_freed": removed["ram_bytes_freed"],
            "files_removed": [Path(p).name for p in removed["files_removed"]],
        }

    @router.post("/v1/agents/{agent_id}/fork", response_model=None)
    def fork_agent(agent_id: str, body: ForkRequest) -> dict | JSONResponse:
        """Start another agent from this one's cache; their whole blocks are shared."""
        src, dst = path_agent_id(agent_id), path_agent_id(body.new_agent)
        if (refusal := refused_while_draining(None)) is not None:  # a new agent: not while draining
            return refusal
        info = asdict(engine.fork(src, dst))  # unknown 404, exists or busy 409, same agent 400
        if info["saved"] is None:  # not durable: nothing to say, as in chat
            del info["saved"]
        return {"object": "agent.fork", **info}

    @router.post("/v1/agents/{agent_id}/append")
    async def append_agent(agent_id: str, body: AppendRequest) -> JSONResponse:
        """Prefill the agent's whole conversation so far without generating (a new phase).

        With ``background: true`` it is queued at the lowest priority (prefill ahead) and
        answered at once with 202."""
        aid = path_agent_id(agent_id)
        if (refusal := refused_while_draining(aid)) is not None:
            return refusal
        turn = prepare(body, None, defaults, engine.native_tools)  # rendered as the agent's next chat will be
        future = engine.prefill_ahead(aid, turn.messages, background=body.background, tools=turn.options.get("tools"))
        if body.background:
            return JSONResponse({"object": "agent.append", "agent_id": aid, "queued": True}, 202)
        usage = await asyncio.wrap_future(future)
        return JSONResponse(
            {
                "object": "agent.append",
                "agent_id": aid,
                "queued": False,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                **({} if usage.saved is None else {"saved": usage.saved}),
            }
        )

    # what a pinned node (taskset, a cpuset) runs: one thread per core it may use
    blas_threads = {"cpus": usable_cpus(), "openblas": openblas_threads(), "blis": blis_threads()}

    @app.get("/health", response_model=None)
    def health() -> dict | JSONResponse:
        """200 while the server can keep its promises; 503 once the store directory it
        owns was deleted or replaced under it (it saves nothing until restarted), and
        from the moment it starts draining (a balancer then takes it out of its pool)."""
        if drain.draining:
            return JSONResponse({"status": "draining", "model": name, "node": node}, 503)
        if owner is not None and not owner.intact():
            reason = f"the store directory {owner.directory} was deleted or replaced; restart the server"
            return JSONResponse({"status": "unhealthy", "model": name, "node": node, "reason": reason}, 503)
        return {"status": "ok", "model": name, "node": node, "threads": blas_threads}

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        """This node's figures in Prometheus' text format (``kvshelf.serving.metrics``)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(router)
    _install_error_handlers(app)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(NodeFront, node_id=node, metrics=metrics)  # added last: the outermost
    return app


def path_agent_id(agent_id: str) -> AgentId:
    """An agent id from a URL path or a body field, validated once, here; a bad one is a 400."""
    try:
        return AgentId(agent_id)
    except InvalidAgentId as exc:
        raise bad_request(str(exc), "agent_id", "invalid_agent_id") from None


def check_max_tokens(body: ChatCompletionRequest, context_length: int) -> None:
    """A 400 for a reply longer than the whole context, as OpenAI answers one over a model's limit.

    Anything up to the context is accepted and cut to what the prompt leaves room for.
    """
    for param in ("max_completion_tokens", "max_tokens"):
        asked = getattr(body, param)
        if asked is not None and asked > context_length:
            raise bad_request(
                f"{param} is too large: {asked}. This model's context is {context_length} tokens, prompt included.",
                param,
                "invalid_value",
            )


def _install_error_handlers(app: FastAPI) -> None:
    """Every error an endpoint raises goes through ``error_response``.

    kvshelf's errors, ``ValueError`` and the framework's own refusals get handlers here.
    Anything else (a bug) is answered by ``Guard``, not by a catch-all ``Exception``
    handler: Starlette answers that one from its outermost middleware and then re-raises,
    and uvicorn closes the connection of a request whose app raised, so the client's
    next request on it would fail. Answered by the guard, the connection lives on.
    """

    async def _answer(request: Request, exc: Exception) -> JSONResponse:
        status, body = error_response(exc)
        return JSONResponse(body, status)

    app.add_exception_handler(KVShelfError, _answer)
    app.add_exception_handler(ValueError, _answer)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await _answer(request, invalid_request(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}  # 400: FastAPI's body parser
        message = f"{request.method} {request.url.path}: {exc.detail}"
        status, body = error_response(ApiError(message, exc.status_code, codes.get(exc.status_code)))
        return JSONResponse(body, status, headers=exc.headers)


def serve(
    model: str | Path = "embedded",
    *,
    cache_dir: str | Path | None = None,
    budget: int | str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    store: str | None = None,
    shared: bool = False,
    node_id: str | None = None,
    drain_s: float = DRAIN_S_DEFAULT,
    anonymous_prefixes: int = ANONYMOUS_ENTRIES,
) -> int:
    """Load the model and serve until SIGINT/SIGTERM; shutdown flushes pending saves.

    The engine is durable: a response is sent once the agent's turn is on disk (its
    ``kvshelf.saved`` says so), so a turn a client was answered survives a crash.

    The store directory is claimed first, before the model is loaded (its fingerprint,
    which names the directory, is read without the weights): a second server on the
    same store raises ``exclusive.DirectoryInUse`` at once, and a store that cannot be
    written (read-only, no permission) raises ``exclusive.StoreUnusable``; ``kvshelf
    serve`` prints either in one line and exits 2. See ``exclusive`` for what happens
    when the directory is deleted under a running server.

    ``store`` (a URL, ``kvshelf.storage.location``) replaces ``cache_dir``, which then names
    a remote store's local read-through cache. With ``shared``
    many servers (nodes, each named by ``node_id``) serve from one store: nothing claims it
    as a whole, each write is conditional on what the node last read (``Engine``), and the
    store is only checked to be usable at start (``exclusive.StoreUnusable`` otherwise).

    ``node_id`` is also this node's ``X-KVShelf-Node`` (default ``<hostname>:<port>``). SIGTERM
    drains the node for ``drain_s`` seconds first (``kvshelf.serving.drain``).

    ``anonymous_prefixes``: how many finished requests that name no agent keep their cache
    in RAM for reuse (``Engine``; 0: none).

    Returns the exit status: 0 once everything is on disk, ``EXIT_UNSAVED`` when some
    agents' latest turns could not be saved (they are named in an error logged at
    exit). A signal that stops the server is not an error, so a supervisor (systemd,
    Kubernetes) sees a clean stop as one.
    """
    import uvicorn

    from kvshelf.serving.drain import DrainingServer

    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach it can read and erase agents", host)
    location = parse_store(store if store is not None else cache_dir or default_cache_dir())
    if store is not None and cache_dir is not None and location.path is not None:
        raise ValueError("give a directory as cache_dir or as store, not both")
    local = Path(cache_dir) if cache_dir is not None and location.path is None else None  # a remote store's cache
    if shared:
        held = None
        exclusive.check_usable(location, fingerprint_of(model))
    else:
        if location.path is None:
            raise exclusive.StoreUnusable(f"{location.url}: a store that is not a directory is served with --shared")
        held = exclusive.claim(RecordStore(location.path, fingerprint_of(model)).directory)
    try:
        announce_blas()  # which BLAS MLX runs on (and the warning on the reference BLAS), before the slow load
        engine = Engine(
            model,
            local,
            budget,
            durable=True,
            store=location.url,
            shared=shared,
            node_id=node_id,
            anonymous_prefixes=anonymous_prefixes,
        )
    except BaseException:
        if held is not None:
            held.close()
        raise
    if held is not None:
        assert engine.store_dir.resolve() == held.directory, (engine.store_dir, held.directory)
        engine.guard_store(held.check)
    drain = Drain()
    node = node_id or f"{socket.gethostname()}:{port}"
    app = create_app(engine, api_key=api_key, owner=held, node_id=node, drain=drain)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
    with _stop_signals_are_requests():
        DrainingServer(config, drain, drain_s).run()
    return exit_status(getattr(app.state, "unsaved_at_exit", []))


def exit_status(unsaved: list[str]) -> int:
    """Say plainly, last thing at exit, which agents' last turns were lost; the status to exit with."""
    if not unsaved:
        log.info("kvshelf serve: every agent's last turn is on disk")
        return 0
    shown = ", ".join(unsaved[:50]) + (f" and {len(unsaved) - 50} more" if len(unsaved) > 50 else "")
    log.error(
        "kvshelf serve: stopped with the last turn of %d agent(s) NOT saved (it was in RAM only and is lost; "
        "their records on disk hold an earlier turn): %s",
        len(unsaved),
        shown,
    )
    return EXIT_UNSAVED


@contextmanager
def _stop_signals_are_requests() -> Iterator[None]:
    """While uvicorn runs, SIGTERM and SIGINT mean "shut down", which it does gracefully;
    it then restores the handlers it found and raises the signal again, to exit as the
    default handlers would (status -15, or KeyboardInterrupt). The handlers found here
    take that second delivery as the request it already was, so the exit status is ours."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread has signals
        yield
        return
    stops = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
