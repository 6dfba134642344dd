"""Many nodes, one shelf: real ``kvshelf serve`` processes behind the shipped HAProxy and nginx configs.

Three nodes on a tiny random-weight model run as separate processes, with HAProxy
(``deploy/haproxy.cfg``, ports replaced) in front, driven by the ``openai`` client with
its default retries, as an application would be. The balancers come from the OS
packages (``.ci/run`` installs them); where one is missing its tests are skipped and
say so. Each test gives its agents their own names, so the tests share one cluster.
"""

from __future__ import annotations

import os
import shutil
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
@needs_haproxy
def test_haproxy_routes_by_header_prompt_cache_key_or_user_and_by_path(shared):
    balancer = shared.balancer
    client = client_of(balancer.url)
    ids = ("header", "prompt_cache_key", "user")
    talks = [Conversation(client, f"agent-{i:02d}", by=ids[i % 3]) for i in range(6)]
    for _ in range(2):
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


@needs_nginx
def test_nginx_keeps_every_agent_on_one_node(shared, tmp_path):
    balancer = Nginx(shared.nodes, tmp_path)
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


# -- one shared store -------------------------------------------------------------------------
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
LONG = 1500  # tokens of a turn that is still generating when its node is paused (the model has no EOS)


class SharedCluster:
    """Three nodes over one store directory behind HAProxy, as the README's recipe runs them."""

    def __init__(self, nodes: list[Node], balancer: HAProxy) -> None:
        self.nodes, self.balancer = nodes, balancer

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def heal(self) -> None:
        """Every node running and seen UP again (a test may have paused, stopped or killed one)."""
        for node in self.nodes:
            assert node.proc is not None
            if node.proc.poll() is None:
                node.signal(signal.SIGCONT)
            else:
                node.start().wait_up()
        self.balancer.wait_for({n.name: "UP" for n in self.nodes})


def recipe_commands() -> list[str]:
    """The README's three-node recipe, as the lines an operator types."""
    section = README.split("## More than one machine", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith(("kvshelf serve", "haproxy "))]


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory) -> Iterator[SharedCluster]:
    if missing("haproxy"):
        pytest.skip(missing("haproxy") or "")
    # the nodes run the README's recipe: the same options, with the test's store, ports and model
    assert recipe_commands() == [
        *(f"kvshelf serve --store /mnt/shelf --shared --node-id node{i} --port 800{i}" for i in (1, 2, 3)),
        "haproxy -f deploy/haproxy.cfg",
    ]
    root = tmp_path_factory.mktemp("shared")
    nodes = start_nodes(model, [root / "shelf"] * 3, root, shared=True)
    balancer = HAProxy(nodes, root)
    made = SharedCluster(nodes, balancer)
    try:
        balancer.wait_for({n.name: "UP" for n in nodes})
        yield made
    finally:
        balancer.stop()
        for node in nodes:
            node.stop()


@pytest.fixture
def shared(cluster) -> Iterator[SharedCluster]:
    cluster.heal()
    yield cluster
    cluster.heal()


