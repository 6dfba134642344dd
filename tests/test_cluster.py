"""Many nodes, one shelf: real ``kvshelf serve`` processes behind the shipped HAProxy and nginx configs.

Three nodes on a tiny random-weight model run as separate processes, with HAProxy
(``deploy/haproxy.cfg``, ports replaced) in front, driven by the ``openai`` client with
its default retries, as an application would be. The balancers come from the OS
packages (``.ci/run`` installs them); where one is missing its tests are skipped and
say so. Each test gives its agents their own names, so the tests share one cluster.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from tests.support.cluster import HAProxy, Nginx, Node, missing, start_nodes
from tests.support.tiny import make_tiny_model_dir

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

needs_haproxy = pytest.mark.skipif(missing("haproxy") is not None, reason=missing("haproxy") or "")
needs_nginx = pytest.mark.skipif(missing("nginx") is not None, reason=missing("nginx") or "")
TOKENS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("cluster-model") / "llama", "llama", eos=False)


def opening(agent: str) -> list[dict]:
    return [
        {"role": "system", "content": f"You are {agent}, one of a dozen agents."},
        {"role": "user", "content": f"{agent}, say something."},
    ]


class Conversation:
    """One agent's history, carried on turn by turn through a balancer."""

    def __init__(self, client, agent: str, by: str = "header") -> None:
        self.client, self.agent, self.by = client, agent, by
        self.messages = opening(agent)
        self.nodes: list[str] = []
        self.replies: list = []

    def turn(self):
        ident: dict = {"extra_headers": {"X-Agent-Id": self.agent}}
        if self.by == "prompt_cache_key":
            ident = {"extra_body": {"prompt_cache_key": self.agent}}
        elif self.by == "user":
            ident = {"user": self.agent}
        raw = self.client.chat.completions.with_raw_response.create(
            model="tiny", messages=self.messages, max_tokens=TOKENS, temperature=0, **ident
        )
        reply = raw.parse()
        self.nodes.append(raw.headers["x-kvshelf-node"])
        self.replies.append(reply)
        self.messages = [
            *self.messages,
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"Go on, {self.agent}."},
        ]
        return reply


def client_of(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)  # the default retries


# -- routing -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def own_store_nodes(model, tmp_path_factory) -> Iterator[list[Node]]:
    """Three nodes, each on its own store (what routing alone needs)."""
    root = tmp_path_factory.mktemp("routing")
    nodes = start_nodes(model, [root / f"store{i}" for i in range(3)], root)
    yield nodes
    for node in nodes:
        node.stop()


@needs_haproxy
def test_haproxy_keeps_every_agent_on_one_node(own_store_nodes, tmp_path):
    balancer = HAProxy(own_store_nodes, tmp_path)
    try:
        balancer.wait_for({name: "UP" for name in balancer.names})
        client = client_of(balancer.url)
        ids = ("header", "prompt_cache_key", "user")
        talks = [Conversation(client, f"agent-{i:02d}", by=ids[i % 3]) for i in range(12)]
        for _ in range(3):
            for talk in talks:
                talk.turn()
        for talk in talks:
            assert len(set(talk.nodes)) == 1, (talk.agent, talk.by, talk.nodes)
            later = talk.replies[1:]
            assert all(r.model_extra["kvshelf"]["cache"] == "hot" for r in later), (talk.agent, talk.nodes)
            assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in later)
        used = {talk.nodes[0] for talk in talks}
        assert len(used) >= 2, used  # spread over the nodes, not all on one
        # the agent's own endpoints go to its node too (by the id in the path)
        agent = talks[0]
        listing = httpx.get(f"{balancer.url}/v1/agents/{agent.agent}", timeout=30)
        assert listing.status_code == 200 and listing.headers["x-kvshelf-node"] == agent.nodes[0]
        assert listing.json()["resident"] is True
    finally:
        balancer.stop()


@needs_nginx
def test_nginx_keeps_every_agent_on_one_node(own_store_nodes, tmp_path):
    balancer = Nginx(own_store_nodes, tmp_path)
    try:
        client = client_of(balancer.url)
        talks = [Conversation(client, f"nginx-{i:02d}") for i in range(6)]
        for _ in range(2):
            for talk in talks:
                talk.turn()
        for talk in talks:
            assert len(set(talk.nodes)) == 1, (talk.agent, talk.nodes)
            assert talk.replies[1].model_extra["kvshelf"]["cache"] == "hot"
        assert len({talk.nodes[0] for talk in talks}) >= 2
    finally:
        balancer.stop()


# -- drain ------------------------------------------------------------------------------------
def test_sigterm_drains_health_503_new_agents_refused_resident_served_exit_0(model, tmp_path):
    node = Node("drainer", model, tmp_path / "store", tmp_path, ("--drain-seconds", "4")).start().wait_up()
    try:
        client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kept = Conversation(client, "kept")
        kept.turn()
        node.signal(signal.SIGTERM)
        deadline = time.monotonic() + 2
        while httpx.get(node.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503 on SIGTERM"
            time.sleep(0.05)
        health = httpx.get(node.url + "/health", timeout=5)
        assert health.json()["status"] == "draining" and health.headers["x-kvshelf-node"].endswith(f":{node.port}")
        assert kept.turn().model_extra["kvshelf"]["cache"] == "hot"  # an agent it holds is still served
        body = {"model": "tiny", "messages": opening("newcomer"), "max_tokens": TOKENS}
        refused = httpx.post(
            node.url + "/v1/chat/completions", json=body, headers={"X-Agent-Id": "newcomer"}, timeout=30
        )
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["code"] == "draining"
        assert node.wait(60) == 0, node.log()
        assert "NOT saved" not in node.log()
    finally:
        node.stop()
    restarted = Node("again", model, tmp_path / "store", tmp_path).start().wait_up()
    try:
        again = openai.OpenAI(base_url=restarted.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        resumed = Conversation(again, "kept")
        resumed.messages = kept.messages
        reply = resumed.turn()  # both turns it answered are on disk: the whole history is cached
        assert reply.model_extra["kvshelf"]["cache"] == "warm"
        assert reply.usage.prompt_tokens_details.cached_tokens >= kept.replies[-1].usage.prompt_tokens
    finally:
        restarted.stop()
