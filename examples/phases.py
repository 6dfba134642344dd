"""Five phases, four agents, one case file: kvshelf's working memory across phases.

A detective, two suspects and a judge work through an inquiry (opening statements,
two interrogations, a confrontation, the verdict). The case file is prefilled once and
forked to all four agents (its blocks are stored once, in RAM and on disk); each agent's
cache carries over from phase to phase, so only new messages are prefilled; and the
next speaker's cache is extended in the background while the current one speaks.

Run it twice: the second run finds all four agents on disk and restores them (warm).

    python examples/phases.py [--max-tokens 24] [--cache-dir DIR] [--fresh]

This file is the scenario's one home: ``play`` runs it in any of ``MODES``, and
``kvshelf bench`` (benchmarks/kvbench/phases.py) loads this file to time them all, each on
the engine ``engine_for`` makes for it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvshelf.runtime.engine import Engine

MODES = ("cold", "anonymous", "persistent", "persistent+ahead+shared")

CASE_FILE = """CASE FILE 7741: the disappearance of the Harbour Museum's silver astrolabe.

Facts established by the night report. The museum closed at 18:00 on Tuesday. The
astrolabe, a sixteenth-century navigation instrument insured for 1.2 million, stood in
glass case 14 in the east gallery. The case alarm was disabled at 21:42 with a valid
staff code belonging to the registrar, Mara Quill. The east gallery camera recorded
static between 21:40 and 21:55, the only gap of the night. At 22:10 the night guard,
Tomas Reyes, found case 14 open and empty and called the police at 22:13. The side door
to the loading dock was unlocked; the dock log shows no delivery that evening.

The two people questioned. Mara Quill, registrar for nine years, says she left at 18:20
and spent the evening at her sister's flat across town; her sister confirms 19:00 to
23:00, but Mara's phone connected to the museum's guest wifi at 21:37. Tomas Reyes,
night guard for two years, says he walked his rounds every forty minutes and saw no one;
his round sheet is signed for 21:30 and 22:10 but not for 20:50, and he owes 40,000 to a
lender who phoned him twice that week. A courier van with a false plate was seen near the
dock at 21:50 by a neighbour, who could not see the driver.

Physical evidence. A partial glove print on case 14 matches the museum's standard-issue
cotton gloves, which every staff member uses. The staff code was typed in three tries,
the first two wrong. Mara's code had been written on a note in the registrar's office,
which Tomas's keys open. A silver filing from the astrolabe's stand was found in the
guard room's wastepaper basket.

Rules of the inquiry. The detective questions each suspect in turn, the suspects answer
only for themselves, and the judge listens to everything and gives the verdict at the
end, naming one suspect, both, or neither, with the strongest reason."""

ROLES = {
    "detective": "You are Detective Ines Varga. Ask short, pointed questions that test the facts in the case file.",
    "mara": "You are Mara Quill, the registrar. Answer for yourself, briefly, and defend your account.",
    "tomas": "You are Tomas Reyes, the night guard. Answer for yourself, briefly, and defend your account.",
    "judge": "You are Judge Aurel Benn. Listen to everything; speak only when asked, and be brief.",
}
NAMES = {"detective": "Detective", "mara": "Mara", "tomas": "Tomas", "judge": "Judge"}

# (phase name, instruction to everyone, speakers in order)
PHASES: list[tuple[str, str, list[str]]] = [
    (
        "opening",
        "Phase 1, opening statements: each of you states your position in two sentences.",
        ["detective", "mara", "tomas", "judge"],
    ),
    (
        "interrogate-mara",
        "Phase 2: the detective questions Mara about the wifi connection at 21:37.",
        ["detective", "mara", "detective", "mara"],
    ),
    (
        "interrogate-tomas",
        "Phase 3: the detective questions Tomas about the missing round at 20:50.",
        ["detective", "tomas", "detective", "tomas"],
    ),
    (
        "confrontation",
        "Phase 4: the suspects answer each other's accounts; the detective sums up.",
        ["mara", "tomas", "detective"],
    ),
    (
        "verdict",
        "Phase 5: the judge gives the verdict; the suspects respond in one sentence.",
        ["judge", "mara", "tomas"],
    ),
]


@dataclass
class Turn:
    phase: str
    agent: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    cache: str
    text: str


@dataclass
class Transcript:
    """The group's shared history: (speaker or None for the moderator, text)."""

    case_file: str
    entries: list[tuple[str | None, str]] = field(default_factory=list)

    def seen_by(self, agent: str) -> list[dict[str, str]]:
        """The conversation as ``agent`` sees it: its own words as its turns, everyone
        else's as user messages tagged with the speaker. Only ever grows at the end,
        so each agent's prompt extends its previous one token for token."""
        messages = [{"role": "system", "content": self.case_file}, {"role": "system", "content": ROLES[agent]}]
        for speaker, text in self.entries:
            if speaker == agent:
                messages.append({"role": "assistant", "content": text})
            else:
                tag = "Moderator" if speaker is None else NAMES[speaker]
                messages.append({"role": "user", "content": f"{tag}: {text}"})
        return messages

    def prompt_for(self, agent: str) -> list[dict[str, str]]:
        return self.seen_by(agent) + [{"role": "user", "content": f"Moderator: {NAMES[agent]}, your turn."}]


