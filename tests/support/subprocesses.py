"""Real restarts: code run in a fresh Python process, from the repository root.

A test that needs to know what survives a restart cannot fake one inside its own
process (the model, the pool and the OS page cache would all still be warm), so it runs
a child interpreter. The child's working directory is the repository root, so it can
import ``tests.support`` like the tests do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import REPO_ROOT


def run_in_subprocess(code: str, timeout: float = 300, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``code`` in a fresh Python process (a real restart); it must print one JSON line last.

    ``env`` adds to this process's environment (e.g. another ``PYTHONHASHSEED``)."""
    full_env = {**os.environ, **env} if env else None
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, env=full_env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def continue_in_new_process(
    model: str, cache_dir: Path, agent_id: str, messages: list[dict], max_tokens: int
) -> dict[str, Any]:
    """A real restart: a new process restores ``agent_id`` from ``cache_dir`` and continues.

    Returns the next-token logits after ``messages`` and the greedy reply's token ids.
    """
    return continue_agents_in_new_process(model, cache_dir, [agent_id], messages, max_tokens)[agent_id]


def continue_agents_in_new_process(
    model: str, cache_dir: Path, agent_ids: list[str], messages: list[dict], max_tokens: int
) -> dict[str, dict[str, Any]]:
    """``continue_in_new_process`` for several agents, one after another, in one new process:
    one restart (an interpreter and a model load, seconds each) for all of them."""
    import numpy as np

    outs = {agent: cache_dir / f"{agent}-restored.npy" for agent in agent_ids}
    code = f"""
import json, numpy as np, kvshelf
from kvshelf.runtime.engine import Engine
e = Engine(model={model!r}, cache_dir={str(cache_dir)!r}, progress=False)
results = {{}}
for agent, out in {[(a, str(o)) for a, o in outs.items()]!r}:
    np.save(out, e.prefill(agent, {messages!r}))
    r = e.chat(agent, {messages!r}, max_tokens={max_tokens})
    results[agent] = {{"tokens": r.token_ids, "cache": r.cache, "cached": r.usage.cached_tokens}}
print(json.dumps(results))
"""
    results = run_in_subprocess(code)
    for agent, out in outs.items():
        results[agent]["logits"] = np.load(out)
    return results
