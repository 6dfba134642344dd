"""Hostile input: property-based fuzzing of every HTTP endpoint and of agent ids, and the
security defaults (no prompt text in the logs).

Whatever a client sends, the answer is a 2xx or a 4xx with an OpenAI error object,
never a 5xx or a crash, and nothing is written outside ``cache_dir``. The app runs
in-process (Starlette's TestClient) over a real engine on a tiny random-weight model
whose context is short, so that even a valid request is answered in milliseconds; what
depends on the HTTP server itself (chunked framing, keep-alive connections) runs on a
real uvicorn server on a loopback port. Every OpenAI sampling field is either honoured
(checked on the model's output) or refused with a 400.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from tests.support.servers import ServerThread
from tests.support.tiny import make_tiny_model_dir

pytest.importorskip("fastapi")
from starlette.testclient import TestClient  # noqa: E402

from kvshelf.runtime.engine import Engine  # noqa: E402
from kvshelf.serving.server import create_app  # noqa: E402
from kvshelf.storage.agent_id import is_valid_agent_id  # noqa: E402

CONTEXT = 256
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """Holds the cache dir and nothing else, so a file written outside it would show."""
    return tmp_path_factory.mktemp("hostile")


@pytest.fixture(scope="module")
def served(sandbox) -> Iterator[tuple[TestClient, Engine]]:
    model = make_tiny_model_dir(sandbox.parent / "hostile-model", "gemma3_text", max_position_embeddings=CONTEXT)
    engine = Engine(model=model, cache_dir=sandbox / "cache", progress=False)
    yield TestClient(create_app(engine, close_engine=False), raise_server_exceptions=False), engine
    engine.close()
    files = [p for p in sandbox.rglob("*") if p.is_file()]
    assert all(p.is_relative_to(sandbox / "cache") for p in files), files
    names = [p.name for p in files if p.parent == engine._shelf.store.directory and not p.name.startswith(".")]
    assert all(is_valid_agent_id(n.rsplit(".", 1)[0]) for n in names), names


def check(r) -> None:
    """A 2xx, or a 4xx with an OpenAI error object: never a 5xx."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"]


# -- strategies --------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
TRICKY_IDS = [
    "",
    ".",
    "..",
    "../x",
    "../../etc/passwd",
    "a/b",
    "a\\b",
    "/abs",
    "con",
    "NUL.txt",
    "x" * 129,
    "x" * 128,
    "a..b",
    "a.",
    ".hidden",
    "-dash",
    "ok:id@x.y",
    "caf\u00e9",
    "\u0430lice",
    "a\x00b",
    "a b",
    "%2e%2e",
    "\U0001f600",
    "\ud800",
    "valid-id",
]
agent_ids = st.sampled_from(TRICKY_IDS) | st.text(max_size=140)
header_ids = agent_ids.filter(lambda s: all(32 <= ord(c) < 127 for c in s) and s == s.strip())
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", ""]) | json_values
contents = (
    st.text(max_size=200)
    | st.sampled_from(["x" * 3000, "", "\ud800\udfff", "\x00" * 20])
    | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": json_values}), max_size=3)
    | json_values
)
messages = (
    st.lists(
        st.fixed_dictionaries(
            {"role": roles}, optional={"content": contents, "tool_calls": json_values, "name": json_values}
        ),
        max_size=4,
    )
    | json_values
)
small_or_giant = st.integers(-(2**70), 6) | st.integers(CONTEXT + 1, 2**70) | json_values
bodies = (
    st.fixed_dictionaries(
        {"messages": messages},
        optional={
            "model": json_values,
            "max_tokens": small_or_giant,
            "max_completion_tokens": small_or_giant,
            "temperature": st.floats() | json_values,
            "top_p": st.floats() | json_values,
            "seed": st.integers(-(2**100), 2**100) | json_values,
            "stop": json_values | st.lists(st.text(max_size=3)),
            "stream": st.booleans() | json_values,
            "stream_options": json_values,
            "tools": json_values,
            "tool_choice": json_values | st.sampled_from(["none", "auto", "required"]),
            "response_format": json_values | st.sampled_from([{"type": "json_object"}, {"type": "json_schema"}]),
            "user": agent_ids | json_values,
            "n": json_values,
            "logprobs": json_values,
            "parallel_tool_calls": json_values,
            "logit_bias": json_values | st.dictionaries(st.text(max_size=8), st.floats() | json_values, max_size=3),
            "frequency_penalty": st.floats() | json_values,
            "presence_penalty": st.floats() | json_values,
            "top_logprobs": json_values,
        },
    )
    | json_values
)


# -- properties ----------------------------------------------------------------------------------
@FUZZ
@given(body=bodies, agent=st.none() | header_ids)
def test_chat_completions_never_fail_on_any_body(served, body, agent):
    client, _ = served
    headers = {"X-Agent-Id": agent} if agent is not None else {}
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 0:
        body.setdefault("max_completion_tokens", 4)  # keeps valid requests quick; max_tokens still checked
    content = json.dumps(body, allow_nan=True)
    for path in ("/v1/chat/completions", "/v1/tokenize", "/v1/agents/fuzz-append/append"):
        check(client.post(path, content=content, headers={"Content-Type": "application/json", **headers}))


