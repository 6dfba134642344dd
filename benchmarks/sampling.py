"""Choosing a decode step's next tokens: kvshelf's samplers against mlx-lm's own.

A sampled request decodes through the default kernels, and every step each agent chooses
its token from logits over the whole vocabulary (Gemma 3: 262144). mlx-lm's samplers
(``mlx_lm.sample_utils.make_sampler``, what ``mlx_lm.generate`` and ``mlx_lm.server``
run: log-probabilities, then categorical sampling, top-p through a full argsort) run on
MLX's CPU ops, as kvshelf's did; kvshelf's now choose on numpy rows of the evaluated step
(``kvshelf.runtime.sampling``). Both are timed side by side, in interleaved rounds, on
real logits: the embedded model's at every position of a short prompt, so that the nucleus
has the sizes a real distribution gives it (printed). Per configuration (greedy, temperature
0.7, temperature 0.7 with top-p 0.9, temperature 1 with top-p 0.95) and batch (1 and 8
agents, each its own sampler and row), ms a step.

    python benchmarks/sampling.py [--repeats 15]

Run it alone (the exclusive benchmark lock).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import numpy as np
from common import interleaved_times, write_json
from mlx_lm.sample_utils import make_sampler

from kvshelf.model.loader import load
from kvshelf.runtime.sampling import Sampler, _nucleus

PROMPT = (
    "The committee met on Tuesday to review the quarterly figures. Revenue rose by four "
    "percent, while costs fell slightly, and the board asked the team to prepare"
)
CONFIGS = {
    "greedy": {"temperature": 0.0, "top_p": 1.0},
    "t0.7": {"temperature": 0.7, "top_p": 1.0},
    "t0.7 top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "t1 top-p 0.95": {"temperature": 1.0, "top_p": 0.95},
}
BATCHES = (1, 8)


def real_logits() -> mx.array:
    """(positions, vocab) fp32 logits of the embedded model over ``PROMPT``."""
    loaded = load("embedded", progress=False)
    ids = loaded.tokenizer.encode(PROMPT)
    logits = loaded.model(mx.array(ids)[None])[0].astype(mx.float32)
    mx.eval(logits)
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    load_start = list(os.getloadavg())
    logits = real_logits()
    positions = logits.shape[0]
    rows = np.asarray(logits)
    kernels: dict[str, Callable[[Any], Any]] = {}
    nucleus_sizes: dict[str, list[int]] = {}
    for name, cfg in CONFIGS.items():
        t, p = cfg["temperature"], cfg["top_p"]
        if t and p < 1:
            sizes = []
            for row in rows:
                z = row / np.float32(t)
                sizes.append(len(_nucleus(np.exp(z - z.max()), p)))
            nucleus_sizes[name] = sizes
        mine = [Sampler(temperature=t, top_p=p, seed=b) for b in range(max(BATCHES))]
        theirs = make_sampler(temp=t, top_p=p if p < 1 else 0.0)

        def kvshelf_step(batch: int, mine: list[Sampler] = mine) -> None:
            step = np.asarray(logits[:batch])  # the evaluated step's rows, as the scheduler reads them
            for b in range(batch):
                mine[b](step[b])

        def mlx_lm_step(batch: int, theirs: Callable[[mx.array], mx.array] = theirs) -> None:
            step = logits[:batch]
            logprobs = step - mx.logsumexp(step, axis=-1, keepdims=True)  # as mlx_lm.generate_step
            mx.eval(mx.stack([theirs(logprobs[b : b + 1]).reshape(()) for b in range(batch)]))

        kernels[f"kvshelf {name}"] = kvshelf_step
        kernels[f"mlx-lm {name}"] = mlx_lm_step
    times = interleaved_times(kernels, {b: b for b in BATCHES}, args.repeats)
    results = []
    for name in CONFIGS:
        for batch in BATCHES:
            mine_ms = statistics.median(times[(f"kvshelf {name}", batch)])
            theirs_ms = statistics.median(times[(f"mlx-lm {name}", batch)])
            results.append(
                {
                    "config": name,
                    "batch": batch,
                    "kvshelf_ms": round(mine_ms, 2),
                    "mlx_lm_ms": round(theirs_ms, 2),
                    "x_faster": round(theirs_ms / mine_ms, 1),
                }
            )
            print(
                f"{name:<16s} batch {batch}: kvshelf {mine_ms:7.2f} ms  mlx-lm {theirs_ms:7.2f} ms  "
                f"({theirs_ms / mine_ms:.1f}x)"
            )
    for name, sizes in nucleus_sizes.items():
        median, most = statistics.median(sizes), max(sizes)
        print(f"nucleus of {name} over the prompt's {positions} positions: median {median}, max {most}")
    load_end = list(os.getloadavg())
    print(f"load average at start {load_start}, at end {load_end}")
    path = write_json(
        "sampling",
        {
            "vocab": int(logits.shape[1]),
            "positions": positions,
            "repeats": args.repeats,
            "nucleus_sizes": nucleus_sizes,
            "rows": results,
            "load_average_at_start": load_start,
            "load_average_at_end": load_end,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
