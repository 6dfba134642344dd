"""The adapters' backend: the same OpenAI-shaped turn in-process and over HTTP.

Every framework adapter sits on ``kvshelf.adapters.backend``; these tests check that the
two modes answer alike (same text, same cache reuse, same errors) on a tiny model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from kvshelf.adapters.backend import BackendError, LocalBackend, RemoteBackend, connect, merge_chunks, shared_engine
from kvshelf.runtime.engine import Engine
from kvshelf.serving.server import create_app
from tests.support.servers import ServerThread

BODY = {
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}],
    "max_tokens": 6,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def backends(tiny_dirs, tmp_path_factory) -> Iterator[tuple[LocalBackend, RemoteBackend, Engine]]:
    engine = Engine(tiny_dirs["gemma3_text"], tmp_path_factory.mktemp("backend-cache"), progress=False)
    server = ServerThread(create_app(engine, close_engine=False))
    remote = RemoteBackend(server.url + "/v1")
    yield LocalBackend(engine), remote, engine
    remote.close()
    server.stop()
    engine.close()


def test_local_and_remote_answer_alike_and_reuse_the_agents_cache(backends):
    local, remote, _ = backends
    first = local.complete("ada", BODY)
    assert first["kvshelf"]["cache"] == "cold" and first["kvshelf"]["agent_id"] == "ada"
    again = remote.complete("ada", BODY)  # same agent, same prompt: served from its cache
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 and again["kvshelf"]["cache"] == "hot"
    other = remote.complete("bob", BODY)  # another agent never sees ada's cache
    assert other["kvshelf"]["cache"] == "cold" and other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert local.model_name == remote.model_name and local.context_length == remote.context_length
    assert local.count_tokens(BODY) == remote.count_tokens(BODY) == first["usage"]["prompt_tokens"]


def test_streams_merge_to_the_whole_reply_in_both_modes(backends):
    local, remote, _ = backends
    body = {**BODY, "stream_options": {"include_usage": True}}
    whole = local.complete("cy", BODY)["choices"][0]["message"]["content"]
    for backend in (local, remote):
        merged = merge_chunks(list(backend.stream("cy", body)))
        assert merged["message"]["content"] == whole
        assert merged["finish_reason"] in ("stop", "length") and merged["usage"]["completion_tokens"] >= 1
        assert merged["kvshelf"]["agent_id"] == "cy"

    async def both() -> list[dict]:
        out = []
        for backend in (local, remote):
            out.append((await backend.acomplete("cy", BODY))["choices"][0]["message"]["content"])
            out.append(merge_chunks([c async for c in backend.astream("cy", body)])["message"]["content"])
        return out

    assert asyncio.run(both()) == [whole] * 4


@pytest.mark.parametrize(
    "agent, body, status, code",
    [
        ("../etc", BODY, 400, "invalid_agent_id"),
        ("ok", {**BODY, "messages": []}, 400, None),
        ("ok", {**BODY, "tool_choice": "required"}, 400, None),
    ],
)
def test_errors_are_the_same_backend_error_in_both_modes(backends, agent, body, status, code):
    local, remote, _ = backends
    errors = []
    for backend in (local, remote):
        with pytest.raises(BackendError) as info:
            backend.complete(agent, body)
        errors.append((info.value.status, info.value.code))
    assert errors[0] == errors[1] and errors[0][0] == status
    assert code is None or errors[0][1] == code


def test_connect_shares_one_engine_per_model_and_cache_dir(tiny_dirs, tmp_path):
    a = connect(tiny_dirs["llama"], cache_dir=tmp_path)
    b = connect(tiny_dirs["llama"], cache_dir=tmp_path)
    assert isinstance(a, LocalBackend) and isinstance(b, LocalBackend)
    assert a.engine is b.engine is shared_engine(tiny_dirs["llama"], tmp_path)
    other = connect(tiny_dirs["llama"], cache_dir=tmp_path / "other")
    assert isinstance(other, LocalBackend) and other.engine is not a.engine


def test_fork_and_append_work_alike_in_both_modes(backends):
    local, remote, engine = backends
    long_system = {"role": "system", "content": "Shared brief for every analyst. " * 12}
    history = {"messages": [long_system, {"role": "user", "content": "Phase one."}]}
    for backend, tag in ((local, "l"), (remote, "r")):
        done = backend.append(f"{tag}-seed", history)
        assert done["queued"] is False and done["prompt_tokens"] > 256 and done["cached_tokens"] == 0
        info = backend.fork(f"{tag}-seed", f"{tag}-child")
        assert info["shared_tokens"] >= 256 and info["agent_id"] == f"{tag}-child"
        with pytest.raises(BackendError) as exists:
            backend.fork(f"{tag}-seed", f"{tag}-child")
        assert exists.value.status == 409
        with pytest.raises(BackendError) as unknown:
            backend.fork(f"{tag}-nobody", f"{tag}-x")
        assert unknown.value.status == 404
        later = {"messages": history["messages"] + [{"role": "user", "content": "Phase two."}]}
        assert backend.append(f"{tag}-child", later, background=True)["queued"] is True
        reply = backend.complete(f"{tag}-child", {**later, "max_tokens": 3, "temperature": 0})
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= info["shared_tokens"]


def test_local_and_remote_fill_a_missing_max_tokens_alike(tmp_path_factory):
    """Without ``max_tokens`` both paths take GenerationParams' limit (the in-process one
    used to stop at 512, the server at 2048). A model without EOS runs to its limit, so the
    effective limit shows in ``completion_tokens`` and ``finish_reason``. To keep the test
    short the model's context is 600 tokens: the default, cut to what the prompt leaves
    (over 512), is reached on both paths; greedy decoding makes the two replies the same."""
    from kvshelf.runtime.params import GenerationParams
    from tests.support.tiny import make_tiny_model_dir

    model = make_tiny_model_dir(
        tmp_path_factory.mktemp("no-eos") / "llama", "llama", eos=False, max_position_embeddings=600
    )
    engine = Engine(model, tmp_path_factory.mktemp("no-eos-cache"), progress=False)
    server = ServerThread(create_app(engine, close_engine=False))
    remote = RemoteBackend(server.url + "/v1")
    try:
        body = {"messages": [{"role": "user", "content": "Go on."}]}  # no max_tokens, no temperature
        replies = [backend.complete(None, body) for backend in (LocalBackend(engine), remote)]
    finally:
        remote.close()
        server.stop()
        engine.close()
    room = engine.loaded.context_length - replies[0]["usage"]["prompt_tokens"]
    assert 512 < room < GenerationParams().max_tokens
    for reply in replies:
        assert reply["usage"]["completion_tokens"] == room and reply["choices"][0]["finish_reason"] == "length"
    assert replies[0]["choices"][0]["message"]["content"] == replies[1]["choices"][0]["message"]["content"]


def test_every_adapter_reads_the_environment_and_a_remote_one_never_imports_the_engine(backends, tmp_path):
    """KVSHELF_BASE_URL / KVSHELF_API_KEY reach all three adapters alike (through ``connect``),
    and a process that only talks to a server never imports the engine or MLX."""
    from tests.support.subprocesses import run_in_subprocess

    engine = backends[2]
    server = ServerThread(create_app(engine, api_key="sk-env", close_engine=False))
    code = f"""
