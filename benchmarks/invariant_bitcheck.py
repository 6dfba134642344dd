"""Fingerprints of the shape-invariant kernels' outputs: sha256 of every logit and cache array.

``LoadedModel.greedy_forward`` (each row of every projection its own sgemv, every attention
through ``kvshelf.model.attention``; until 2026-12-02 the rows went through BLIS, so
fingerprints taken before that differ by design) must compute the same bits whatever is done to make it
faster: the identity results of ``benchmarks/invariance.py`` hold only for the kernels
they ran on. This script runs a fixed set of inputs through ``greedy_forward`` and prints
one sha256 per case and one over all; run it against two checkouts and compare:

    PYTHONPATH=<checkout>/.typecheck python benchmarks/invariant_bitcheck.py \\
        [--models embedded,llama30,llama,gemma3_text] [--out FILE.json]

Cases per model: one prompt prefilled in chunks of 1 (across a 256-token block boundary),
7, 64 and 256 and in one call (each call's next-token logits, then every cache array);
then greedy decoding at batch 1, 3 and 8 of agents whose contexts cross the 256- and
512-token block boundaries while they decode (every step's logits, then every cache and
working-set array). The tiny llama/gemma3 models are those of ``tests/support/tiny.py``
(built from fixed seeds into ``--models-dir``); the 30-layer llama is
``benchmarks/decode.py``'s. Only public APIs that main 39ecc3c already had are used, so the
same script runs against it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import kvshelf  # noqa: F401  (preloads OpenBLAS, which must come before mlx)

# isort: split
import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kvshelf.kv.agent_cache import AgentCache  # noqa: E402
from kvshelf.kv.working_set import WorkingSets  # noqa: E402
from kvshelf.model.arrays import borrow  # noqa: E402
from kvshelf.model.head import prefill_logits  # noqa: E402
from kvshelf.model.loader import load  # noqa: E402
from kvshelf.model.spec import ModelCacheSpec  # noqa: E402


class Digest:
    """A sha256 over arrays (their dtype, shape and bytes in C order)."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.arrays = 0

    def add(self, *arrays: mx.array) -> None:
        mx.eval(*arrays)
        for a in arrays:
            self.h.update(f"{a.dtype}{a.shape}".encode())
            self.h.update(borrow(a).tobytes())
            self.arrays += 1

    def hex(self) -> str:
        return self.h.hexdigest()


def cut(n: int, chunk: int) -> list[int]:
    return [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])


def feed(forward: Any, cache: AgentCache, ids: list[int], plan: list[int], digest: Digest | None) -> mx.array:
    """Prefill ``ids`` in calls of ``plan``'s sizes; each call's logits into ``digest``."""
    assert sum(plan) == len(ids)
    out = None
    at = 0
    for n in plan:
        part = ids[at : at + n]
        at += n
        out = prefill_logits(forward, mx.array(part)[None], cache.layers, True)
        assert out is not None
        cache.tokens.extend(part)
        mx.eval(cache.arrays(), out)
        if digest is not None:
            digest.add(out)
    assert out is not None
    return out


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def prefill_cases(forward: Any, spec: ModelCacheSpec, vocab: int, length: int) -> dict[str, str]:
    ids = prompt(vocab, length, 1)
    plans = {
        "one call": [length],
        "chunk 256": cut(length, 256),
        "chunk 64": cut(length, 64),
        "chunk 7": cut(length, 7),
        # 1-token calls from 250 to 262: across the first 256-token block boundary
        "chunk 1 across 256": [250, *([1] * 12), *cut(length - 262, 256)],
    }
    out = {}
    for name, plan in plans.items():
        d, state = Digest(), Digest()
        cache = AgentCache.empty(spec)
        last = feed(forward, cache, ids, plan, d)
        d.add(*cache.arrays())
        state.add(last, *cache.arrays())
        out[f"prefill {name}"] = d.hex()
        # the last logits and the cache alone: the same for every plan (issue 21's invariance)
        out[f"prefill {name}, state"] = state.hex()
        print(f"  prefill {name}: {out[f'prefill {name}']} (state {state.hex()})", flush=True)
    return out


