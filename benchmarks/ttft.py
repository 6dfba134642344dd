"""Cold, warm (from disk) and hot (in RAM) time to first token on the embedded model.

For each prompt size and run, one agent:
1. cold: nothing cached; the whole prompt is prefilled;
2. warm: the agent is saved, dropped from RAM and from the OS page cache, then asked
   a follow-up (restore from disk + prefill of the ~16-token new suffix);
3. hot: the agent stays in RAM and is asked one more follow-up.

It also compares the Q4 record's size with an fp16 record of the same tokens, and the
restore time with file size / disk read bandwidth measured in the same run.

    python benchmarks/ttft.py [--sizes 1024 2048 4096 8192 16384] [--runs 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import (
    disk_read_bandwidth,
    drop_from_page_cache,
    median_range,
    prompt_of_tokens,
    write_json,
)

import mlx.core as mx
from kvshelf.agent_cache import AgentCache
from kvshelf.engine import Engine


def fp16_record_bytes(cache: AgentCache, directory: Path) -> int:
    """Size of a safetensors file holding the same kept tokens as fp16 K/V."""
    arrays = {}
    for i, c in enumerate(cache.layers):
        if c.keys is None:
            continue
        used = c.used
        arrays[f"l{i}.k"] = c._dequantize(tuple(x[..., :used, :] for x in c.keys), mx.float16)
        arrays[f"l{i}.v"] = c._dequantize(tuple(x[..., :used, :] for x in c.values), mx.float16)
    path = directory / "fp16.safetensors"
    mx.save_safetensors(str(path), arrays)
    size = path.stat().st_size
    path.unlink()
    return size


def follow_up(messages: list[dict], reply: str, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]


def run(sizes: list[int], runs: int, model: str) -> dict:
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        tmp_path = Path(tmp)
        engine = Engine(model=model, cache_dir=tmp_path / "agents")
        bandwidth = disk_read_bandwidth(tmp_path)
        print(f"disk read bandwidth {bandwidth / 1e6:.0f} MB/s")
        engine.chat(None, [{"role": "user", "content": "warm up"}], max_tokens=2)
        rows = []
        for n in sizes:
            cold, warm, hot, restore, sizes_q4, sizes_fp16 = [], [], [], [], [], []
            for r in range(runs):
                aid = f"ttft-{n}-{r}"
                msgs = [{"role": "user", "content": prompt_of_tokens(engine.tokenizer, n, salt=f"run {r}. ")}]
                c = engine.chat(aid, msgs, max_tokens=4)
                cold.append(c.ttft_s)
                msgs = follow_up(msgs, c.text, "Please summarise the section above in one short sentence.")
                engine.evict(aid)
                path = engine.store.path_for(aid)
                drop_from_page_cache(path)
                t = time.perf_counter()
                record = engine.store.load(aid)
                AgentCache.from_record_parts(engine.spec, record.tokens, record.tensors, record.meta)
                restore.append(time.perf_counter() - t)
                drop_from_page_cache(path)
                w = engine.chat(aid, msgs, max_tokens=4)
                assert w.cache == "warm", w.cache
                warm.append(w.ttft_s)
                msgs = follow_up(msgs, w.text, "Now name the single most important point in it.")
                h = engine.chat(aid, msgs, max_tokens=4)
                assert h.cache == "hot", h.cache
                hot.append(h.ttft_s)
                sizes_q4.append(engine.store.size_on_disk(aid))
                sizes_fp16.append(fp16_record_bytes(engine.pool.get(aid), tmp_path))
                engine.forget(aid)
                print(
                    f"{n:6d} tokens run {r}: cold {c.ttft_s:7.2f} s  warm {w.ttft_s:6.3f} s "
                    f"(+{w.usage.prompt_tokens - w.usage.cached_tokens} new)  hot {h.ttft_s:6.3f} s "
                    f"(+{h.usage.prompt_tokens - h.usage.cached_tokens} new)  record {sizes_q4[-1] / 1e6:.1f} MB",
                    flush=True,
                )
            q4, fp16 = sizes_q4[-1], sizes_fp16[-1]
            rows.append(
                {
                    "tokens": n,
                    "cold_s": median_range(cold),
                    "warm_s": median_range(warm),
                    "hot_s": median_range(hot),
                    "restore_s": median_range(restore),
                    "record_bytes_q4": q4,
                    "record_bytes_fp16": fp16,
                    "q4_over_fp16": q4 / fp16,
                    "restore_over_bandwidth_bound": median_range(restore)["median"] / (q4 / bandwidth),
                }
            )
        engine.close()
    return {"benchmark": "ttft", "model": model, "kv_scheme": engine.scheme.name,
            "disk_read_bytes_per_s": bandwidth, "rows": rows}


def table(result: dict) -> str:
    lines = [
        "| tokens | cold TTFT s | warm TTFT s | hot TTFT s | cold/warm | Q4 record MB | fp16 record MB | Q4/fp16 | restore ms | size/bandwidth ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    bw = result["disk_read_bytes_per_s"]
    for r in result["rows"]:
        c, w, h = r["cold_s"]["median"], r["warm_s"]["median"], r["hot_s"]["median"]
        lines.append(
            f"| {r['tokens']} | {c:.2f} | {w:.3f} | {h:.3f} | {c / w:.0f}x | {r['record_bytes_q4'] / 1e6:.1f} | "
            f"{r['record_bytes_fp16'] / 1e6:.1f} | {r['q4_over_fp16']:.3f} | {r['restore_s']['median'] * 1000:.0f} | "
            f"{r['record_bytes_q4'] / bw * 1000:.0f} |"
        )
    return "\n".join(lines)


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["tokens"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("cold_s", "cold (prefill)"), ("warm_s", "warm (from disk)"), ("hot_s", "hot (in RAM)")):
        med = [r[key]["median"] for r in result["rows"]]
        lo = [r[key]["median"] - r[key]["min"] for r in result["rows"]]
        hi = [r[key]["max"] - r[key]["median"] for r in result["rows"]]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("kvshelf TTFT on the embedded Gemma 3 270M")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default="embedded")
    args = parser.parse_args()
    result = run(args.sizes, args.runs, args.model)
    path = write_json("ttft", result)
    chart(result, path.with_suffix(".png"))
    print(table(result))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