import json, os, sys
os.environ.update(KVSHELF_BASE_URL={server.url + "/v1"!r}, KVSHELF_API_KEY="sk-env", HOME={str(tmp_path)!r},
                  CREWAI_DISABLE_TELEMETRY="true", OTEL_SDK_DISABLED="true", CREWAI_TRACING_ENABLED="false")
from kvshelf.adapters.autogen import KVShelfChatCompletionClient
from kvshelf.adapters.crewai import KVShelfLLM
from kvshelf.adapters.langchain import ChatKVShelf
import asyncio
kinds = {{}}
lc = ChatKVShelf(agent_id="env-lc", max_tokens=4)
lc.invoke("Hello.")
kinds["langchain"] = type(lc.backend).__name__
cw = KVShelfLLM()
kinds["crewai"] = type(cw.backend).__name__
ag = KVShelfChatCompletionClient().for_agent("env-ag")
kinds["autogen"] = type(asyncio.run(ag._backend())).__name__
loaded = {{"engine": "kvshelf.runtime.engine" in sys.modules, "mlx": "mlx.core" in sys.modules}}
print(json.dumps({{"kinds": kinds, **loaded}}))
"""
    try:
        out = run_in_subprocess(code)
    finally:
        server.stop()
    assert out["kinds"] == {"langchain": "RemoteBackend", "crewai": "RemoteBackend", "autogen": "RemoteBackend"}
    assert out["engine"] is False and out["mlx"] is False
    assert "env-lc" in {a.agent_id for a in engine.agents()}  # the call went to the server, with its key
