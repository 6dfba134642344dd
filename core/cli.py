"""The ``kvshelf`` command line: ``demo`` (the main job), ``serve``, ``bench``, ``doctor``,
``convert`` and ``agents``.

``demo``, ``serve`` and ``bench`` say at start which BLAS MLX's CPU matmuls use, with a
loud warning and the fix when it is the slow reference BLAS (``kvshelf.model.blas_check``);
``doctor`` measures it. Every option's default is shown in ``--help``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from kvshelf.ctrl_c import from_ctrl_c, on_ctrl_c, quiet_lost_ctrl_c

LOG_LEVELS = ("debug", "info", "warning", "error")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, without "(default: None)" on options whose absence means something."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is argparse.SUPPRESS or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("kvshelf")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        from kvshelf import __version__

        return __version__


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help="'embedded', an mlx-lm model dir, or a HF repo id")
    p.add_argument(
        "--cache-dir", type=Path, default=None, help="where agent records live (default: $KVSHELF_HOME/agents)"
    )
    p.add_argument("--budget", default=None, help="RAM budget for resident caches, e.g. 2GB (default: no limit)")


# ``kvshelf.runtime.anonymous.MAX_ENTRIES``, which this module does not import (it loads
# MLX, and ``--help`` should not); tests/test_cli.py checks that the two agree.
ANONYMOUS_PREFIXES = 8


def _count(text: str) -> int:
    """An argument that counts something: a whole number, 0 or more."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number, 0 or more, not {text!r}")
    return n


def _log_level(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--log-level", choices=LOG_LEVELS, default=default, help="what kvshelf (and uvicorn) log to stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshelf", description="Persistent per-agent Q4 KV caches on MLX", formatter_class=_Help
    )
    parser.add_argument("--version", action="version", version=f"kvshelf {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a multi-agent round-table on the embedded model", formatter_class=_Help)
    _common(demo)
    demo.add_argument("--turns", type=int, default=2, help="rounds; every agent speaks once a round")
    demo.add_argument("--max-tokens", type=int, default=48, help="longest reply, in tokens")
    demo.add_argument("--fresh", action="store_true", help="forget the demo agents first")
    _log_level(demo, "warning")

    serve = sub.add_parser(
        "serve", help="run an OpenAI-compatible HTTP server (needs kvshelf[server])", formatter_class=_Help
    )
    _common(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback only unless told otherwise)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("KVSHELF_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $KVSHELF_API_KEY, which keeps the key out of the process list)",
    )
    serve.add_argument(
        "--drain-seconds",
        type=float,
        default=3.0,
        help="on SIGTERM, answer /health with 503 and refuse new agents this long before stopping, "
        "so a load balancer moves them first (0: stop at once)",
    )
    serve.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="where agent records live: a directory, file:///dir or s3://bucket/prefix "
        "(credentials and endpoint from AWS_*; for s3, --cache-dir is the local read-through cache)",
    )
    serve.add_argument(
        "--shared",
        action="store_true",
        help="other kvshelf serve nodes use the same store at once: each agent has one writer at a time, "
        "enforced by the store (without it, a second server on a store is refused)",
    )
    serve.add_argument(
        "--node-id",
        default=None,
        metavar="NAME",
        help="this node's name in the records it writes and in X-KVShelf-Node (default with --shared: the host name)",
    )
    serve.add_argument(
        "--anonymous-prefixes",
        type=_count,
        default=ANONYMOUS_PREFIXES,
        metavar="N",
        help="requests that name no agent: keep the caches of the last N in RAM, reused where a new prompt "
        "starts with the same tokens (0: every such request starts cold)",
    )
    _log_level(serve, "info")

    bench = sub.add_parser(
        "bench",
        help="measure TTFT, capacity, quality, routing and the peer; write a report "
        "(runs benchmarks/bench.py from a source checkout; needs kvshelf[bench])",
        add_help=False,
    )
    bench.add_argument("options", nargs="*", help="see benchmarks/bench.py --help")

    doctor = sub.add_parser(
        "doctor",
        help="report the BLAS and its GFLOP/s, the MLX device, the model cache and the store",
        formatter_class=_Help,
    )
    doctor.add_argument(
        "--cache-dir", type=Path, default=None, help="the store to report (default: $KVSHELF_HOME/agents)"
    )

    sub.add_parser("convert", help="convert the embedded GGUF model now (it is otherwise done on first use)")

    agents = sub.add_parser("agents", help="list the agents with a cache", formatter_class=_Help)
    _common(agents)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every option after it belongs to benchmarks/bench.py
        return _bench(argv[1:])
    if argv[:1] == ["demo"]:
        return _demo_with_ctrl_c(argv)
    return _command(argv)


