"""kvshelf's server against ``mlx_lm.server`` (the tool a user would otherwise run), over HTTP.

Same model, same machine, same run, one server at a time. ``peer_agents`` agents each
hold a different document; they take turns (round-robin) with short questions, so the
conversations grow. Their caches together exceed the memory limit: kvshelf gets a
``--budget`` of ``peer_budget_fraction`` of their total Q4 bytes, and mlx_lm.server a
``--prompt-cache-size`` of as many caches as that budget holds for kvshelf (the
same number of agents; its caches are larger in bytes, so this favours the peer).
After a priming round and ``peer_rounds_before`` rounds both servers are stopped
(SIGTERM) and started again, kvshelf's records are dropped from the OS page cache,
and ``peer_rounds_after`` more rounds follow. The wall time counts every request and
the restart (stop + start until ``/health`` answers); the first start is reported apart.

Fairness: kvshelf computes in fp32 on the CPU (fp16 matmuls crawl there), so the peer
is given an fp32 copy of the weights when the model's are not fp32, and the same BLAS
(``LD_PRELOAD`` of the OpenBLAS kvshelf loads). Both generate greedily.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import mlx.core as mx

from kvbench.charts import bars, lines
from kvbench.common import documents, drop_from_page_cache
from kvbench.context import BenchContext
from kvbench.servers import ServerProcess, free_port, stream_chat

TITLE = "Against the peer: kvshelf serve vs mlx_lm.server, round-robin with a restart"
QUESTIONS = (
    "What is this document about?",
    "Name one rule it states.",
    "Quote its most important sentence.",
    "Which term does it define first?",
    "What would a beginner misread in it?",
    "Summarise it in one line.",
)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def model_dir(model: str) -> Path:
    if model == "embedded":
        from kvshelf.model.embedded import embedded_model_dir

        return Path(embedded_model_dir(progress=False))
    return Path(model).expanduser()


def _load_safetensors(path: Path) -> dict[str, mx.array]:
    arrays = mx.load(str(path))
    assert isinstance(arrays, dict)  # a .safetensors file loads as a dict of arrays (no metadata was asked for)
    return arrays


def peer_model_dir(source: Path, work: Path) -> tuple[Path, str]:
    """The model as the peer gets it: an fp32 copy on the CPU when the weights are not fp32.

    mlx_lm.server computes in the weights' dtype; on the CPU fp16 matmuls are many times
    slower than fp32 ones, and kvshelf computes in fp32 there. The copy gives the peer
    the same compute dtype (its KV cache is then fp32 too, twice fp16's bytes)."""
    files = sorted(source.glob("*.safetensors"))
    dtypes = {str(v.dtype) for f in files for v in _load_safetensors(f).values() if mx.issubdtype(v.dtype, mx.floating)}
    if mx.default_device() != mx.cpu or dtypes <= {"mlx.core.float32"}:
        return source, f"weights as stored ({', '.join(sorted(dtypes))})"
    target = work / "peer-model-fp32"
    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.suffix == ".safetensors":
            arrays = {
                k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
                for k, v in _load_safetensors(f).items()
            }
            mx.save_safetensors(str(target / f.name), arrays)
        elif f.name == "config.json":
            config = json.loads(f.read_text())
            config["torch_dtype"] = "float32"
            (target / f.name).write_text(json.dumps(config))
        elif f.is_file():
            shutil.copy(f, target / f.name)
    return target, f"fp32 copy of the {', '.join(sorted(dtypes))} weights"


def q4_bytes_estimate(engine, tokens: int) -> float:
    """Q4 bytes of one agent of ``tokens`` tokens (only used to size the budget)."""
    total = 0.0
    for layer in engine.loaded.spec.layers:
        kept = tokens if layer.window is None else min(tokens, layer.window + 2 * 256)
        total += engine.kv_scheme.bytes_per_token(layer, tokens) * kept
    return total


def scenario(
    server: ServerProcess, agents: list[tuple[str, str]], s, headers_for, before: int, after: int, on_restart
) -> dict:
    """Priming round, ``before`` rounds, restart, ``after`` rounds; every request timed."""
    startup = server.start(s.peer_startup_timeout_s)
    try:
        history = {
            aid: [
                {"role": "system", "content": "Answer from this document.\n\n" + doc},
                {"role": "user", "content": QUESTIONS[0]},
            ]
            for aid, doc in agents
        }
        requests, restart = [], {}
        with httpx.Client(timeout=None) as client:

            def round_(r: int, phase: str) -> None:
                for aid, _ in agents:
                    body = {
                        "model": "default_model",
                        "messages": history[aid],
                        "max_tokens": s.peer_max_tokens,
                        "temperature": 0.0,
                    }
                    res = stream_chat(client, server.url, body, headers_for(aid))
                    requests.append({"round": r, "phase": phase, "agent": aid, **res})
                    history[aid] = [
                        *history[aid],
                        {"role": "assistant", "content": res["text"] or "."},
                        {"role": "user", "content": QUESTIONS[(r + 1) % len(QUESTIONS)]},
                    ]
                print(
                    f"  peer {server.name} round {r} ({phase}): "
                    f"{sum(q['total_s'] for q in requests if q['round'] == r):.1f} s",
                    flush=True,
                )

            round_(0, "priming")
            for r in range(1, before + 1):
                round_(r, "before restart")
            restart["stop_s"] = server.stop()
            on_restart()
            restart["start_s"] = server.start(s.peer_startup_timeout_s)
            for r in range(before + 1, before + after + 1):
                round_(r, "after restart")
    finally:
        server.stop()  # also when the bench is interrupted: never leave a server behind
    wall = sum(q["total_s"] for q in requests) + restart["stop_s"] + restart["start_s"]
    return {"startup_s": startup, "restart": restart, "requests": requests, "wall_s": wall}


def vllm_mlx_server(exe: str, peer_dir: Path, work: Path, budget: int) -> tuple[ServerProcess, str]:
    """vllm-mlx as a second peer: its memory-aware prefix cache gets kvshelf's byte budget, and
    its SSD cache tier a directory, so that it too may keep agents across the restart."""
    from kvshelf.model import blas as _blas

    version = subprocess.run(
        [
            str(Path(exe).parent / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('vllm-mlx'), m.version('mlx-lm'))",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    port = free_port()
    cache_mb = max(1, budget // 2**20)
    cmd = [
        exe,
        "serve",
        str(peer_dir),
        "--served-model-name",
        "default_model",
        "--port",
        str(port),
        "--cache-memory-mb",
        str(cache_mb),
        "--ssd-cache-dir",
        str(work / "vllm-mlx-ssd"),
    ]
    proc = ServerProcess(
        "vllm-mlx",
        cmd,
        port,
        work / "vllm_mlx.log",
        env={"LD_PRELOAD": _blas.loaded_path} if _blas.loaded_path else None,
    )
    about = (
        f"vllm-mlx {version[0] if version else '?'} (its own mlx-lm {version[1] if len(version) > 1 else '?'}), "
        f"--cache-memory-mb {cache_mb} (kvshelf's budget) and --ssd-cache-dir (its disk tier)"
    )
    return proc, about


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    engine = ctx.get_engine()
    from kvshelf.model import blas as _blas

    work = ctx.work_dir / "peer"
    work.mkdir(parents=True, exist_ok=True)
    docs = documents(engine.loaded.tokenizer, s.peer_agents, s.peer_doc_tokens)
    agents = [(f"peer-agent-{i}", d) for i, d in enumerate(docs.values())]
    per_agent = q4_bytes_estimate(engine, s.peer_doc_tokens + 64 * (s.peer_rounds_before + s.peer_rounds_after + 1))
    budget = max(1, int(s.peer_budget_fraction * per_agent * len(agents)))
    peer_slots = max(1, int(budget // per_agent))
    source = model_dir(ctx.model)
    peer_dir, peer_weights = peer_model_dir(source, work)
    tok_config = source / "tokenizer_config.json"
    has_template = tok_config.exists() and "chat_template" in json.loads(tok_config.read_text())
    ctx.close()  # the servers load their own copies of the model

    cache_dir = work / "kvshelf-agents"
    port = free_port()
    ours = ServerProcess(
        "kvshelf",
        [
            sys.executable,
            "-m",
            "kvshelf.cli",
            "serve",
            "--model",
            ctx.model,
            "--cache-dir",
            str(cache_dir),
            "--budget",
            str(budget),
            "--port",
            str(port),
        ],
        port,
        work / "kvshelf.log",
    )
    peer_cmd = [
        sys.executable,
        "-m",
        "mlx_lm.server",
        "--model",
        str(peer_dir),
        "--log-level",
        "WARNING",
        "--prompt-cache-size",
        str(peer_slots),
        "--max-tokens",
        str(s.peer_max_tokens),
    ]
    if not has_template:
        peer_cmd += ["--chat-template", CHATML]
    port = free_port()
    peer = ServerProcess(
        "mlx_lm.server",
        [*peer_cmd, "--port", str(port)],
        port,
        work / "mlx_lm_server.log",
        env={"LD_PRELOAD": _blas.loaded_path} if _blas.loaded_path else None,
    )

    def drop_records() -> None:
        for f in cache_dir.rglob("*.safetensors"):
            drop_from_page_cache(f)

    runs = {
        "kvshelf serve": scenario(
            ours, agents, s, lambda aid: {"X-Agent-Id": aid}, s.peer_rounds_before, s.peer_rounds_after, drop_records
        )
    }
    record_bytes = sum(f.stat().st_size for f in cache_dir.rglob("*.safetensors"))
    runs["mlx_lm.server"] = scenario(
        peer, agents, s, lambda aid: {}, s.peer_rounds_before, s.peer_rounds_after, lambda: None
    )
    vllm_note = vllm_mlx_note(s.peer_vllm_mlx)
    if s.peer_vllm_mlx and Path(s.peer_vllm_mlx).exists():
        try:
            vllm, about = vllm_mlx_server(s.peer_vllm_mlx, peer_dir, work, budget)
            runs["vllm-mlx"] = scenario(
                vllm, agents, s, lambda aid: {}, s.peer_rounds_before, s.peer_rounds_after, lambda: None
            )
            vllm_note = f"ran as a second peer: {about}. " + os.environ.get("KVSHELF_BENCH_VLLM_MLX_NOTE", "")
        except Exception as exc:  # noqa: BLE001  (recorded in the report)
            vllm_note = f"could not be run here: {type(exc).__name__}: {str(exc)[-600:]}"

    rows = [summary(name, res) for name, res in runs.items()]
    for peer_row in rows[1:]:
        rows.append(
            {
                "server": f"kvshelf / {peer_row['server']}",
                **{k: rows[0][k] / peer_row[k] for k in rows[0] if k != "server" and rows[0][k] and peer_row[k]},
            }
        )
    ratio = rows[0]["wall_s_incl_restart"] / rows[1]["wall_s_incl_restart"]
    names = list(runs)
    per_request = []
    for i, reqs in enumerate(zip(*(runs[n]["requests"] for n in names))):
        row = {"request": i, "round": reqs[0]["round"], "phase": reqs[0]["phase"], "agent": reqs[0]["agent"]}
        row.update({f"{n} ttft_s": q["ttft_s"] for n, q in zip(names, reqs)})
        row.update({f"{n} total_s": q["total_s"] for n, q in zip(names, reqs)})
        per_request.append(row)
    print("  peer: " + ", ".join(f"{r['server']} {r['wall_s_incl_restart']:.2f}" for r in rows), flush=True)
    return {
        "title": TITLE,
        "table": rows,
        "per_request": per_request,
        "ratio_wall": ratio,
        "goal_ratio": 0.5,
        "extra_tables": {"Per-request TTFT and time (same request order on every server)": per_request},
        "budget_bytes": budget,
        "q4_bytes_per_agent_estimate": per_agent,
        "peer_prompt_cache_size": peer_slots,
        "kvshelf_record_bytes_total": record_bytes,
        "peer_weights": peer_weights,
        "servers": names,
        "raw": runs,
        "vllm_mlx": vllm_note,
        "description": (
            f"{len(agents)} agents, each with a different reference-manual topic (≤ {s.peer_doc_tokens} tokens) as "
            f"its system prompt; a priming round, {s.peer_rounds_before} round(s), a restart of the server, "
            f"{s.peer_rounds_after} round(s); {s.peer_max_tokens} tokens generated per request, greedy, streamed; "
            f"one server at a time. kvshelf: --budget {budget / 1e6:.1f} MB ({s.peer_budget_fraction:.0%} of the "
            f"agents' estimated Q4 bytes; its records total {record_bytes / 1e6:.1f} MB on disk at the end), records "
            f"dropped from the page cache at the restart. mlx_lm.server: --prompt-cache-size {peer_slots} (the number "
            f"of agents kvshelf's budget holds), {peer_weights} (kvshelf computes in fp32 on the CPU; the peer's KV is "
            f"then fp32 too), BLAS "
            f"{'preloaded: ' + _blas.loaded_path if _blas.loaded_path else 'as bundled'}. Wall time = all requests + "
            "the restart (stop + start until /health answers); the first start is shown apart. kvshelf / "
            f"mlx_lm.server wall-time ratio: {ratio:.2f} (goal ≤ 0.5). Per-request TTFTs are in the second table."
        ),
    }


def summary(name: str, res: dict) -> dict:
    reqs = res["requests"]

    def med(phase: str) -> float | None:
        xs = [q["ttft_s"] for q in reqs if q["phase"] == phase]
        return statistics.median(xs) if xs else None

    def total(phase: str) -> float:
        return sum(q["total_s"] for q in reqs if q["phase"] == phase)

    return {
        "server": name,
        "first_start_s": res["startup_s"],
        "priming_round_s": total("priming"),
        "rounds_before_restart_s": total("before restart"),
        "restart_s": res["restart"]["stop_s"] + res["restart"]["start_s"],
        "rounds_after_restart_s": total("after restart"),
        "wall_s_incl_restart": res["wall_s"],
        "ttft_median_priming_s": med("priming"),
        "ttft_median_before_restart_s": med("before restart"),
        "ttft_median_after_restart_s": med("after restart"),
    }


def vllm_mlx_note(exe: str) -> str:
    """Why vllm-mlx was not run (replaced by what ran when it did)."""
    if not exe:
        return os.environ.get(
            "KVSHELF_BENCH_VLLM_MLX_NOTE",
            "not run: set KVSHELF_BENCH_VLLM_MLX (or --set peer_vllm_mlx=PATH) to a vllm-mlx executable.",
        )
    if not Path(exe).exists():
        return f"not run: {exe} does not exist."
    return "not run."


def chart(result: dict, path: Path) -> list[Path]:
    names = result.get("servers") or [r["server"] for r in result["table"] if " / " not in r["server"]]
    rows = [r for r in result["table"] if r["server"] in names]
    keys = [
        ("priming_round_s", "priming round"),
        ("rounds_before_restart_s", "rounds before restart"),
        ("restart_s", "restart"),
        ("rounds_after_restart_s", "rounds after restart"),
        ("wall_s_incl_restart", "total (incl. restart)"),
    ]
    first = bars(
        path,
        "Wall time by phase",
        "seconds",
        [k[1] for k in keys],
        {r["server"]: [r[k[0]] for k in keys] for r in rows},
    )
    reqs = result["per_request"]
    xs = [q["request"] for q in reqs]
    series = {n: ([q[f"{n} ttft_s"] for q in reqs],) * 3 for n in names}
    second = lines(
        path.with_name(path.stem + "-requests.png"),
        "Per-request TTFT (restart before the last rounds)",
        "request (round-robin order)",
        "TTFT (s, log)",
        xs,
        series,
        logy=True,
    )
    return [first, second]


def headline(result: dict) -> str | None:
    r = result.get("ratio_wall")
    if r is None:
        return None
    rows = {x["server"]: x for x in result["table"]}
    ours, peer = rows["kvshelf serve"], rows["mlx_lm.server"]
    met = "met" if r <= result.get("goal_ratio", 0.5) else "NOT met"
    extra = ""
    if "vllm-mlx" in rows:
        extra = f"; vllm-mlx {rows['vllm-mlx']['wall_s_incl_restart']:.0f} s"
    return (
        f"Against the peer: kvshelf serve {ours['wall_s_incl_restart']:.0f} s vs mlx_lm.server "
        f"{peer['wall_s_incl_restart']:.0f} s including the restart{extra}: ratio {r:.2f} (goal ≤ 0.5: {met})."
    )
