"""An engine's compiled loops come from numba's cache: a child process compiles them first.

Why: numba's parallel fast-math loops (the default kernels' attention and products) round
otherwise in the process that compiled them than in every process that loads them from
numba's cache afterwards (``kvshelf.model.jit`` says how that was measured). An engine
that compiled its own loops, the first after an install or an upgrade, would give its
agents other last bits than the engine after a restart gives them once restored: above
temperature 0 the two could sample different tokens, and a restored agent would not
continue as it would have in RAM. So before the first engine for a model loads it, a
child process runs a short workload of that model (``python -m
kvshelf.runtime.loop_warmup MODEL``: agents decoding together and alone, at temperature 0
and above, a prompt over two prefill chunks, a second turn), which compiles every loop
variant the workload reaches and saves it to numba's cache. The engine then loads them,
as every later one does (``kvshelf.model.jit.compiled_here`` names any it compiled).

A stamp beside the loops (in ``$NUMBA_CACHE_DIR`` where that is set, else under
``$KVSHELF_HOME``) says that the child ran for this model, these sources of kvshelf, this
numba and this CPU, so later engines start without it. It costs the first engine what
compiling costs anyway (about a minute on two cores) and a few seconds more;
``KVSHELF_NO_LOOP_WARMUP=1`` skips it. Where the child fails (no disk space for the
cache, say), the engine goes on and compiles as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llvmlite.binding
import numba

import kvshelf
from kvshelf.paths import kvshelf_home
from kvshelf.switches import env_on

SKIP = "KVSHELF_NO_LOOP_WARMUP"
STAMPS = "kvshelf-compiled-loops"

log = logging.getLogger(__name__)


def stamp_path(model: str | Path, fingerprint: str) -> Path:
    """The stamp of a finished warm-up for ``model`` (whose ``fingerprint`` the loader
    gives) as things stand: any change to kvshelf's sources (which numba's cache also
    follows), numba or the CPU names another stamp, and another cache has its own."""
    digest = hashlib.sha256()
    for path in sorted(Path(kvshelf.__file__).parent.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_mtime_ns}\0{stat.st_size}\n".encode())
    cpu = llvmlite.binding.get_host_cpu_name()
    digest.update(f"{fingerprint}\0{numba.__version__}\0{sys.version}\0{cpu}".encode())
    cache = os.environ.get("NUMBA_CACHE_DIR")
    return (Path(cache) if cache else kvshelf_home()) / STAMPS / digest.hexdigest()[:32]


def compile_in_child(model: str | Path, fingerprint: str, progress: bool = True) -> bool:
    """Run the warm-up workload for ``model`` in a child process unless its stamp is there;
    whether the loops are now in numba's cache (False: skipped, or the child failed).
    ``progress`` says so on stderr when the child runs."""
    if env_on(SKIP):
        return False
    stamp = stamp_path(model, fingerprint)
    if stamp.exists():
        return True
    if progress:
        print("kvshelf: compiling kvshelf's loops for this model (once, about a minute)...", file=sys.stderr)
    env = dict(os.environ, **{SKIP: "1"})  # the child's own engine must not start another
    done = subprocess.run(
        [sys.executable, "-m", "kvshelf.runtime.loop_warmup", str(model)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        log.warning("compiling kvshelf's loops in a child process failed; compiling here:\n%s", done.stderr[-2000:])
        return False
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    except OSError as exc:  # the next engine runs the child again, which then only loads the loops
        log.warning("could not write %s (%s): the next engine will run the warm-up again", stamp, exc)
    return True


def workload(model: str) -> None:
    """What the child runs: every kind of call an engine's loops see, briefly. The loops'
    variants follow the batch (a product's block of 1, 2, 4 or 8 rows), so agents whose
    prompts are cached already (one prefilled, the others its forks) decode alone and in
    groups of 2, 4 and 8, at temperature 0 (its own kernels) and above."""
    from kvshelf.runtime.engine import Engine

    prompt = [{"role": "user", "content": "Name three things a cache is good for. " * 30}]  # two prefill chunks
    with tempfile.TemporaryDirectory() as store, Engine(model, cache_dir=store, progress=False) as engine:
        for temperature in (0.0, 0.7):
            agents = [f"warm-{temperature}-{i}" for i in range(8)]
            engine.prefill(agents[0], prompt)
            for agent in agents[1:]:  # the same cache, without prefilling it again
                engine.fork(agents[0], agent)
            for group in (1, 2, 4, 8):
                with ThreadPoolExecutor(group) as together:
                    turns = [
                        together.submit(engine.chat, a, prompt, max_tokens=6, temperature=temperature, seed=1)
                        for a in agents[:group]
                    ]
                    replies = [turn.result() for turn in turns]
            later = [*prompt, {"role": "assistant", "content": replies[0].text}, {"role": "user", "content": "More."}]
            engine.chat(agents[0], later, max_tokens=4, temperature=temperature, seed=1)


if __name__ == "__main__":
    workload(sys.argv[1])
