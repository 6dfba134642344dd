"""``kvshelf demo``: four agents, each with its own notes, hold a council meeting.

Each agent keeps its own minutes of the meeting (its notes, the briefing, every speech
so far) and its own KV cache of them; in its turn the model continues its minutes with
its speech. Each agent's reply streams as it is generated, and beside it: where its cache came
from (cold: computed from nothing; warm: restored from disk; hot: still in RAM), how
many prompt tokens were reused, its time to first token and the bytes it holds. A
cold prefill that takes more than a couple of seconds shows its progress.

The conversation itself (what a framework would keep in its own memory) is saved
next to the caches after every reply, so running the demo again continues it: every
agent's first turn is then restored from disk instead of recomputed. Ctrl-C stops the
reply in progress at the next model call, flushes every save, says what is on disk,
and exits with status 130; the next run carries on from the last finished reply.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from kvshelf.ctrl_c import from_ctrl_c, raise_if_ctrl_c_was_pressed
from kvshelf.runtime.engine import ChatResult, Engine
from kvshelf.runtime.params import GenerationParams

TOPIC = """\
Briefing for the Millbrook town council, spring session.

The old railway station on Station Road closed to passengers ten years ago, when the
branch line was cut back to Ashford Junction. The building is a two-storey Victorian
brick hall with a slate roof, a glazed canopy over the former platform, a booking hall
of about 300 square metres, two waiting rooms, a parcels office and a goods shed of
roughly 500 square metres behind it. The council bought the site from the railway five
years ago for a nominal sum, on condition that it is put to public benefit within
seven years, or it reverts.

Condition: a survey last autumn found the roof sound but the canopy's cast-iron columns
corroded at their bases. Repairing the canopy is estimated at 180,000 pounds. The
booking hall needs rewiring, heating and accessible toilets before any public use,
estimated at 420,000 pounds. The goods shed is structurally sound but has no insulation.

Four proposals are on the table.
1. A public library and study space in the booking hall, with the goods shed as a
   community events room. Running cost about 95,000 pounds a year; the county would
   fund half for the first five years if the old library on Mill Lane is sold.
2. A covered food market, six days a week, with stalls in the booking hall and goods
   shed. A market operator has offered a 15-year lease at 40,000 pounds a year, but wants
   40 parking spaces, which would take the old coal yard.
3. A bicycle workshop and repair cafe run by a charity, with bike storage for commuters
   who ride to the bus interchange. Small rent, 12 jobs, volunteer-run evenings.
4. Demolition and 36 homes, 12 of them affordable. A developer would pay 1.1 million
   pounds for the site, but the heritage society has applied for listed status, which
   would block demolition if granted.

Traffic: Station Road already carries 6,000 vehicles a day and the primary school is
200 metres away. Footfall on Station Road's shops has fallen by a third since the
station closed. The town has 2,100 residents aged 16 to 25 and no youth centre.
"""

AGENTS = {
    "planner": "Ada, the town planner, who cares about budgets, zoning and the traffic on Station Road",
    "historian": "Ben, the local historian, who cares about heritage and the station's Victorian brickwork",
    "shopkeeper": "Cleo, who runs the bakery on Station Road and cares about foot traffic and small shops",
    "student": "Dev, a student who cycles everywhere and wants a cheap place for young people to meet",
}
"""Who each agent is: the first line of its own notes, so every agent's cache starts differently."""

AGENTS_NAMES = {"planner": "Ada", "historian": "Ben", "shopkeeper": "Cleo", "student": "Dev"}
SPEAKERS = {
    "planner": "Ada (town planner)",
    "historian": "Ben (historian)",
    "shopkeeper": "Cleo (baker on Station Road)",
    "student": "Dev (student)",
}
"""How each agent is named in the minutes."""

OPENINGS = {
    "planner": "On the budget, I think",
    "historian": "For the town's heritage, I think",
    "shopkeeper": "For the shops on Station Road, I think",
    "student": "For young people, I think",
}
"""The first words of each agent's first speech, written into its minutes before the
model continues them: a base model told only a name tends to repeat the line before;
told how a speech starts, it gives a view. They are shown as part of the reply (dim, on
a terminal), and kept in the minutes."""

CHAIR = (
    "Chair: Thank you all for coming. Let us hear each of you in turn, briefly: which proposal "
    "should the council back, and why?"
)

