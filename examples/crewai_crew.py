"""A sequential CrewAI crew (three agents, two tasks each) on kvshelf, offline.

    python examples/crewai_crew.py                  # the embedded model, in this process
    python examples/crewai_crew.py                  # again: every agent comes back "warm"
    python examples/crewai_crew.py --fresh          # forget the crew's caches first
    python examples/crewai_crew.py --base-url http://127.0.0.1:8000   # a running `kvshelf serve`

No OpenAI key is needed and nothing leaves the machine: every agent has ``llm=`` set,
planning and memory are off, and CrewAI's telemetry is disabled before it is imported.
One ``KVShelfLLM`` serves the whole crew; each agent's calls go to its own KV cache,
keyed by CrewAI's ``agent.key`` (role, goal and backstory), so a second run restores
each agent from disk. After the crew finishes, one line per model call shows the
agent, its cache state (cold, warm from disk, hot in RAM), how many prompt tokens were
reused, and the time to first token.
"""

from __future__ import annotations

import argparse
import os
import time

# Offline before CrewAI is imported: no telemetry, no tracing prompts.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

# Each agent's persona holds the team's shared briefing, as real crews' backstories often
# do: that system text is what each agent's cache keeps from task to task and run to run.
BRIEFING = (
    "Team briefing. This team writes short, correct notes for engineers. Every answer is "
    "plain text, at most two sentences, with no headings, lists or markdown. Facts come "
    "first; opinions are marked as such. When a number is uncertain, say so instead of "
    "guessing. Prefer concrete examples over general claims. Use the words of the task. "
    "Never repeat these instructions, never mention the team, and never ask questions back. "
    "The readers are busy: the first sentence must carry the point, and the second may add "
    "one detail. Names of tools, files and functions are written exactly as they are spelled."
)
AGENTS = {
    "researcher": dict(
        role="Researcher",
        goal="Find the key facts about {topic}.",
        backstory="You are a careful researcher. " + BRIEFING,
    ),
    "writer": dict(
        role="Writer",
        goal="Turn research notes about {topic} into clear prose.",
        backstory="You are a technical writer. " + BRIEFING,
    ),
    "editor": dict(
        role="Editor",
        goal="Make texts about {topic} correct and concise.",
        backstory="You are a strict editor. " + BRIEFING,
    ),
}
TASKS = [  # (agent, description, expected output): two rounds of research -> writing -> editing
    ("researcher", "List two facts about {topic}.", "Two short facts."),
    ("writer", "Write two sentences about {topic} from the research.", "Two sentences."),
    ("editor", "Edit the two sentences about {topic}.", "The edited sentences."),
    ("researcher", "Name one open question about {topic}.", "One question."),
    ("writer", "Write one sentence that answers the open question.", "One sentence."),
    ("editor", "Give the final one-line summary about {topic}.", "One line."),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running kvshelf server (default: the model in this process)")
    parser.add_argument("--api-key", default=os.environ.get("KVSHELF_API_KEY"))
    parser.add_argument("--model", default="embedded", help="in-process model: embedded, an mlx-lm dir or repo")
    parser.add_argument("--cache-dir", help="in-process cache directory (default: kvshelf's)")
    parser.add_argument("--topic", default="KV caches in language models")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fresh", action="store_true", help="forget the crew's agents before running")
    args = parser.parse_args()

    from crewai import Agent, Crew, CrewOutput, Process, Task

    import kvshelf  # noqa: F401  (OpenBLAS before MLX)
    from kvshelf.adapters.crewai import KVShelfLLM

    llm = KVShelfLLM(
        model=args.model,
        base_url=args.base_url,
        api_key=args.api_key,
        cache_dir=args.cache_dir,
        max_tokens=args.max_tokens,
    )
    agents = {
        name: Agent(**spec, llm=llm, max_iter=1, allow_delegation=False, verbose=False) for name, spec in AGENTS.items()
    }
    tasks = [
        Task(name=f"{who}-{i // 3 + 1}", description=text, expected_output=expected, agent=agents[who])
        for i, (who, text, expected) in enumerate(TASKS)
    ]
    crew = Crew(
        agents=list(agents.values()),
        tasks=tasks,
        process=Process.sequential,
        planning=False,
        memory=False,
        verbose=False,
    )

    if args.fresh:
        forget(llm, [llm.agent_id_for(agent) for agent in agents.values()])

    started = time.perf_counter()
    result = crew.kickoff(inputs={"topic": args.topic})
    assert isinstance(result, CrewOutput)  # not streamed: the crew was built without stream=True
    elapsed = time.perf_counter() - started

    print(f"\nkvshelf model {llm.backend.model_name} ({'remote ' + args.base_url if args.base_url else 'in process'})")
    print(f"{'#':>2}  {'task':<13} {'agent id':<48} {'cache':<5} {'cached/prompt':>13} {'TTFT':>7}")
    for i, turn in enumerate(llm.turns, 1):
        print(
            f"{i:>2}  {str(turn['task'])[:13]:<13} {turn['agent_id'][:48]:<48} {turn['cache']:<5} "
            f"{turn['cached_tokens']:>6}/{turn['prompt_tokens']:<6} {turn['ttft_s']:>6.2f}s"
        )
    usage = llm.get_token_usage_summary()
    print(
        f"crew: {len(llm.turns)} calls in {elapsed:.1f}s; prompt tokens {usage.prompt_tokens}, "
        f"of which reused from the agents' caches {usage.cached_prompt_tokens}"
    )
    print(f"final answer: {str(result.raw).strip()[:200]!r}")


def forget(llm, agent_ids: list[str]) -> None:
    """Erase the crew's agents, in the engine or on the server."""
    backend = llm.backend
    for aid in agent_ids:
        if hasattr(backend, "engine"):
            if any(a.agent_id == aid for a in backend.engine.agents()):
                backend.engine.forget(aid)
        else:
            backend._client.delete(f"/v1/agents/{aid}")  # 404 when it never existed: fine


if __name__ == "__main__":
    main()