def metric(node: Node, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(node.url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


class LongTurn:
    """A turn sent straight to one node that is still generating when the test pauses it."""

    def __init__(self, node: Node, talk: Conversation) -> None:
        import threading

        self.reply: object = None
        self.error: BaseException | None = None
        direct = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = list(talk.messages)

        def run() -> None:
            try:
                self.reply = direct.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=LONG, extra_headers={"X-Agent-Id": talk.agent}
                )
            except BaseException as exc:  # noqa: BLE001  (handed to the test)
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        time.sleep(1.0)  # well into its generation: thousands of tokens take several seconds
        assert self.thread.is_alive(), "the long turn ended before its node could be paused"

    def result(self):
        self.thread.join(300)
        assert self.error is None, self.error
        return self.reply


def test_1_twelve_agents_each_always_served_by_the_same_node(shared):
    client = client_of(shared.balancer.url)
    talks = [Conversation(client, f"spread-{i:02d}") for i in range(12)]
    for _ in range(3):
        for talk in talks:
            talk.turn()
    for talk in talks:
        assert len(set(talk.nodes)) == 1, (talk.agent, talk.nodes)
        assert [r.model_extra["kvshelf"]["cache"] for r in talk.replies] == ["cold", "hot", "hot"], talk.agent
    assert len({t.nodes[0] for t in talks}) >= 2


def test_2_kill_9_moves_a_nodes_agents_warm_and_the_client_sees_no_failure(shared):
    client = client_of(shared.balancer.url)  # the openai client's default retries
    talks = [Conversation(client, f"killed-{i:02d}") for i in range(9)]
    for talk in talks:
        talk.turn()
    victim = shared.node(talks[0].nodes[0])
    moved = [t for t in talks if t.nodes[0] == victim.name]
    assert victim.proc is not None
    victim.proc.kill()
    victim.proc.wait(30)
    for talk in talks:
        talk.turn()  # raises on any failure the client sees
    for talk in moved:
        reply = talk.replies[-1]
        assert talk.nodes[-1] != victim.name
        assert reply.model_extra["kvshelf"]["cache"] == "warm", talk.agent  # restored from the store
        assert cached(reply) >= talk.replies[-2].usage.prompt_tokens  # the whole turn before, not recomputed
    for talk in talks:
        if talk not in moved:
            assert talk.nodes[-1] == talk.nodes[0] and talk.replies[-1].model_extra["kvshelf"]["cache"] == "hot"


def test_2_haproxy_itself_sends_a_killed_nodes_request_to_another_node(shared):
    """No client retry: the first request after the kill, before HAProxy's health check
    can have seen the node go, is answered (a refused connection is retried elsewhere)."""
    _kill_a_node_and_turn_its_agents_again(shared, shared.balancer.url, "redispatched")


def _kill_a_node_and_turn_its_agents_again(shared: SharedCluster, balancer_url: str, prefix: str) -> None:
    """Six agents take a turn through the balancer with a client that never retries; the
    node of the first is killed, and each of its agents' next turn must be answered warm
    by another node (a 5xx or a dropped connection raises)."""
    plain = openai.OpenAI(base_url=balancer_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    talks = [Conversation(plain, f"{prefix}-{i:02d}") for i in range(6)]
    for talk in talks:
        talk.turn()
    victim = shared.node(talks[0].nodes[0])
    assert victim.proc is not None
    victim.proc.kill()
    victim.proc.wait(30)
    for talk in [t for t in talks if t.nodes[0] == victim.name]:
        reply = talk.turn()
        assert talk.nodes[-1] != victim.name and reply.model_extra["kvshelf"]["cache"] == "warm"


@needs_nginx
def test_nginx_sends_a_killed_nodes_request_to_another_node(shared, tmp_path):
    """No client retry: nginx's ``proxy_next_upstream error`` takes a refused connection to
    the next node on the ring, which restores the agent from the store."""
    balancer = Nginx(shared.nodes, tmp_path)
    try:
        _kill_a_node_and_turn_its_agents_again(shared, balancer.url, "nginx-killed")
    finally:
        balancer.stop()


def test_a_node_pinned_to_one_core_runs_one_blas_thread(model, tmp_path):
    """Under ``taskset -c 0`` OpenBLAS and BLIS each run one thread, not one per machine core
    fighting over the node's one; an unpinned node runs one per core it may use."""
    from kvshelf.model.blas import installed_path
    from kvshelf.model.few_rows import system_gemm

    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    unset = {"OPENBLAS_NUM_THREADS": "", "BLIS_NUM_THREADS": ""}  # the defaults, whatever this shell sets
    pinned = Node("pinned", model, tmp_path / "a", tmp_path, prefix=("taskset", "-c", "0"), env=unset).start()
    free = Node("free", model, tmp_path / "b", tmp_path, env=unset).start()
    try:
        cores = len(os.sched_getaffinity(0))
        for node, want in ((pinned.wait_up(), 1), (free.wait_up(), cores)):
            threads = httpx.get(node.url + "/health", timeout=30).json()["threads"]
            assert threads["cpus"] == want, (node.name, threads)
            if installed_path() is not None:
                assert threads["openblas"] == want, (node.name, threads)
            if system_gemm() is not None:  # BLIS is installed and in use
                assert threads["blis"] == want, (node.name, threads)
    finally:
        pinned.stop()
        free.stop()


def test_3_a_paused_node_resumes_and_its_stale_write_is_refused(shared):
    client = client_of(shared.balancer.url)
    talk = Conversation(client, "paused-writer")
    talk.turn()
    owner = shared.node(talk.nodes[0])
    stale = LongTurn(owner, talk)
    owner.signal(signal.SIGSTOP)
    shared.balancer.wait_for({owner.name: "DOWN"})
    talk.turn()  # another node takes the agent from the store and moves it on
    talk.turn()
    assert talk.nodes[-1] != owner.name and talk.replies[-2].model_extra["kvshelf"]["cache"] == "warm"
    newer = httpx.get(f"{shared.node(talk.nodes[-1]).url}/v1/agents/{talk.agent}", timeout=30).json()
    owner.signal(signal.SIGCONT)
    late = stale.result()
    assert late.model_extra["kvshelf"]["saved"] is False  # its write was refused
    assert "dropping this node's RAM copy" in owner.log()
    assert metric(owner, "kvshelf_store_refused_writes_total") >= 1
    # no record went back in time: the store still holds the other node's newer turn
    after = httpx.get(f"{shared.node(talk.nodes[-1]).url}/v1/agents/{talk.agent}", timeout=30).json()
    assert after["tokens"] == newer["tokens"] and after["disk_bytes"] == newer["disk_bytes"]
    assert after["tokens"] < late.usage.prompt_tokens + late.usage.completion_tokens


def test_4_an_agent_deleted_while_its_old_owner_is_paused_stays_deleted(shared):
    client = client_of(shared.balancer.url)
    talk = Conversation(client, "deleted-agent")
    talk.turn()
    owner = shared.node(talk.nodes[0])
    stale = LongTurn(owner, talk)
    owner.signal(signal.SIGSTOP)
    shared.balancer.wait_for({owner.name: "DOWN"})
    gone = httpx.delete(f"{shared.balancer.url}/v1/agents/{talk.agent}", timeout=30)
    assert gone.status_code == 200 and gone.headers["x-kvshelf-node"] != owner.name, gone.text
    owner.signal(signal.SIGCONT)
    assert stale.result().model_extra["kvshelf"]["saved"] is False  # the tombstone refused it
    shared.balancer.wait_for({owner.name: "UP"})
    other = next(n for n in shared.nodes if n is not owner)  # no record: the store holds a tombstone only
    assert httpx.get(f"{other.url}/v1/agents/{talk.agent}", timeout=30).status_code == 404
    listed = httpx.get(f"{other.url}/v1/agents", params={"limit": 100}, timeout=30).json()["data"]
    assert talk.agent not in [a["id"] for a in listed]
    reply = talk.turn()  # back on its old owner, which held it in RAM
    assert talk.nodes[-1] == owner.name
    assert cached(reply) == 0 and reply.model_extra["kvshelf"]["cache"] == "cold"


def test_5_sigterm_drains_a_node_under_load_with_no_turn_lost(shared):
    import threading

    talks = [Conversation(client_of(shared.balancer.url), f"drained-{i:02d}") for i in range(6)]
    for talk in talks:
        talk.turn()
    victim = shared.node(talks[0].nodes[0])
    stop, errors = threading.Event(), []

    def keep_talking(talk: Conversation) -> None:
        try:
            while not stop.is_set():
                talk.turn()
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            errors.append((talk.agent, exc))

    threads = [threading.Thread(target=keep_talking, args=(t,)) for t in talks]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victim.signal(signal.SIGTERM)
    status = victim.wait(60)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(120)
    assert errors == [] and status == 0, (errors, victim.log()[-3000:])
    assert "NOT saved" not in victim.log()
    assert any(victim.name in t.nodes for t in talks)  # it was serving some of them
    for talk in talks:  # every acknowledged turn is in the agent's record: the next turn finds it cached
        last = talk.replies[-1]
        reply = talk.turn()
        assert cached(reply) >= last.usage.prompt_tokens, (talk.agent, talk.nodes)


def test_6_a_rejoining_node_serves_its_agents_from_the_stores_newer_record(shared):
    client = client_of(shared.balancer.url)
    talk = Conversation(client, "rejoined")
    talk.turn()
    talk.turn()
    home = shared.node(talk.nodes[0])
    assert talk.replies[-1].model_extra["kvshelf"]["cache"] == "hot"
    home.signal(signal.SIGSTOP)
    shared.balancer.wait_for({home.name: "DOWN"})
    talk.turn()
    talk.turn()  # moved on elsewhere: two turns its home's RAM never saw
    assert home.name not in talk.nodes[-2:]
    reloads = None
    home.signal(signal.SIGCONT)
    shared.balancer.wait_for({home.name: "UP"})
    reloads = metric(home, "kvshelf_store_stale_reloads_total")
    reply = talk.turn()
    assert talk.nodes[-1] == home.name  # the balancer handed it back
    assert reply.model_extra["kvshelf"]["cache"] == "warm"  # from the store's newer record, not its old RAM
    assert cached(reply) >= talk.replies[-2].usage.prompt_tokens
    assert metric(home, "kvshelf_store_stale_reloads_total") == reloads + 1