@FUZZ
@given(raw=st.binary(max_size=300), content_type=st.sampled_from(["application/json", "text/plain", "", "x/y; a=b"]))
def test_raw_garbage_bodies_are_refused(served, raw, content_type):
    client, _ = served
    r = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": content_type})
    check(r)
    assert r.status_code >= 400 or raw.strip().startswith(b"{")


@FUZZ
@given(agent=agent_ids)
def test_agent_ids_anywhere(served, agent):
    client, engine = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": agent}
    r = client.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    check(r)
    assert (r.status_code == 200) == is_valid_agent_id(agent), r.text
    path = "/v1/agents/" + quote(agent.encode("utf-8", "surrogatepass"), safe="")
    for method in (client.get, client.delete):
        r = method(path)
        check(r)
        if not is_valid_agent_id(agent):  # "", "." and the like are normalised to the listing itself
            assert r.status_code in (400, 404, 405) or r.json()["object"] == "list", r.text
    for target, body in (
        (path + "/fork", {"new_agent": "fuzz-fork"}),
        ("/v1/agents/valid-id/fork", {"new_agent": agent}),
        (path + "/append", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = client.post(target, content=json.dumps(body), headers={"Content-Type": "application/json"})
        check(r)
        if not is_valid_agent_id(agent):
            assert r.status_code in (400, 404, 405), r.text
    client.delete("/v1/agents/fuzz-fork")


@settings(max_examples=20, deadline=None, database=None)
@given(path=st.text(max_size=30), method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
def test_every_path_and_method(served, path, method):
    client, _ = served
    raw = path.encode("utf-8", "surrogatepass")
    for target in ("/" + quote(raw, safe="/"), "/v1/" + quote(raw, safe=""), "/v1/models", "/health", "/v1/agents"):
        check(client.request(method, target))


# -- the named cases, explicitly ---------------------------------------------------------------------
def test_giant_max_tokens_and_overlong_prompts_are_400(served):
    client, _ = served
    ok = {"messages": [{"role": "user", "content": "hi"}]}
    for field in ("max_tokens", "max_completion_tokens"):
        for value in (CONTEXT + 1, 10**9, 10**30):
            r = client.post("/v1/chat/completions", json={**ok, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * (CONTEXT * 2)}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/chat/completions", json={**ok, "max_tokens": CONTEXT})  # allowed, cut to what fits
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= CONTEXT


@pytest.mark.parametrize("seed", [-1, 2**64, -(2**100), 10**30])
def test_any_int_seed_is_served_and_harms_no_other_request(served, seed):
    client, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 1, "seed": seed}
    first, second = (client.post("/v1/chat/completions", json=body) for _ in range(2))
    assert first.status_code == 200 and first.json()["choices"] == second.json()["choices"]  # seeded: repeatable


# -- security defaults ------------------------------------------------------------------------------
SECRET = "PURPLE-ELEPHANT-7431 my bank PIN is 0000"


def test_no_prompt_text_in_logs(served, caplog):
    client, engine = served
    caplog.set_level(logging.INFO)
    said = [{"role": "user", "content": SECRET}]
    requests = [
        {"messages": said, "max_tokens": 3},
        {"messages": said, "max_tokens": 3, "stream": True},
        {"messages": said, "max_tokens": 3, "response_format": {"type": "json_object"}},
        {
            "messages": said,
            "max_tokens": 3,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
        },
        {"messages": [{"role": "user", "content": SECRET * 40}]},  # over the context
        {"messages": [{"role": "wizard", "content": SECRET}]},
        {"messages": said, "tool_choice": {"type": "function", "function": {"name": SECRET}}},
        {"messages": said, "temperature": SECRET},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": SECRET}]}]},
    ]
    statuses = []
    for body in requests:
        for agent in ("logged-agent", None):
            headers = {"X-Agent-Id": agent} if agent else {}
            statuses.append(client.post("/v1/chat/completions", json=body, headers=headers).status_code)
    statuses.append(client.post("/v1/chat/completions", content=SECRET).status_code)
    statuses.append(client.post("/v1/chat/completions", json=said, headers={"X-Agent-Id": SECRET}).status_code)
    assert 200 in statuses and 400 in statuses and max(statuses) < 500
    logged = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    for fragment in ("PURPLE", "ELEPHANT", "7431", "bank PIN"):
        assert fragment not in logged
    assert caplog.records  # there were log lines (warnings, access lines) to search


# -- oversized bodies, whatever their framing (a real server on a loopback port) ---------------
LIMIT = 32 << 20  # the server's default limit
MiB = 1 << 20


@pytest.fixture(scope="module")
def real_server(served) -> Iterator[str]:
    """uvicorn on a loopback port over the same engine, with the default 32 MiB limit:
    chunked framing is decided by the real HTTP parser, which the TestClient skips."""
    _, engine = served
    server = ServerThread(create_app(engine, close_engine=False))
    yield server.url
    server.stop()


def padded_chat(total: int) -> Iterator[bytes]:
    """A valid chat body of about ``total`` bytes (the padding is an ignored field), sent
    in 1 MiB pieces: a generator body goes out with ``Transfer-Encoding: chunked``."""
    yield b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "padding": "'
    sent = 0
    while sent < total:
        yield b"x" * MiB
        sent += MiB
    yield b'"}'


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/tokenize"])
def test_a_chunked_40_mb_body_is_a_413_and_the_connection_lives_on(real_server, path):
    with httpx.Client(base_url=real_server, timeout=120) as http:
        r = http.post(path, content=padded_chat(40 * MiB), headers={"Content-Type": "application/json"})
        assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
        assert r.status_code == 413, r.text[:300]
        assert r.json()["error"]["code"] == "request_too_large"
        # the same keep-alive connection answers the next request, and a small chunked body is served
        r = http.post(path, content=padded_chat(MiB), headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        assert http.get("/health").status_code == 200


def test_the_413_comes_as_soon_as_the_limit_is_passed(real_server):
    """The answer arrives while the client is still sending: the server stops counting at
    the limit instead of reading (and holding) whatever a client sends."""
    host, port = real_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"x" * MiB
        for _ in range(LIMIT // MiB + 1):  # one MiB past the limit, and the body never ends
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        head = b""
        while b"\r\n\r\n" not in head:
            got = sock.recv(65536)
            assert got, "the server closed the connection without answering"
            head += got
    assert head.startswith(b"HTTP/1.1 413 "), head[:200]


# -- every OpenAI sampling field is honoured or refused, never silently ignored ----------------
A, B = ord("a"), ord("b")  # the tiny byte tokenizer's ids are byte values


def reply(client, **fields) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_logit_bias_and_the_penalties_are_honoured(served):
    """A bias of 100 outweighs the random model's logits; the penalties then decide, turn
    by turn, between two biased tokens exactly as OpenAI defines them."""
    client, _ = served
    assert reply(client, logit_bias={str(A): 100}) == "aaaaaa"
    assert reply(client, logit_bias={str(A): 100}, temperature=1, seed=3) == "aaaaaa"
    two = {str(A): 100, str(B): 99}
    assert reply(client, logit_bias=two) == "aaaaaa"
    # frequency: each use costs 2, so a and b take turns
    assert reply(client, logit_bias=two, frequency_penalty=2) == "ababab"
    # presence: a use costs 2 once, so b gets one turn and a the rest
    assert reply(client, logit_bias=two, presence_penalty=2) == "abaaaa"
    # a ban: the unbiased greedy reply's first token never comes first again
    first = reply(client, max_tokens=1)
    assert first and reply(client, max_tokens=1, logit_bias={str(ord(first)): -100}) != first


def test_top_p_zero_is_greedy(served):
    client, _ = served
    greedy = reply(client)
    assert reply(client, top_p=0, temperature=1, seed=5) == greedy
    assert reply(client, top_p=0, temperature=2) == greedy


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"97": 101}}, "logit_bias"),
        ({"logit_bias": {"97": "x"}}, "logit_bias"),
        ({"logit_bias": {"1000000": 5}}, None),  # past this model's vocabulary (the engine's check)
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ({"top_p": -0.1}, "top_p"),
    ],
)
def test_sampling_fields_kvshelf_cannot_honour_are_a_400(served, fields, param):
    client, _ = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error
    if param is None:
        assert "logit_bias" in error["message"] and "1000000" in error["message"]


