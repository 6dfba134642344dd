"""Several agents talking to a running ``kvshelf serve`` through the stock ``openai`` package.

Start the server first (``kvshelf serve``, or ``kvshelf serve --api-key KEY``), then:

    python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1] [--turns 3]

Each agent sends its own id in the ``X-Agent-Id`` header, so the server keeps one KV
cache per agent: watch ``cached_tokens`` grow turn by turn, and, after a server
restart, the first turn come back ``warm`` (restored from disk) instead of ``cold``.
"""

from __future__ import annotations

import argparse
import os

import httpx
from openai import OpenAI
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

AGENTS = {
    "ada": "You are Ada, a careful engineer. Answer in one sentence.",
    "bo": "You are Bo, a cheerful poet. Answer in one short line of verse.",
    "cy": "You are Cy, a skeptic. Answer with one pointed question.",
}
QUESTIONS = ["What makes a good tool?", "Why do caches matter?", "What should we build next?"]


def cache_hits(usage: CompletionUsage | None) -> tuple[int, int]:
    """(cached, prompt) tokens of a reply; kvshelf always reports both."""
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0, usage.prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("KVSHELF_API_KEY", "not-needed"))
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    histories: dict[str, list[ChatCompletionMessageParam]] = {
        name: [{"role": "system", "content": system}] for name, system in AGENTS.items()
    }

    for turn in range(args.turns):
        question = QUESTIONS[turn % len(QUESTIONS)]
        print(f"\n== turn {turn + 1}: {question}")
        for name, history in histories.items():
            history.append({"role": "user", "content": question})
            agent = client.with_options(default_headers={"X-Agent-Id": name})  # one cache per agent
            reply = agent.chat.completions.create(
                model=model, messages=history, max_tokens=args.max_tokens, temperature=0.7, seed=turn
            )
            text = reply.choices[0].message.content or ""
            history.append({"role": "assistant", "content": text})
            (cached, prompt), extra = cache_hits(reply.usage), (reply.model_extra or {}).get("kvshelf", {})
            print(f"[{name:>3}] {extra.get('cache', '?'):>4}  cached {cached:4d}/{prompt:<4d} {text.strip()[:90]!r}")

    # streaming, as a framework would do it, with usage in the last chunk
    print("\n== ada, streamed:")
    histories["ada"].append({"role": "user", "content": "Sum up the discussion."})
    stream = client.with_options(default_headers={"X-Agent-Id": "ada"}).chat.completions.create(
        model=model,
        messages=histories["ada"],
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        elif chunk.usage:
            cached, prompt = cache_hits(chunk.usage)
            print(f"\n(cached {cached}/{prompt} tokens)")

    # the agents the server keeps (kvshelf's own endpoint, beside the OpenAI ones)
    root = args.base_url.rstrip("/")
    agents = httpx.get(f"{root}/agents", headers={"Authorization": f"Bearer {args.api_key}"}).json()["data"]
    print("\n== agents on the server:")
    for a in agents:
        print(f"{a['id']:<12} {a['tokens']:6d} tokens  ram {a['ram_bytes']:>10d} B  disk {a['disk_bytes']:>10d} B")


if __name__ == "__main__":
    main()
