"""``kvshelf serve`` end to end: a real uvicorn server on a loopback port, driven by the
real ``openai`` client and by httpx, on a tiny random-weight Gemma-3 model dir.

The tiny model's text is random, so tool calls and JSON mode are checked here for a
well-formed answer whatever the model emits; the parsing itself is tested on crafted
text in test_tools.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from tests.support.servers import SHORT_DRAIN, ServerThread, wait_up
from tests.support.tiny import make_tiny_model_dir

if TYPE_CHECKING:
    from openai import OpenAI

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from kvshelf.runtime.engine import Engine  # noqa: E402
from kvshelf.serving.server import create_app  # noqa: E402

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # no EOS token: replies run to max_tokens, so there is always a long one to interrupt
    return make_tiny_model_dir(tmp_path_factory.mktemp("served-model") / "gemma3", "gemma3_text", eos=False)


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory) -> Iterator[tuple[ServerThread, Engine]]:
    engine = Engine(model=str(model_dir), cache_dir=tmp_path_factory.mktemp("server-cache"), progress=False)
    server = ServerThread(create_app(engine, api_key=KEY))
    yield server, engine
    server.stop()


@pytest.fixture
def url(served) -> str:
    return served[0].url


@pytest.fixture
def client(url) -> OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, agent: str | None, messages: list[dict], **kw):
    headers = {"X-Agent-Id": agent} if agent else None
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=messages, extra_headers=headers, **kw)


# -- the basics --------------------------------------------------------------------------
def test_health_models_and_key(url):
    assert httpx.get(url + "/health").json()["status"] == "ok"  # no key needed
    r = httpx.get(url + "/v1/models", headers=AUTH)
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "model"
    for headers, code in [
        ({}, None),
        ({"Authorization": "Bearer wrong"}, "invalid_api_key"),
        ({"Authorization": KEY}, "invalid_api_key"),
    ]:
        r = httpx.get(url + "/v1/agents", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == code
        assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def test_cached_tokens_grow_turn_by_turn(client, served):
    messages = [{"role": "system", "content": "You are Alice."}, {"role": "user", "content": "Hello there."}]
    cached, sources = [], []
    for turn in range(3):
        r = chat(client, "alice", messages)
        usage = r.usage
        assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        cached.append(usage.prompt_tokens_details.cached_tokens)
        sources.append(r.model_extra["kvshelf"]["cache"])
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"Tell me more ({turn})."},
        ]
    assert cached[0] == 0 and 0 < cached[1] < cached[2]
    assert sources == ["cold", "hot", "hot"]
    assert any(a.agent_id == "alice" for a in served[1].agents())


def test_stream_matches_non_stream_with_usage(client, url):
    messages = [{"role": "user", "content": "Count with me."}]
    whole = chat(client, None, messages, max_tokens=16)
    chunks = list(chat(client, None, messages, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # anonymous: nothing persisted, but the same prompt again starts on the last one's tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    # the raw wire format: SSE data lines ending with [DONE]; no usage chunk unless asked
    body = {"model": "x", "messages": messages, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["choices"] for line in lines[:-1])


def test_stop_sequences_are_honoured_and_never_emitted(client):
    messages = [{"role": "user", "content": "Say something long."}]
    free = chat(client, None, messages, max_tokens=40).choices[0].message.content
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert len(stop) == 2
    for stream in (False, True):
        r = chat(client, None, messages, max_tokens=40, stop=[stop, "never-there"], stream=stream)
        if stream:
            chunks = [c for c in r if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == free[: free.index(stop)] and stop not in text and finish == "stop"


def test_identity_header_user_field_and_ephemeral(client, url, served):
    engine = served[1]
    before = {a.agent_id for a in engine.agents()}
    r = chat(client, None, [{"role": "user", "content": "who am I?"}])
    assert r.model_extra["kvshelf"] == {**r.model_extra["kvshelf"], "agent_id": None, "cache": "none"}
    assert {a.agent_id for a in engine.agents()} == before  # nothing persisted
    chat(client, None, [{"role": "user", "content": "I am bob."}], user="bob")
    # the header wins over the body's user field
    r = chat(client, "carl", [{"role": "user", "content": "I am carl."}], user="bob")
    assert r.model_extra["kvshelf"]["agent_id"] == "carl"
    # OpenAI's own prompt_cache_key names the agent too: after the header, before user
    r = chat(client, None, [{"role": "user", "content": "I am gus."}], prompt_cache_key="gus", user="bob")
    assert r.model_extra["kvshelf"]["agent_id"] == "gus"
    r = chat(client, "carl", [{"role": "user", "content": "I am carl."}], prompt_cache_key="gus")
    assert r.model_extra["kvshelf"]["agent_id"] == "carl"
    bad = httpx.post(url + "/v1/chat/completions", headers=AUTH, json={**OK, "prompt_cache_key": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key"
    assert {"bob", "carl", "gus"} <= {a.agent_id for a in engine.agents()}


def test_a_plain_client_without_identity_gets_cached_tokens_on_turn_two(client, served):
    """What a framework's own OpenAI client sends: no header, no key, no user."""
    engine = served[1]
    before = {a.agent_id for a in engine.agents()}
    messages = [{"role": "system", "content": "You keep a ship's log. " * 8}, {"role": "user", "content": "Log it."}]
    r1 = chat(client, None, messages)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "Next."}]
    r2 = chat(client, None, messages)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r2.model_extra["kvshelf"]["cache"] == "none" and r2.model_extra["kvshelf"]["agent_id"] is None
    assert {a.agent_id for a in engine.agents()} == before  # still nothing persisted


