"""README "Use your framework's own OpenAI client": each framework's snippet, run as written
against a real ``kvshelf serve`` (a subprocess, on a tiny random-weight model), gets a warm
second turn: its agent's cache is reused, as the server's per-turn log line and (where the
framework reports it) the framework's own cached-token count show.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import REPO_ROOT
from tests.support.servers import SHORT_DRAIN, wait_up
from tests.support.tiny import make_tiny_model_dir

README_URL = "http://127.0.0.1:8000/v1"
TURN = re.compile(r"turn done: agent=(\S+) cache=(\w+) cached=(\d+)/(\d+)")


def readme_snippets() -> dict[str, str]:
    """The section's python blocks, by the framework each imports."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## Use your framework's own OpenAI client", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    by_framework = {}
    for block in blocks:
        for name, marker in (("crewai", "from crewai"), ("autogen", "autogen_ext"), ("langchain", "langchain_openai")):
            if marker in block:
                by_framework[name] = block
    assert set(by_framework) == {"crewai", "autogen", "langchain"}, by_framework
    return by_framework


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[SimpleNamespace]:
    root = tmp_path_factory.mktemp("own-clients")
    model = make_tiny_model_dir(root / "model", "gemma3_text")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = root / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvshelf.cli", "serve", "--model", str(model), "--cache-dir", str(root / "c")]
            + ["--port", str(port), "--log-level", "info", *SHORT_DRAIN],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, url)
        assert log.read_text().startswith("BLAS: OpenBLAS")  # serve names its BLAS first
        yield SimpleNamespace(url=url + "/v1", log=log)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def turns_of(log: Path, agent: str) -> list[tuple[str, int, int]]:
    return [(m[2], int(m[3]), int(m[4])) for m in TURN.finditer(log.read_text()) if m[1] == agent]


def run_snippet(name: str, server: SimpleNamespace, capsys) -> str:
    code = readme_snippets()[name]
    assert code.count(README_URL) == 1
    exec(compile(code.replace(README_URL, server.url), f"README:{name}", "exec"), {"__name__": "__readme__"})
    return capsys.readouterr().out


def assert_warm_second_turn(server: SimpleNamespace, agent: str) -> int:
    turns = turns_of(server.log, agent)
    assert len(turns) == 2, server.log.read_text()[-3000:]
    (cache1, cached1, prompt1), (cache2, cached2, prompt2) = turns
    assert cache1 == "cold" and cached1 == 0
    assert cache2 == "hot" and cached2 >= prompt1  # all of turn 1's prompt, and its reply too
    return cached2


def test_crewai_llm_snippet(server, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # CrewAI writes under $HOME; keep it offline
    monkeypatch.setenv("CREWAI_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    monkeypatch.setenv("CREWAI_TRACING_ENABLED", "false")
    printed = run_snippet("crewai", server, capsys)
    cached = assert_warm_second_turn(server, "researcher")
    assert int(printed.split()[-1]) == cached  # CrewAI's own usage summary counts the same tokens


def test_autogen_openai_client_snippet(server, capsys):
    run_snippet("autogen", server, capsys)
    assert_warm_second_turn(server, "alice")


def test_langchain_chat_openai_snippet(server, capsys):
    printed = run_snippet("langchain", server, capsys)
    cached = assert_warm_second_turn(server, "bob")
    assert int(printed.split()[-1]) == cached  # usage_metadata's cache_read is the server's cached_tokens


def cache_read(message) -> int:
    assert message.usage_metadata is not None
    return message.usage_metadata["input_token_details"]["cache_read"]


def input_tokens(message) -> int:
    assert message.usage_metadata is not None
    return message.usage_metadata["input_tokens"]


def test_chat_openai_prompt_cache_key_and_no_identity(server):
    """The two other routes of the section: prompt_cache_key per call, and no identity at all."""
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    llm = ChatOpenAI(
        model="kvshelf", base_url=server.url, api_key=SecretStr("x"), temperature=0, max_completion_tokens=16
    )
    messages = [("system", "You are Carol, a shopkeeper. " * 4), ("human", "What do you sell?")]
    first = llm.invoke(messages, prompt_cache_key="carol")
    second = llm.invoke([*messages, first, ("human", "Why?")], prompt_cache_key="carol")
    assert cache_read(second) >= input_tokens(first)
    assert [t[0] for t in turns_of(server.log, "carol")] == ["cold", "hot"]
    # no header, no key, no user: the anonymous in-RAM prefix cache still covers turn 1
    messages = [("system", "You are nobody in particular. " * 4), ("human", "Say hello.")]
    first = llm.invoke(messages)
    second = llm.invoke([*messages, first, ("human", "Again.")])
    assert cache_read(first) == 0 and cache_read(second) >= input_tokens(first)
