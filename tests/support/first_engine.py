"""An engine's first decode steps in a process of their own, for ``tests/test_loop_warmup.py``:
which of kvshelf's loops that process compiled itself, and the bits its agents got."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# An engine starts on the embedded model (its loops compiled by a child, unless
# KVSHELF_NO_LOOP_WARMUP is set), then agents decode as its scheduler runs them: their
# prompts prefilled (about 720 tokens: a difference showed over hundreds of columns, not
# over a dozen), then four default-kernel steps together (a decode working set), alone, two
# and four at a time. The steps are made here, not by the scheduler, whose batches
# depend on when each request came (and the default kernels' bits on the batch).
AGENTS = """
import hashlib, json, tempfile
import kvshelf
import mlx.core as mx
import numpy as np
from kvshelf import Engine
from kvshelf.kv.agent_cache import AgentCache
from kvshelf.kv.working_set import WorkingSets
from kvshelf.model import jit
from kvshelf.model.head import prefill_logits

with tempfile.TemporaryDirectory() as store:
    engine = Engine("embedded", cache_dir=store, progress=False)
    loaded, scheme = engine.loaded, engine.kv_scheme
    engine.close()
prompt = loaded.tokenizer.encode("Write a short note about shelves and caches for every agent. " * 60)
digest = hashlib.sha256()
for batch in (1, 2, 4):
    agents = []
    for i in range(batch):
        cache = AgentCache.empty(loaded.spec, scheme)
        prefill_logits(loaded.forward, mx.array([prompt + [100 + i]]), cache.layers, want=False)
        mx.eval([a for c in cache.layers for a in c.arrays()])
        agents.append(cache.layers)
    working, tokens = WorkingSets(), mx.array([[7 + i] for i in range(batch)])
    for _ in range(4):
        logits = loaded.forward(tokens, cache=working.caches(list(range(batch)), agents))[:, -1]
        mx.eval(logits, working.arrays(), [a for layers in agents for c in layers for a in c.arrays()])
        rows = np.asarray(logits)
        digest.update(rows.tobytes())
        tokens = mx.array(rows.argmax(axis=-1)[:, None])
print(json.dumps({"compiled": jit.compiled_here(), "logits": digest.hexdigest()}))
"""


def agents_in_a_process(numba_cache: Path, **env: str) -> dict[str, Any]:
    """Run ``AGENTS`` in a new process over this numba cache; what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", AGENTS],
        env={**os.environ, "NUMBA_CACHE_DIR": str(numba_cache), **env},
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])
