"""``/metrics`` and ``X-KVShelf-Node`` on a real server (uvicorn in a thread, tiny model).

The figures are read back through prometheus-client's own parser, as a Prometheus
server would read them, after real turns: a cold one, then a warm one.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import kvshelf  # noqa: F401  (OpenBLAS before mlx)
from tests.support.servers import ServerThread
from tests.support.tiny import make_tiny_model_dir

pytest.importorskip("uvicorn")
prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvshelf.runtime.engine import Engine  # noqa: E402
from kvshelf.serving.metrics import route_of  # noqa: E402
from kvshelf.serving.server import create_app  # noqa: E402

KEY = "sk-metrics"
AUTH = {"Authorization": f"Bearer {KEY}"}
ASK = [{"role": "system", "content": "You count."}, {"role": "user", "content": "One, two, three?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerThread]:
    model = make_tiny_model_dir(tmp_path_factory.mktemp("metrics-model") / "llama", "llama", eos=False)
    engine = Engine(model=str(model), cache_dir=tmp_path_factory.mktemp("metrics-store"), progress=False)
    served = ServerThread(create_app(engine, api_key=KEY, node_id="node-a"))
    yield served
    served.stop()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(url + "/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def turn(url: str, agent: str, messages: list[dict]) -> httpx.Response:
    body = {"model": "x", "messages": messages, "max_tokens": 5}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={**AUTH, "X-Agent-Id": agent}, timeout=60)


def test_every_response_names_the_node_even_a_refusal(server):
    url = server.url
    assert httpx.get(url + "/health").headers["x-kvshelf-node"] == "node-a"
    assert httpx.get(url + "/v1/models").status_code == 401  # the guard's refusal, before any route
    assert httpx.get(url + "/v1/models").headers["x-kvshelf-node"] == "node-a"
    missing = httpx.get(url + "/v1/agents/nobody", headers=AUTH)
    assert missing.status_code == 404 and missing.headers["x-kvshelf-node"] == "node-a"
    assert httpx.get(url + "/health").json()["node"] == "node-a"


def test_metrics_count_requests_turns_cached_tokens_and_residency(server):
    url = server.url
    before = scrape(url)
    first = turn(url, "mia", ASK)
    assert first.status_code == 200, first.text
    history = [*ASK, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
    second = turn(url, "mia", [*history, {"role": "user", "content": "And four?"}])
    assert second.status_code == 200 and second.json()["kvshelf"]["cache"] == "hot"
    assert httpx.get(url + "/v1/agents/ghost", headers=AUTH).status_code == 404
    after = scrape(url)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("kvshelf_http_requests_total", method="POST", route="/v1/chat/completions", status="200") == 2
    assert grew("kvshelf_http_errors_total", route="/v1/agents/{id}", status="404") == 1
    assert grew("kvshelf_time_to_first_token_seconds_count", cache="cold") == 1
    assert grew("kvshelf_time_to_first_token_seconds_count", cache="hot") == 1
    assert grew("kvshelf_time_per_output_token_seconds_count") == 2  # both replies ran to 5 tokens
    usage1, usage2 = first.json()["usage"], second.json()["usage"]
    assert grew("kvshelf_prompt_tokens_total") == usage1["prompt_tokens"] + usage2["prompt_tokens"]
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and grew("kvshelf_cached_tokens_total") == cached
    ratio = after[("kvshelf_cached_token_ratio", ())]
    assert 0 < ratio < 1
    assert after[("kvshelf_agents_resident", ())] == 1
    assert after[("kvshelf_resident_bytes", ())] > 0
    agent = httpx.get(url + "/v1/agents/mia", headers=AUTH).json()
    assert after[("kvshelf_store_agents", ())] == 1 and after[("kvshelf_store_bytes", ())] == agent["disk_bytes"]
    assert after[("kvshelf_node_info", (("node", "node-a"),))] == 1
    assert after[("kvshelf_draining", ())] == 0


def test_metrics_want_the_api_key(server):
    assert httpx.get(server.url + "/metrics").status_code == 401


def test_routes_never_carry_agent_ids():
    assert route_of("/v1/agents/secret-agent") == "/v1/agents/{id}"
    assert route_of("/v1/agents/secret-agent/fork") == "/v1/agents/{id}/fork"
    assert route_of("/v1/chat/completions") == "/v1/chat/completions"
    assert route_of("/v1/agents/a/b/c") == "other"