LATER_ROUNDS: list[tuple[str, dict[str, str]]] = [
    (
        "What do you say to the points made so far?",
        {
            "planner": "I disagree with {prev} on one thing:",
            "historian": "{prev} has a point, but",
            "shopkeeper": "Unlike {prev}, I believe",
            "student": "{prev} forgets one thing:",
        },
    ),
    (
        "What would change your mind?",
        {
            "planner": "I would change my mind if the county",
            "historian": "Only one thing would change my mind:",
            "shopkeeper": "I could back another plan if",
            "student": "Nothing will change my mind unless",
        },
    ),
    (
        "What should the council do first?",
        {
            "planner": "The first step is a vote on",
            "historian": "Before anything else, we must",
            "shopkeeper": "This week the council should",
            "student": "Tomorrow we could start by",
        },
    ),
]
"""From the second round on, the chair's question and how each agent's speech starts, in
turn (then again from the top). Each round asks something new, and each agent starts
its speech in its own words ({prev}: the speaker before it): told to open a speech as an
earlier one opened, a base model goes on with that speech word for word."""


def _round(turn: int) -> tuple[str, dict[str, str]]:
    """(the chair's line, each agent's opening) of a round after the first."""
    question, openings = LATER_ROUNDS[(turn - 2) % len(LATER_ROUNDS)]
    return f"Chair: Round {turn}. {question}", openings


SAMPLING: dict[str, Any] = {
    "temperature": 0.9,
    "top_p": 0.95,
    "frequency_penalty": 0.8,
    "presence_penalty": 0.4,
    "dry_multiplier": 1.0,
    "dry_base": 1.75,
    "dry_allowed_length": 3,
}
"""How the replies are sampled. Greedy decoding makes the 270M base model say the same line
each turn (and every agent the same line); sampling with OpenAI's frequency and presence
penalties (``kvshelf.runtime.sampling``) gives each agent its own words. Those count only
what the reply generates, not the minutes the model reads, and from the second round on
the base model copied earlier speeches out of its minutes: DRY (``dry_*``,
``kvshelf.runtime.repetition``) penalizes the token that would extend a repeat of the
minutes past 3 tokens, more steeply the longer the repeat (1.75 times per token), so a
name or a figure may be quoted, a speech may not. The seed is the agent's and the
round's, so a run with ``--fresh`` says the same again."""

SENTENCES = 2
"""A speech ends after this many sentences (or at the end of its line, or at ``max_tokens``)."""

NEWLINE_BIAS = -4.0
"""A base model often ends a line after a few words; the newline tokens are made less
likely (OpenAI's ``logit_bias``), so a speech says something before its line ends."""