def decode_cases(forward: Any, spec: ModelCacheSpec, vocab: int, lengths: list[int], steps: int) -> dict[str, str]:
    """Greedy decode of ``len(lengths)`` agents together (contexts ``lengths`` at the start)."""
    out = {}
    for batch in (1, 3, 8):
        d = Digest()
        caches, tokens = [], []
        for b, n in enumerate(lengths[:batch]):
            cache = AgentCache.empty(spec)
            first = feed(forward, cache, prompt(vocab, n, 10 + b), cut(n, 256), d)
            caches.append(cache)
            tokens.append(int(np.argmax(np.array(first))))
        working = WorkingSets()
        for _ in range(steps):
            layers = working.caches(list(range(batch)), [c.layers for c in caches])
            logits = forward(mx.array([[t] for t in tokens]), cache=layers)[:, -1]
            mx.eval(logits, [a for c in caches for a in c.arrays()], working.arrays())
            d.add(logits)
            for b, c in enumerate(caches):
                c.tokens.append(tokens[b])
            tokens = [int(t) for t in np.argmax(np.array(logits), axis=-1)]
        for c in caches:
            d.add(*c.arrays())
        d.add(*working.arrays())
        out[f"decode batch {batch}"] = d.hex()
        print(f"  decode batch {batch}: {d.hex()}", flush=True)
    return out


def loaded_model(name: str, models_dir: Path) -> tuple[Any, Any, ModelCacheSpec, int]:
    """(model, greedy forward, spec, vocab)."""
    if name == "llama30":
        from decode import build_model

        from kvshelf.model.loader import LoadedModel, TextTokenizer
        from kvshelf.model.template import ChatMLTemplate

        model = build_model("llama30")
        tok = TextTokenizer(None)  # type: ignore[arg-type]  # never used: token ids only
        loaded = LoadedModel("llama30", model, tok, ChatMLTemplate(), "llama30")
    elif name == "embedded":
        loaded = load("embedded", progress=False)
    else:
        from tests.support.tiny import make_tiny_model_dir

        path = models_dir / name
        if not (path / "config.json").exists():
            make_tiny_model_dir(path, name)
        loaded = load(path, progress=False)
    return loaded.model, loaded.greedy_forward, loaded.spec, int(loaded.model.args.vocab_size)


# (prefill length, decode contexts at the start, decode steps) per model
SIZES = {
    "embedded": (300, [250, 508, 40, 255, 60, 90, 130, 20], 8),
    "llama30": (300, [250, 508, 40, 255, 60, 90, 130, 20], 8),
    "llama": (700, [250, 508, 40, 255, 300, 510, 130, 254], 10),
    "gemma3_text": (700, [250, 508, 40, 255, 300, 510, 130, 254], 10),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--models", default="llama,gemma3_text,llama30,embedded")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/kvshelf-bitcheck-models"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--part", choices=("prefill", "decode", "all"), default="all", help="which cases (to split a run)")
    args = ap.parse_args()
    print(f"kvshelf from {kvshelf.__file__}", flush=True)
    cases: dict[str, str] = {}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        model, forward, spec, vocab = loaded_model(name, args.models_dir)
        length, lengths, steps = SIZES[name]
        got = prefill_cases(forward, spec, vocab, length) if args.part != "decode" else {}
        print(f"{name}: prefill cases {time.perf_counter() - t0:.1f} s", flush=True)
        if args.part != "prefill":
            got.update(decode_cases(forward, spec, vocab, lengths, steps))
        for case, h in got.items():
            print(f"{name} {case}: {h}", flush=True)
            cases[f"{name} {case}"] = h
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        del model, forward
    total = hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(cases.items())).encode()).hexdigest()
    print(f"all: {total}")
    if args.out is not None:
        args.out.write_text(json.dumps({"kvshelf": kvshelf.__file__, "cases": cases, "all": total}, indent=2))


if __name__ == "__main__":
    main()
