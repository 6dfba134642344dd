"""The runtime's seams: the step loop runs over a shelf without any engine, stream events
are typed, fork and forget answer with typed results, and ``GenerationParams`` reaches
the engine's calls with keyword overrides on top."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import queue

import pytest

import kvshelf.runtime.scheduler as scheduler_module
import kvshelf.runtime.shelf as shelf_module
from kvshelf.kv.schemes import DEFAULT_SCHEME, scheme
from kvshelf.model.loader import load
from kvshelf.runtime.engine import Engine
from kvshelf.runtime.events import Event, Finished, Text
from kvshelf.runtime.params import GenerationParams
from kvshelf.runtime.results import ChatResult, ForgetResult, ForkResult
from kvshelf.runtime.sampling import Sampler
from kvshelf.runtime.scheduler import Request, Scheduler
from kvshelf.runtime.shelf import Shelf
from kvshelf.storage.agent_id import AgentId

ASK = [{"role": "user", "content": "Name three rivers and say one thing about each of them."}]
PREAMBLE = [{"role": "system", "content": "Background for every agent. " * 60}]  # more than one 256-token block


@pytest.mark.parametrize("module", [scheduler_module, shelf_module])
def test_the_loop_and_the_shelf_know_nothing_of_the_engine(module):
    """Neither module imports the engine or names one: they are built from what they use."""
    tree = ast.parse(inspect.getsource(module))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "kvshelf.runtime.engine" not in imported
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    args = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    assert not {"engine", "Engine"} & (names | attrs | args)


def test_scheduler_runs_a_turn_over_a_shelf_alone(tiny_dirs, tmp_path):
    """A scheduler built from a loaded model and a shelf serves a turn (typed events: text,
    then the result) exactly as the engine does, and the shelf saves the agent."""
    loaded = load(tiny_dirs["llama"], progress=False)
    shelf = Shelf(tmp_path / "alone", loaded.fingerprint, loaded.spec, scheme(DEFAULT_SCHEME))
    loop = Scheduler(loaded, shelf, prefill_chunk=64)
    prompt = loaded.tokenizer.encode_prompt(loaded.template.render(ASK))
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    loop.submit(Request(AgentId("solo"), prompt, 8, Sampler(0.0, 1.0, None), [], events.put))
    seen = [events.get()]
    while not isinstance(seen[-1], Finished):
        seen.append(events.get())
    loop.close()
    *texts, finished = seen
    assert all(isinstance(e, Text) for e in texts)
    assert isinstance(finished, Finished)
    result = finished.result
    assert "".join(e.text for e in texts if isinstance(e, Text)) == result.text
    assert result.agent_id == "solo" and result.cache == "cold" and result.saved is None
    fed = len(result.token_ids) - (result.finish_reason == "length")  # a last token sampled is not fed yet
    assert shelf.store.token_count("solo") == len(prompt) + fed

    with Engine(model=loaded, cache_dir=tmp_path / "engine") as engine:
        assert engine.chat("solo", ASK, max_tokens=8).token_ids == result.token_ids


def test_fork_and_forget_answer_with_typed_results(tiny_dirs, tmp_path):
    with Engine(model=tiny_dirs["llama"], cache_dir=tmp_path) as engine:
        engine.prefill("seed", PREAMBLE)
        fork = engine.fork("seed", "twin")
        assert isinstance(fork, ForkResult)
        assert fork.agent_id == "twin" and fork.source == "seed"
        assert fork.shared_tokens >= 256 and fork.shared_tokens % 256 == 0 and fork.tokens >= fork.shared_tokens
        assert isinstance(fork.shared_prefix, str)
        assert list(dataclasses.asdict(fork)) == [
            "agent_id",
            "source",
            "tokens",
            "shared_tokens",
            "shared_prefix",
            "saved",
        ]
        assert fork.saved is None  # not durable
        engine.flush()
        gone = engine.forget("twin")
        assert isinstance(gone, ForgetResult)
        assert gone.agent_id == "twin" and gone.tokens_freed == fork.tokens and gone.ram_bytes_freed > 0
        assert any(p.endswith("twin.safetensors") for p in gone.files_removed)
        assert list(dataclasses.asdict(gone)) == ["agent_id", "ram_bytes_freed", "tokens_freed", "files_removed"]
        nothing = engine.forget("twin")
        assert (nothing.ram_bytes_freed, nothing.tokens_freed, nothing.files_removed) == (0, 0, [])


def test_generation_params_with_keyword_overrides(tiny_dirs, tmp_path):
    """``params`` sets the reply's settings; a keyword given beside it wins."""
    with Engine(model=tiny_dirs["llama"], cache_dir=tmp_path) as engine:
        three = GenerationParams(max_tokens=3)
        by_params = engine.chat(None, ASK, three)
        assert by_params.token_ids == engine.chat(None, ASK, max_tokens=3).token_ids
        assert by_params.usage.completion_tokens <= 3
        overridden = engine.chat(None, ASK, three, max_tokens=6)
        assert overridden.token_ids == engine.chat(None, ASK, max_tokens=6).token_ids
        streamed = list(engine.stream(None, ASK, three))
        last, chunks = streamed[-1], [c for c in streamed[:-1] if isinstance(c, str)]
        assert isinstance(last, ChatResult) and len(chunks) == len(streamed) - 1
        assert last.token_ids == by_params.token_ids and "".join(chunks) == by_params.text
        sampled = GenerationParams(max_tokens=6, temperature=1.0, seed=7)
        assert engine.chat(None, ASK, sampled).token_ids == engine.chat(None, ASK, sampled).token_ids
        with pytest.raises(ValueError):
            engine.chat(None, ASK, three, max_tokens=0)
        with pytest.raises(ValueError):
            engine.chat(None, ASK, stop=[""], max_tokens=3)
