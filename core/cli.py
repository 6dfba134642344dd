"""The ``kvshelf`` command line: ``demo`` (the main job), ``serve``, ``bench``, ``convert`` and ``agents``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help="'embedded', an mlx-lm model dir, or a HF repo id")
    p.add_argument("--cache-dir", type=Path, default=None, help="where agent records live")
    p.add_argument("--budget", default=None, help="RAM budget for resident caches, e.g. 2GB")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option after it belongs to benchmarks/bench.py
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="kvshelf", description="Persistent per-agent Q4 KV caches on MLX")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a multi-agent round-table on the embedded model")
    _common(demo)
    demo.add_argument("--turns", type=int, default=3)
    demo.add_argument("--max-tokens", type=int, default=40)
    demo.add_argument("--fresh", action="store_true", help="forget the demo agents first")

    serve = sub.add_parser("serve", help="run an OpenAI-compatible HTTP server (needs kvshelf[server])")
    _common(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("KVSHELF_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $KVSHELF_API_KEY, which keeps the key out of the process list)",
    )

    bench = sub.add_parser(
        "bench",
        help="measure TTFT, capacity, quality, routing and the peer; write a report "
        "(runs benchmarks/bench.py from a source checkout; needs kvshelf[bench])",
        add_help=False,
    )
    bench.add_argument("options", nargs="*", help="see benchmarks/bench.py --help")

    sub.add_parser("convert", help="convert the embedded GGUF model now (it is otherwise done on first use)")

    agents = sub.add_parser("agents", help="list the agents with a cache")
    _common(agents)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    if args.command == "demo":
        from kvshelf.demo import run_demo

        run_demo(args.model, args.cache_dir, args.turns, args.max_tokens, args.budget, args.fresh)
    elif args.command == "serve":
        try:
            from kvshelf.serving.server import serve as run_server
        except ImportError as exc:
            print(f"kvshelf serve needs the server extra: pip install 'kvshelf[server]' ({exc})", file=sys.stderr)
            return 2
        from kvshelf.storage.exclusive import DirectoryInUse, StoreUnusable

        try:
            return run_server(
                args.model,
                cache_dir=args.cache_dir,
                budget=args.budget,
                host=args.host,
                port=args.port,
                api_key=args.api_key,
            )
        except (DirectoryInUse, StoreUnusable) as exc:  # refused before the model was loaded
            print(f"kvshelf serve: {exc}", file=sys.stderr)
            return 2
    elif args.command == "bench":
        return _bench(args.options)
    elif args.command == "convert":
        from kvshelf.model.embedded import embedded_model_dir

        print(embedded_model_dir(progress=True))
    elif args.command == "agents":
        from kvshelf.runtime.engine import Engine

        engine = Engine(args.model, args.cache_dir, args.budget)
        for a in engine.agents():
            print(f"{a.agent_id:<40s} {a.tokens or 0:7d} tokens  ram {a.ram_bytes:>10d} B  disk {a.disk_bytes:>10d} B")
    return 0


def _bench(options: list[str]) -> int:
    """The benchmarks live in the source tree, not in the installed runtime package."""
    import subprocess

    script = find_bench_script()
    if script is None:
        print(
            "kvshelf bench runs benchmarks/bench.py from a source checkout of kvshelf; "
            "run it from the checkout (pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(script), *options])


def find_bench_script() -> Path | None:
    """``benchmarks/bench.py`` of the checkout this package runs from, else of the current directory."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        script = root / "benchmarks" / "bench.py"
        if script.is_file():
            return script
    return None


if __name__ == "__main__":
    sys.exit(main())