def _newline_bias(engine: Engine) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` against the tokens that are only line breaks."""
    ids = {found[0] for text in ("\n", "\n\n") if len(found := engine.loaded.tokenizer.encode(text)) == 1}
    return tuple((i, NEWLINE_BIAS) for i in sorted(ids))


PROGRESS_AFTER_S = 2.0
"""A prefill still running after this long shows its progress."""

PREFILL_CHUNK = 128
"""Tokens per prefill call. Ctrl-C takes effect between model calls, so it waits for at most
one chunk: about half a second at 128 tokens on 2 cores with OpenBLAS (256 is the engine's
default)."""


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _stats(r: ChatResult, ram: int, disk: int) -> str:
    u = r.usage
    speed = f"{u.completion_tokens / (r.total_s - r.ttft_s):.1f} tok/s" if r.total_s > r.ttft_s else "-"
    return (
        f"[{r.cache} | cached {u.cached_tokens}/{u.prompt_tokens} | ttft {r.ttft_s:.2f} s | "
        f"{u.completion_tokens} tokens, {speed} | ram {_fmt_bytes(ram)}, disk {_fmt_bytes(disk)}]"
    )


class Console:
    """Streams replies to a terminal or a pipe.

    A progress note has a line of its own: on a terminal it is rewritten in place and
    erased before the next text, in a pipe each note is a line. Text never lands in the
    middle of a note, nor a note in the middle of a reply."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self._lock = threading.Lock()
        self._progress_shown = False

    def write(self, text: str) -> None:
        with self._lock:
            self._clear_progress()
            self.out.write(text)
            self.out.flush()

    def progress(self, text: str) -> None:
        """Show (or update) a progress note on its own line; on a terminal, the next write replaces it."""
        with self._lock:
            if self.tty:
                self.out.write("\r\033[K" + text)  # back to the line's start, erase it, write the note
                self._progress_shown = True
            else:
                self.out.write(text + "\n")
            self.out.flush()

    def _clear_progress(self) -> None:
        if self._progress_shown:
            self.out.write("\r\033[K")
            self._progress_shown = False


def _prefill_progress(console: Console, who: str, t0: float) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        elapsed = time.perf_counter() - t0
        if elapsed >= PROGRESS_AFTER_S:
            console.progress(f"  ({who}: prefill {done}/{total} tokens, {100 * done // total}%, {elapsed:.0f} s)")

    return show


def _printable(text: str) -> str:
    """A reply as one line of plain text: newlines and control characters (a model may emit
    terminal escapes) are shown as spaces."""
    return "".join(c if c.isprintable() else " " for c in text)


_SENTENCE_END = re.compile(r"(?<=[^\W\d_]|[)\"'])[.!?](?=\s)")


def _after_sentences(n: int) -> Callable[[str], int]:
    """``until`` for the engine: the reply is complete after its ``n``-th sentence (a stop
    after a letter and before a space: "3.5" and a list's "2. " do not end one)."""

    def until(text: str) -> int:
        ends = [m.end() for m in _SENTENCE_END.finditer(text)]
        return ends[n - 1] if len(ends) >= n else -1

    return until


def _opening(agent: str, turn: int) -> str:
    """How the agent's speech in this round starts: its own opening, then a reply to the speaker before it."""
    if turn == 1:
        return OPENINGS[agent]
    order = list(AGENTS)
    return _round(turn)[1][agent].format(prev=AGENTS_NAMES[order[order.index(agent) - 1]])


def _speak(engine: Engine, console: Console, agent: str, minutes: str, turn: int, max_tokens: int) -> ChatResult:
    """One agent's turn, streamed to the console: the model continues the agent's minutes
    after "<speaker>: <its opening>".

    The embedded model is a base model, not instruction-tuned: asked in chat form, it
    mostly repeats its prompt. So each agent's prompt is a document a base model knows
    how to go on with, the minutes of the meeting as this agent has heard it, sent as an
    open assistant message (``"prefix": True``) that the model continues. The next turn's
    minutes start with this turn's prompt and reply, so its cache is reused."""
    index = list(AGENTS).index(agent)
    params = GenerationParams(
        max_tokens=max_tokens, seed=1000 * turn + index, stop=("\n",), logit_bias=_newline_bias(engine), **SAMPLING
    )
    t0 = time.perf_counter()
    stream = engine.stream(
        f"demo-{agent}",
        [{"role": "assistant", "content": minutes + f"{SPEAKERS[agent]}: {_opening(agent, turn)}", "prefix": True}],
        params,
        until=_after_sentences(SENTENCES),
        progress=_prefill_progress(console, AGENTS_NAMES[agent], t0),
    )
    opening = _opening(agent, turn)
    # on a terminal the opening is dim: those are the prompt's words, not the model's
    speaker = f"  {SPEAKERS[agent]}: " + (f"\033[2m{opening}\033[0m" if console.tty else opening)
    try:
        for item in stream:
            raise_if_ctrl_c_was_pressed()
            if speaker:  # the speaker's line starts with its first words, after any progress note
                console.write(speaker)
                speaker = ""
            if isinstance(item, ChatResult):
                return item
            console.write(_printable(item))
    finally:
        stream.close()  # on Ctrl-C: cancels the request at the next model call; its cache is kept
    raise RuntimeError("generation ended without a result")  # pragma: no cover


def run_demo(
    model: str = "embedded",
    cache_dir: Path | None = None,
    turns: int = 2,
    max_tokens: int = 48,
    budget: str | None = None,
    fresh: bool = False,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Run the round-table; returns a summary (also printed).

    On Ctrl-C (KeyboardInterrupt) the reply in progress is cancelled, every save is
    flushed and what is on disk is printed; then the KeyboardInterrupt goes on to the
    caller (``kvshelf demo`` exits 130 on it, without a traceback).
    """
    console = Console(out)
    engine = Engine(model=model, cache_dir=cache_dir, budget=budget, prefill_chunk=PREFILL_CHUNK)
    try:
        raise_if_ctrl_c_was_pressed()  # during the load, where its exception can be lost
        return _round_table(engine, console, turns, max_tokens, fresh)
    except BaseException as exc:
        if not from_ctrl_c(exc):  # a library may turn the KeyboardInterrupt into another exception
            raise
        _stop(engine, console)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise KeyboardInterrupt from exc
    finally:
        engine.close()


def _stop(engine: Engine, console: Console) -> None:
    """After Ctrl-C: flush the saves, say what is on disk. A second Ctrl-C quits at once."""

    def now(signum: int, frame: object) -> None:
        os._exit(130)

    previous = signal.signal(signal.SIGINT, now) if threading.current_thread() is threading.main_thread() else None
    try:
        console.write("\n\ninterrupted: stopping the reply in progress and saving (Ctrl-C again to quit now)\n")
        t0 = time.perf_counter()
        # The cancelled reply is retired (and its save queued) in the step loop's pass after
        # the one that answers the first flush; the second waits for that save too.
        engine.flush()
        unsaved = set(engine.flush())
        saved = [a for agent in AGENTS if (a := engine.agent(f"demo-{agent}")) is not None and a.disk_bytes]
        for a in saved:
            mark = "NOT saved (kept in RAM only)" if a.agent_id in unsaved else "saved"
            console.write(
                f"  {a.agent_id:<16s} {a.tokens or 0:6d} tokens  {_fmt_bytes(a.disk_bytes)} on disk  {mark}\n"
            )
        console.write(
            f"{len(saved) - len(unsaved)} agents' caches are on disk in {engine.store_dir} "
            f"(flushed in {time.perf_counter() - t0:.2f} s); run kvshelf demo again to continue\n"
        )
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _round_table(engine: Engine, console: Console, turns: int, max_tokens: int, fresh: bool) -> dict[str, Any]:
    state_file = engine.cache_dir / "demo-state.json"
    if fresh:
        for agent in AGENTS:
            engine.forget(f"demo-{agent}")
        state_file.unlink(missing_ok=True)
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    if "minutes" not in state:  # none yet, or a state an older demo wrote
        state = _new_state()
    minutes, spoken = state["minutes"], state["spoken"]
    first_turn = state["turn"] + 1
    console.write(f"kvshelf demo: {len(AGENTS)} agents on {engine.loaded.name}; caches in {engine.cache_dir}\n")
    if first_turn > 1 or spoken:
        console.write(
            f"continuing the conversation at round {first_turn}: every agent's cache should come back warm from disk\n"
        )
    t0 = time.perf_counter()
    counts = {"hot": 0, "warm": 0, "cold": 0}
    ttfts: dict[str, list[float]] = {"hot": [], "warm": [], "cold": []}
    fresh_minutes = _longest_minutes(engine, _new_state()["minutes"])  # a new meeting's, before any round
    for turn in range(first_turn, first_turn + turns):
        used = _longest_minutes(engine, minutes) if not spoken else 0
        if used > fresh_minutes and used + _round_room(max_tokens) > engine.loaded.context_length:
            console.write(
                f"the minutes ({used} tokens) no longer leave room for a round in the model's context "
                f"({engine.loaded.context_length} tokens): the council starts a new meeting\n"
            )
            for agent in AGENTS:
                engine.forget(f"demo-{agent}")
            state = _new_state()
            minutes, spoken = state["minutes"], state["spoken"]
        console.write(f"round {turn}\n")
        if turn > 1 and not spoken:
            for other in AGENTS:
                minutes[other] += _round(turn)[0] + "\n\n"
        for agent in AGENTS:
            if agent in spoken:
                continue  # spoke in this round before an interrupted run stopped
            result = _speak(engine, console, agent, minutes[agent], turn, max_tokens)
            engine.flush()  # saves are written behind; wait so the disk column is current
            line = f"{SPEAKERS[agent]}: {_opening(agent, turn)}{result.text}".rstrip()
            # Like a framework's agent memory: every agent's minutes get what was said,
            # the speaker's own (its prompt and reply, so its next turn reuses its cache).
            for other in AGENTS:
                minutes[other] += line + "\n\n"
            info = engine.agent(f"demo-{agent}")
            ram, disk = (info.ram_bytes, info.disk_bytes) if info is not None else (0, 0)
            console.write(f"\n      {_stats(result, ram, disk)}\n")
            counts[result.cache] += 1
            ttfts[result.cache].append(result.ttft_s)
            spoken.append(agent)
            _save_state(state_file, state)  # after every reply: an interrupted run resumes here
        state["turn"] = turn
        spoken.clear()
        _save_state(state_file, state)
    wall = time.perf_counter() - t0
    medians = {k: sorted(v)[len(v) // 2] for k, v in ttfts.items() if v}
    summary = {"wall_s": wall, "requests": counts, "median_ttft_s": medians}
    console.write(f"total wall time {wall:.1f} s; requests by cache source: {counts}\n")
    console.write("median ttft: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in medians.items()) + "\n")
    return summary


def _longest_minutes(engine: Engine, minutes: dict[str, str]) -> int:
    """Tokens of the longest agent's minutes (what its next prompt starts with)."""
    return max(len(engine.loaded.tokenizer.encode(text)) for text in minutes.values())


def _round_room(max_tokens: int) -> int:
    """Tokens one round may add to an agent's minutes: the chair's words and every
    agent's speech (its opening and speaker tag too), with a margin."""
    return len(AGENTS) * (max_tokens + 64) + 256


def _save_state(path: Path, state: dict[str, Any]) -> None:
    """Atomically: an interrupted write never leaves a conversation that cannot be read."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def _new_state() -> dict[str, Any]:
    """Each agent's minutes start with its own notes, then the briefing and the chair's question."""
    return {
        "turn": 0,
        "spoken": [],
        "minutes": {
            a: f"Notes of {who}.\n\n{TOPIC}\nMinutes of the council meeting.\n\n{CHAIR}\n\n"
            for a, who in AGENTS.items()
        },
    }
