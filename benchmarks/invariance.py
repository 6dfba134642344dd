"""Invariance: the same greedy reply whatever the cache did, and what it costs.

What it measures is in ``kvbench.invariance`` (also the Invariance section of
``kvshelf bench``).

    python benchmarks/invariance.py [--conversations 50] [--min-tokens 300] [--max-tokens 3000]
        [--generate 64] [--others 3] [--model embedded|llama30] [--kernels default,invariant]

``--kernels``: any of default (the engine's), blis (every projection through BLIS),
attention (``kvshelf.model.attention``), invariant (both: ``KVSHELF_SHAPE_INVARIANT``).
``--model llama30``: the 30-layer llama of ``benchmarks/decode.py`` (random weights, so
random token ids; its logits are close together, which makes it a harsh test).

The default is the issue's 50 conversations of 300 to 3,000 tokens (about an hour here);
a session runs a reduced size (e.g. ``--conversations 3 --max-tokens 1200``) and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
from common import RESULTS, write_json
from decode import build_model

from kvbench.invariance import measure
from kvshelf.model.gemv import with_fast_linears
from kvshelf.model.loader import load
from kvshelf.model.spec import ModelCacheSpec


@dataclass
class Bare:
    """A model without a tokenizer, as far as ``measure`` needs one."""

    model: Any
    spec: ModelCacheSpec
    forward: Any


def random_prompts(count: int, tokens: int, vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, tokens).tolist() for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--generate", type=int, default=64)
    ap.add_argument("--others", type=int, default=3)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--kernels", default="default,invariant", help="any of default, blis, attention, invariant")
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    loaded: Any
    prompts = None
    if args.model == "llama30":
        model = build_model("llama30")
        loaded = Bare(model, ModelCacheSpec.from_model(model), with_fast_linears(model))
        prompts = random_prompts(max(1, args.conversations) + args.others, args.max_tokens, model.args.vocab_size)
    else:
        loaded = load(args.model, progress=False)
    partial = RESULTS / f"invariance-partial-{time.strftime('%Y%m%d-%H%M%S')}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)

    def keep(rows: list) -> None:
        partial.write_text(json.dumps({"args": vars(args), "conversations": rows}, indent=2))

    out = measure(
        loaded,
        args.conversations,
        args.min_tokens,
        args.max_tokens,
        args.generate,
        args.others,
        log=lambda line: print(line, flush=True),
        kernels=tuple(args.kernels.split(",")),
        on_row=keep,
        prompts=prompts,
    )
    summary = out["summary"]
    print("cost:", summary["cost"], flush=True)
    print("summary:", {k: v for k, v in summary.items() if k != "cost"}, flush=True)
    path = write_json("invariance", {"args": vars(args), **out})
    partial.unlink(missing_ok=True)
    print(f"wrote {path}; load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