def _command(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "warning")
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")

    if args.command == "demo":
        return _demo(args)
    if args.command == "serve":
        try:
            from kvshelf.serving.server import serve as run_server
        except ImportError as exc:
            print(f"kvshelf serve needs the server extra: pip install 'kvshelf[server]' ({exc})", file=sys.stderr)
            return 2
        from kvshelf.storage.exclusive import DirectoryInUse, StoreUnusable
        from kvshelf.storage.location import parse_store, validate_node_id

        try:
            if args.store is not None and parse_store(args.store).path is not None and args.cache_dir is not None:
                raise ValueError("give a directory as --store or as --cache-dir, not both")
            if args.node_id is not None:
                validate_node_id(args.node_id)
        except ValueError as exc:
            print(f"kvshelf serve: {exc}", file=sys.stderr)
            return 2
        try:  # serve prints the BLAS line once the store is claimed: a refused start is one line
            return run_server(
                args.model,
                cache_dir=args.cache_dir,
                budget=args.budget,
                host=args.host,
                port=args.port,
                api_key=args.api_key,
                log_level=level,
                drain_s=args.drain_seconds,
                store=args.store,
                shared=args.shared,
                node_id=args.node_id,
                anonymous_prefixes=args.anonymous_prefixes,
            )
        except (DirectoryInUse, StoreUnusable) as exc:  # refused before the model was loaded
            print(f"kvshelf serve: {exc}", file=sys.stderr)
            return 2
    elif args.command == "bench":
        return _bench(args.options)
    elif args.command == "doctor":
        from kvshelf.doctor import run_doctor

        return run_doctor(args.cache_dir)
    elif args.command == "convert":
        from kvshelf.model.embedded import embedded_model_dir

        print(embedded_model_dir(progress=True))
    elif args.command == "agents":
        from kvshelf.runtime.engine import Engine

        engine = Engine(args.model, args.cache_dir, args.budget)
        for a in engine.agents():
            print(f"{a.agent_id:<40s} {a.tokens or 0:7d} tokens  ram {a.ram_bytes:>10d} B  disk {a.disk_bytes:>10d} B")
    return 0


def _announce_blas() -> None:
    from kvshelf.model.blas_check import announce

    announce()


def _demo_with_ctrl_c(argv: list[str]) -> int:
    """``kvshelf demo``: Ctrl-C at any moment (parsing, imports, the model's load, a reply,
    the stop) ends it with status 130 and no traceback; the demo has saved first.

    The demo takes SIGINT itself, first thing: a process started with SIGINT ignored (what a
    shell does to a command it runs in the background, or a CI runner) would otherwise keep
    ignoring it, and a Ctrl-C sent to it would never stop it. Once interrupted, any exception
    that comes out (a library may turn the KeyboardInterrupt into another one on its way up)
    ends it the same way. The process then leaves at once (``os._exit``): its engine is
    closed, and the interpreter's teardown of MLX, transformers and their threads takes a
    third of a second more, for nothing."""
    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        signal.signal(signal.SIGINT, on_ctrl_c)
        sys.unraisablehook = quiet_lost_ctrl_c
    try:
        return _command(argv)
    except BaseException as exc:
        if not from_ctrl_c(exc):
            raise
        print("kvshelf demo: interrupted", file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


def _demo(args: argparse.Namespace) -> int:
    """Run the demo (Ctrl-C: see ``_demo_with_ctrl_c``)."""
    _announce_blas()
    from kvshelf.demo import run_demo

    run_demo(args.model, args.cache_dir, args.turns, args.max_tokens, args.budget, args.fresh)
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
    if not {"-h", "--help"} & set(options):
        _announce_blas()  # the child process preloads the same BLAS as this one (same environment)
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
