"""The BLAS candidates side by side: the system's OpenBLAS, the ``kvshelf[openblas]`` extra
and MLX's reference BLAS, each in a fresh process (the preload happens once, at import).

    python benchmarks/blas_candidates.py [--tokens 256] [--seconds 2] [--model embedded]

For each: which library MLX's ``cblas_sgemm`` resolves to (``blas_check.detect``), its
build (``openblas_get_config``), the fp32 matmul GFLOP/s that ``kvshelf doctor`` measures
(512x512, for ``--seconds``; then on one thread, to tell the kernels from the threading),
and a new agent's first-token time on a cold prompt of ``--tokens`` tokens (the embedded
model, a fresh store, ``max_tokens=1``). Against the floor: the prompt's projection FLOPs
(q/k/v/o and the MLP of every layer, 2 per weight per token) over the GFLOP/s just
measured; attention and everything else come on top. Prints a table and writes
``blas-candidates-<time>.json`` to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CANDIDATES = {
    "system OpenBLAS": {},
    "kvshelf[openblas]": {"KVSHELF_NO_SYSTEM_OPENBLAS": "1"},
    "kvshelf[openblas] 1 thread": {"KVSHELF_NO_SYSTEM_OPENBLAS": "1", "OPENBLAS_NUM_THREADS": "1"},
    "reference BLAS": {"KVSHELF_NO_OPENBLAS": "1"},
}

CHILD = """
import json, sys, tempfile, time
import kvshelf
from kvshelf import Engine
from kvshelf.model import blas, blas_check

model, tokens, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
info = blas_check.detect()
gflops = blas_check.measure_gflops(512, seconds)
one_thread = None
if blas.loaded_path:  # the same, on one thread: the kernels apart from the threading
    import ctypes
    lib, threads = ctypes.CDLL(blas.loaded_path), blas.openblas_threads()
    lib.openblas_set_num_threads(1)
    one_thread = round(blas_check.measure_gflops(512, seconds), 2)
    lib.openblas_set_num_threads(threads)
start = time.perf_counter()
store = tempfile.TemporaryDirectory()
engine = Engine(model=model, cache_dir=store.name)
load_s = time.perf_counter() - start
a = engine.loaded.model.args
q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
per_token = 2 * a.num_hidden_layers * (a.hidden_size * (2 * q + 2 * kv) + 3 * a.hidden_size * a.intermediate_size)
words = ("the council met at the old mill by the river to talk about the bridge " * 200).split()
ids = engine.loaded.tokenizer.encode(" ".join(words))
text = engine.loaded.tokenizer.decode(ids[:tokens])
r = engine.chat("first", [{"role": "user", "content": text}], max_tokens=1)
engine.close()
store.cleanup()
print(json.dumps({
    "blas": info.line(), "provider": info.path, "source": blas.loaded_source, "slow": info.slow,
    "build": blas.openblas_config(), "threads": blas.openblas_threads(),
    "gflops": round(gflops, 2), "gflops_1_thread": one_thread,
    "model_load_s": round(load_s, 2), "prompt_tokens": r.usage.prompt_tokens, "ttft_s": round(r.ttft_s, 3),
    "prefill_gflop": round(per_token * r.usage.prompt_tokens / 1e9, 2),
}))
"""


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="the cold prompt's length")
    parser.add_argument("--seconds", type=float, default=2.0, help="how long each GFLOP/s measurement runs")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    result: dict = {"load_start": loadavg(), "tokens": args.tokens, "model": args.model, "candidates": {}}
    unset = ("KVSHELF_NO_OPENBLAS", "KVSHELF_OPENBLAS", "OPENBLAS_NUM_THREADS")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    for name, env in CANDIDATES.items():
        done = subprocess.run(
            [sys.executable, "-c", CHILD, args.model, str(args.tokens), str(args.seconds)],
            capture_output=True,
            text=True,
            env={**base, **env},
            timeout=600,
        )
        if done.returncode != 0:
            result["candidates"][name] = {"error": done.stderr.strip().splitlines()[-1:]}
            continue
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        figures["floor_s"] = round(figures["prefill_gflop"] / figures["gflops"], 3)
        result["candidates"][name] = figures
    result["load_end"] = loadavg()
    print(f"load average at start {result['load_start']}, at end {result['load_end']}")
    print(f"{'candidate':<27s} {'GFLOP/s':>8s} {'1 thread':>8s} {'TTFT s':>8s} {'floor s':>8s}  library / build")
    for name, f in result["candidates"].items():
        if "error" in f:
            print(f"{name:<27s} error: {f['error']}")
            continue
        print(
            f"{name:<27s} {f['gflops']:8.1f} {f['gflops_1_thread'] or 0:8.1f} {f['ttft_s']:8.2f} {f['floor_s']:8.2f}  "
            f"{f['provider'] or 'bundled with mlx'} / {f['build'] or '-'}"
        )
    print(f"(first-token time of a new agent on a cold {args.tokens}-token prompt, {args.model} model)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"blas-candidates-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