def test_parallel_tool_calls_false_keeps_one_call():
    """Honoured where the reply is shaped (the model's text is the same either way)."""
    from kvshelf.runtime.results import ChatResult, Usage
    from kvshelf.serving.completions import completion, prepare
    from kvshelf.serving.openai_api import ChatCompletionRequest

    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    for parallel, names in ((True, ["f", "g"]), (False, ["f"])):
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "tools": tools, "parallel_tool_calls": parallel}
        )
        turn = prepare(req, None)
        body = completion([text, ChatResult(text, "stop", Usage(1, 0, 1), 0.0)], turn, "m")
        message = body["choices"][0]["message"]
        assert [c["function"]["name"] for c in message["tool_calls"]] == names


def test_an_unexpected_error_is_a_500_on_a_connection_that_lives_on(served):
    """Expected errors have their own handlers; a bug (any other exception) is answered
    through the same mapping, 500 with no details, and must not close the connection
    either (Starlette's catch-all handler re-raises, and uvicorn then drops it)."""
    _, engine = served
    app = create_app(engine, close_engine=False)

    def broken() -> dict:
        raise RuntimeError("a bug, with a secret in its message")

    app.add_api_route("/v1/broken", broken)  # a route with a bug, on the real app and server
    server = ServerThread(app)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.get("/v1/broken")
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
            assert "secret" not in r.text
            port = r.extensions["network_stream"].get_extra_info("client_addr")[1]
            after = http.get("/v1/models")
            assert after.status_code == 200
            assert after.extensions["network_stream"].get_extra_info("client_addr")[1] == port
    finally:
        server.stop()