def engine_for(mode: str, model: str | Path, cache_dir: str | Path | None, **options: Any) -> Engine:
    """The engine ``mode`` is played on: ``cold``'s keeps no anonymous prefixes."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if mode == "cold":
        options["anonymous_prefixes"] = 0
    return Engine(model, cache_dir, **options)


def next_speaker(phase_index: int, turn_index: int) -> str | None:
    """Who speaks after this turn (in this phase, or first in the next)."""
    speakers = PHASES[phase_index][2]
    if turn_index + 1 < len(speakers):
        return speakers[turn_index + 1]
    return PHASES[phase_index + 1][2][0] if phase_index + 1 < len(PHASES) else None


def play(
    engine: Any,
    mode: str,
    *,
    case_file: str = CASE_FILE,
    max_tokens: int = 24,
    namespace: str = "phases",
    on_turn: Callable[[Turn], None] | None = None,
) -> dict[str, Any]:
    """Play the five phases once on ``engine`` in ``mode``; returns turns and timings.

    ``cold`` and ``anonymous``: every turn is a request that names no agent, so nothing
    is persisted; on ``engine_for``'s engines, ``cold`` keeps nothing at all (every
    prompt from its first token, the baseline without caches) and ``anonymous`` reuses
    the RAM caches of recent anonymous requests where a prompt starts with their exact
    tokens (``kvshelf.runtime.anonymous``: what a framework client that sends no agent
    id gets). ``persistent``: one agent id per role, so each turn reuses the agent's
    cache. ``persistent+ahead+shared`` also prefills the case file once and forks it to
    the four agents, and after every message queues ``prefill_ahead`` for the next
    speaker while the current one speaks.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    persistent, ahead = mode.startswith("persistent"), mode == "persistent+ahead+shared"
    ids = {role: f"{namespace}-{role}" for role in ROLES}
    transcript = Transcript(case_file)
    turns: list[Turn] = []
    phase_rows = []
    t_start = time.perf_counter()
    if ahead:
        seed = f"{namespace}-casefile"
        known = {a.agent_id for a in engine.agents()}
        if not all(ids[r] in known for r in ROLES):
            if seed not in known:
                engine.prefill(seed, [{"role": "system", "content": case_file}])
            for role in ROLES:
                if ids[role] not in known:
                    engine.fork(seed, ids[role])
    for phase_index, (phase, instruction, speakers) in enumerate(PHASES):
        t_phase = time.perf_counter()
        transcript.entries.append((None, instruction))
        phase_turns = []
        for turn_index, agent in enumerate(speakers):
            if ahead and (after := next_speaker(phase_index, turn_index)) not in (None, agent):
                # the next speaker hears the conversation so far while this agent speaks
                engine.prefill_ahead(ids[after], transcript.seen_by(after))
            result = engine.chat(
                ids[agent] if persistent else None, transcript.prompt_for(agent), max_tokens=max_tokens
            )
            text = result.text.strip() or "(no answer)"
            transcript.entries.append((agent, text))
            turn = Turn(
                phase,
                agent,
                result.ttft_s,
                result.total_s,
                result.usage.prompt_tokens,
                result.usage.cached_tokens,
                result.cache,
                text,
            )
            turns.append(turn)
            phase_turns.append(turn)
            if on_turn is not None:
                on_turn(turn)
        phase_rows.append(
            {
                "phase": phase,
                "turns": len(phase_turns),
                "mean_ttft_s": sum(t.ttft_s for t in phase_turns) / len(phase_turns),
                "wall_s": time.perf_counter() - t_phase,
                "prompt_tokens": sum(t.prompt_tokens for t in phase_turns),
                "cached_tokens": sum(t.cached_tokens for t in phase_turns),
            }
        )
    return {
        "mode": mode,
        "wall_s": time.perf_counter() - t_start,
        "phases": phase_rows,
        "turns": [t.__dict__ for t in turns],
    }


NAMESPACE = "phases-example"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fresh", action="store_true", help="forget the example's agents first")
    args = parser.parse_args()

    engine = Engine(args.model, args.cache_dir)
    if args.fresh:
        for a in engine.agents():
            if a.agent_id.startswith(NAMESPACE + "-"):
                engine.forget(a.agent_id)
    print(
        "agents on disk from an earlier run:",
        [a.agent_id for a in engine.agents() if a.agent_id.startswith(NAMESPACE)],
    )
    phase = None

    def show(turn: Turn) -> None:
        nonlocal phase
        if turn.phase != phase:
            phase = turn.phase
            print(f"\n== {phase}")
        print(
            f"  {turn.agent:<9s} {turn.cache:<4s} cached {turn.cached_tokens:5d}/{turn.prompt_tokens:<5d} "
            f"TTFT {turn.ttft_s:6.2f}s  {turn.text[:70]!r}"
        )

    t0 = time.perf_counter()
    result = play(engine, "persistent+ahead+shared", max_tokens=args.max_tokens, namespace=NAMESPACE, on_turn=show)
    engine.flush()
    shared = {pid: len(users) for pid, users in engine.shared_prefixes().items()}
    print(
        f"\nwall {time.perf_counter() - t0:.1f}s over {len(result['turns'])} turns; shared prefixes "
        f"(id: agents using it): {shared}"
    )
    for a in engine.agents():
        if a.agent_id.startswith(NAMESPACE):
            print(
                f"  {a.agent_id:<26s} {a.tokens:5d} tokens  "
                f"own RAM {a.ram_bytes / 1e6:5.2f} MB  disk {a.disk_bytes / 1e6:5.2f} MB"
            )
    engine.close()


if __name__ == "__main__":
    main()
