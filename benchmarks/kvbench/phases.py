"""The 5-phase interrogation scenario, played cold, with persistent caches, and with
persistent caches plus a shared preamble and prefill ahead.

Four agents (a detective, two suspects and a judge) share one case file and move
through five phases: opening statements, the two interrogations, a confrontation and
the verdict. Every agent hears every message, as in a group chat, and each phase
starts with a new instruction for everyone. That is the structure kvshelf turns into
prefill that is never done (the case file is prefilled once and forked; each agent's
cache carries over from phase to phase) or done while nobody waits (listeners' caches
are extended in the background while another agent speaks).

``play`` runs the scenario once in one mode; ``run`` runs all three modes in one process
and returns the table for ``kvshelf bench`` (benchmarks/phases.py writes it as JSON).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODES = ("cold", "persistent", "persistent+ahead+shared")

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

    ``cold``: every turn is an ephemeral request (nothing kept). ``persistent``: one
    agent id per role, so each turn reuses the agent's cache. The third mode also
    prefills the case file once and forks it to the four agents, and after every message
    queues ``prefill_ahead`` for the next speaker while the current one speaks.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    persistent, ahead = mode != "cold", mode == MODES[2]
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


def run(out_dir: Path, quick: bool, model: str = "embedded", max_tokens: int | None = None) -> dict[str, Any]:
    """All three modes in one process, each on a fresh cache directory; the table has
    one row per phase with each mode's mean TTFT, then a total row of wall times."""
    from kvshelf.runtime.engine import Engine

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    case_file = CASE_FILE.split("\n\nPhysical evidence.")[0] if quick else CASE_FILE
    max_tokens = max_tokens or (12 if quick else 24)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="kvshelf-phases-") as scratch:
        for mode in MODES:
            engine = Engine(model, Path(scratch) / mode.replace("+", "-"), progress=False)
            try:
                engine.chat(None, [{"role": "user", "content": "warm up"}], max_tokens=2)
                runs[mode] = play(engine, mode, case_file=case_file, max_tokens=max_tokens)
            finally:
                engine.close()
    table = []
    for i, (phase, _, _) in enumerate(PHASES):
        row: dict[str, Any] = {"phase": phase}
        for mode in MODES:
            row[f"{mode} ttft s"] = round(runs[mode]["phases"][i]["mean_ttft_s"], 3)
        for mode in MODES:
            row[f"{mode} wall s"] = round(runs[mode]["phases"][i]["wall_s"], 2)
        table.append(row)
    total: dict[str, Any] = {"phase": "total"}
    for mode in MODES:
        total[f"{mode} ttft s"] = round(sum(t["ttft_s"] for t in runs[mode]["turns"]) / len(runs[mode]["turns"]), 3)
    for mode in MODES:
        total[f"{mode} wall s"] = round(runs[mode]["wall_s"], 2)
    table.append(total)
    cold = runs["cold"]["wall_s"]
    result = {
        "title": "Phases: the 5-phase interrogation scenario",
        "description": (
            f"4 agents, 5 phases, {sum(len(p[2]) for p in PHASES)} turns of up to {max_tokens} tokens on {model}; "
            "the same scenario cold (no cache), with persistent per-agent caches, and with persistent caches "
            "plus the case file prefilled once and forked, and listeners prefilled ahead. TTFT is the mean per turn."
        ),
        "table": table,
        "speedup_vs_cold": {mode: round(cold / runs[mode]["wall_s"], 2) for mode in MODES},
        "runs": runs,
    }
    (out_dir / "phases.json").write_text(json.dumps(result, indent=2))
    return result