def test_agents_listed_read_and_erased(client, url, served):
    chat(client, "dora", [{"role": "user", "content": "Remember me."}])
    listed = {a["id"]: a for a in httpx.get(url + "/v1/agents", headers=AUTH).json()["data"]}
    dora = listed["dora"]
    assert dora["tokens"] > 0 and dora["ram_bytes"] > 0 and dora["disk_bytes"] > 0 and dora["last_used"] > 0
    assert httpx.get(url + "/v1/agents/dora", headers=AUTH).json() == dora
    gone = httpx.delete(url + "/v1/agents/dora", headers=AUTH)
    assert gone.status_code == 200
    body = gone.json()
    assert body["deleted"] and body["tokens_freed"] == dora["tokens"] and body["ram_bytes_freed"] == dora["ram_bytes"]
    assert "dora.safetensors" in body["files_removed"]
    assert not any(p.name.startswith("dora") for p in served[1].cache_dir.rglob("*"))
    for method in (httpx.get, httpx.delete):
        r = method(url + "/v1/agents/dora", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["code"] == "agent_not_found"
    r = httpx.get(url + "/v1/agents/bad%20id", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_agent_id"


def test_a_storage_failure_on_delete_is_a_503_and_the_connection_lives_on(client, url, served):
    """DELETE used to let ``StorageError`` reach the catch-all handler (which Starlette
    re-raises); it is now answered like any kvshelf error. The store cannot be made
    read-only for root, so the failure is a lock another holder keeps past the timeout."""
    store = served[1]._shelf.store
    chat(client, "erin", [{"role": "user", "content": "Keep me."}])
    served[1].flush()
    timeout, store.lock_timeout = store.lock_timeout, 0.05
    try:
        with httpx.Client(base_url=url, headers=AUTH) as http:
            with store.lock("erin"):  # held by this thread: the engine's thread cannot take it
                r = http.delete("/v1/agents/erin")
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "unavailable" and r.json()["error"]["type"] == "server_error"
            listed = http.get("/v1/agents")  # the same connection answers the next request
            assert listed.status_code == 200 and "erin" in {a["id"] for a in listed.json()["data"]}
            assert http.delete("/v1/agents/erin").status_code == 200
    finally:
        store.lock_timeout = timeout


# -- tools and JSON mode (the model is random: any well-formed answer) ------------------------
def check_reply(choice) -> None:
    msg = choice.message
    if choice.finish_reason == "tool_calls":
        assert msg.tool_calls and all(c.function.name == "get_weather" for c in msg.tool_calls)
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in msg.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(msg.content, str) and not msg.tool_calls


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_requests_answer_well_formed(client, tool_choice):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = chat(client, None, messages, tools=TOOLS, tool_choice=tool_choice)
    check_reply(r.choices[0])
    if tool_choice != "auto" and r.choices[0].finish_reason != "tool_calls":
        assert r.choices[0].message.content.startswith('<tool_call>{"name": "')  # the forced opening, shown
    chunks = [c for c in chat(client, None, messages, tools=TOOLS, tool_choice=tool_choice, stream=True) if c.choices]
    finish = chunks[-1].choices[0].finish_reason
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert (finish == "tool_calls") == bool(calls)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == (r.choices[0].message.content or "") or calls  # same greedy reply either way


def test_tools_are_rendered_and_a_tool_conversation_reuses_the_cache(client):
    user: list[dict] = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Oslo?"}]
    plain = chat(client, None, user, tools=TOOLS, tool_choice="none")
    first = chat(client, "tina", user, tools=TOOLS)
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tool text is in the prompt
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = user + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    second = chat(client, "tina", history, tools=TOOLS)
    check_reply(second.choices[0])
    # everything up to the model's turn is byte-identical, so all of it is reused
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_json_mode_opens_an_object(client):
    messages = [{"role": "user", "content": "Give me a JSON object about cats."}]
    for stream in (False, True):
        r = chat(client, None, messages, response_format={"type": "json_object"}, max_tokens=30, stream=stream)
        text = (
            "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            if stream
            else r.choices[0].message.content
        )
        assert text.startswith("{")


# -- errors ----------------------------------------------------------------------------------------
OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "body, headers, status, param, code",
    [
        ("{not json", {}, 400, None, "invalid_json"),
        ("[1, 2]", {}, 400, None, "invalid_type"),
        ({"model": "tiny"}, {}, 400, "messages", "missing_required_parameter"),
        ({**OK, "messages": []}, {}, 400, "messages", "invalid_value"),
        ({**OK, "messages": "hi"}, {}, 400, "messages", "invalid_type"),
        ({**OK, "messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "messages[0].role", "invalid_value"),
        (
            {**OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            {},
            400,
            "messages[0].content",
            "invalid_value",
        ),
        ({**OK, "temperature": "hot"}, {}, 400, "temperature", "invalid_type"),
        ({**OK, "temperature": 7}, {}, 400, "temperature", "invalid_value"),
        ({**OK, "max_tokens": 0}, {}, 400, "max_tokens", "invalid_value"),
        ({**OK, "stop": ["ok", ""]}, {}, 400, "stop", "invalid_value"),
        ({**OK, "n": 3}, {}, 400, "n", "invalid_value"),
        (
            {**OK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            {},
            400,
            "tools[0].function.name",
            "invalid_value",
        ),
        ({**OK, "tool_choice": "required"}, {}, 400, "tool_choice", None),
        (
            {**OK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            {},
            400,
            "tool_choice",
            "invalid_value",
        ),
        (OK, {"X-Agent-Id": "../etc/passwd"}, 400, "X-Agent-Id", "invalid_agent_id"),
        ({**OK, "user": "a b"}, {}, 400, "user", "invalid_agent_id"),
        ({**OK, "messages": [{"role": "user", "content": "x" * 5000}]}, {}, 400, "messages", "context_length_exceeded"),
    ],
)
def test_bad_requests_get_openai_errors(url, body, headers, status, param, code):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        url + "/v1/chat/completions",
        content=content,
        headers={**AUTH, "Content-Type": "application/json", **headers},
        timeout=60,
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert len(err["message"]) > 10


def test_errors_through_the_openai_client_and_the_server_survives(client, url):
    with pytest.raises(openai.BadRequestError, match="context"):
        chat(client, "erin", [{"role": "user", "content": "y" * 5000}])
    with pytest.raises(openai.BadRequestError, match="context"):  # checked before the stream starts
        chat(client, "erin", [{"role": "user", "content": "y" * 5000}], stream=True)
    r = httpx.get(url + "/v1/nowhere", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.put(url + "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert chat(client, "erin", [{"role": "user", "content": "still there?"}]).choices[0].finish_reason


# -- concurrency, disconnects, restarts --------------------------------------------------------------
def test_concurrent_requests_all_complete(client):
    def one(i: int):
        return chat(client, f"crowd-{i}", [{"role": "user", "content": f"I am number {i}."}], max_tokens=8)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert [r.model_extra["kvshelf"]["agent_id"] for r in results] == [f"crowd-{i}" for i in range(4)]


def _when_saved(engine: Engine, agent: str) -> int:
    """The agent's token count once its request has ended and its record matches RAM."""
    deadline = time.monotonic() + 20
    while True:
        info = [a for a in engine.agents() if a.agent_id == agent]
        if info and info[0].tokens == engine._shelf.store.token_count(agent):
            return info[0].tokens
        assert time.monotonic() < deadline, f"{agent}: the request never ended, or RAM and disk disagree"
        time.sleep(0.05)


def test_disconnect_stops_generation_and_keeps_the_cache_consistent(url, served, client):
    engine = served[1]  # its model has no EOS: an uninterrupted reply runs to max_tokens
    messages = [{"role": "user", "content": "Talk for a long time."}]
    prompt_tokens = chat(client, None, messages, max_tokens=1).usage.prompt_tokens
    body = {"model": "x", "messages": messages, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client() as http:
        with http.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={**AUTH, "X-Agent-Id": "quitter"}
        ) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen == 4:
                    break  # hang up mid-stream
    assert _when_saved(engine, "quitter") < prompt_tokens + 200  # stopped, far short of 2000 tokens
    again = chat(client, "quitter", messages)
    assert again.model_extra["kvshelf"]["cache"] == "hot"
    assert again.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 1

    # a non-streamed request whose client gives up is stopped too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/v1/chat/completions",
            json={**body, "stream": False},
            headers={**AUTH, "X-Agent-Id": "impatient"},
            timeout=httpx.Timeout(60, read=0.3),
        )
    assert _when_saved(engine, "impatient") < prompt_tokens + 1000


def test_oversized_bodies_are_refused_unread(served):
    from starlette.testclient import TestClient

    app = create_app(served[1], close_engine=False, max_body_bytes=1000)
    r = TestClient(app).post("/v1/chat/completions", content=b"x" * 2000)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_example_client_runs_as_several_agents(url):
    example = Path(__file__).parent.parent / "examples" / "openai_client.py"
    out = subprocess.run(
        [sys.executable, str(example), "--base-url", url + "/v1", "--turns", "2", "--max-tokens", "6"],
        env=dict(os.environ, KVSHELF_API_KEY=KEY),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("[ada]") == 2 and " hot " in out.stdout and "agents on the server" in out.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_cli_server(model_dir: Path, cache_dir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, KVSHELF_API_KEY=KEY)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvshelf.cli",
            "serve",
            "--model",
            str(model_dir),
            "--cache-dir",
            str(cache_dir),
            "--port",
            str(port),
            *SHORT_DRAIN,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_up(proc, url)
    return proc, url


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Application shutdown complete" in out, out  # the lifespan ran: engine.close() flushed
    return out


def test_cli_serve_restart_restores_agents_from_disk(model_dir, tmp_path):
    messages = [{"role": "system", "content": "You are Rita."}, {"role": "user", "content": "Remember the number 42."}]
    proc, url = _start_cli_server(model_dir, tmp_path)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        first = chat(client, "rita", messages)
        assert first.model_extra["kvshelf"]["cache"] == "cold"
    finally:
        _stop(proc)

    proc, url = _start_cli_server(model_dir, tmp_path)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        listed = {a["id"]: a for a in httpx.get(url + "/v1/agents", headers=AUTH).json()["data"]}
        assert listed["rita"]["disk_bytes"] > 0 and not listed["rita"]["resident"]
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Which number?"},
        ]
        second = chat(client, "rita", messages)
        assert second.model_extra["kvshelf"]["cache"] == "warm"
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    finally:
        _stop(proc)
