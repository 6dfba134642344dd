"""A store of 100,000 agents (issue 22): what a turn, a save, a listing cost as the store grows.

For each store size, side by side in one run and on a tiny random-weight llama (so the
store's costs are not hidden behind the model's): the other agents' files are written
straight into the store (a small valid record and a lock file each, as a real agent
leaves), then a durable engine is opened on it and measures

- a save and a load of the agent in use, and the index upsert inside the save;
- a whole durable turn (prefill, 8 tokens, the save it waits for);
- one agent's metadata (``Engine.agent``, and ``GET /v1/agents/{id}`` over HTTP);
- a page of 100 agents from the index (``Engine.agents_page``, and over HTTP) against
  the alternative the index was chosen over: reading record headers lazily, page by
  page, from the files (a directory listing, sorted, then one header per agent);
- opening the engine, the index's reconcile pass, and a first full listing (every
  token count read from its record's header once).

At the largest size, chats are timed with and without a thread listing every agent
in a loop (the engine's index pages of 100 at its pace; the same unpaced; pages of 1,000
as it read them before; and the lazy header reads), to show what a listing costs
the decode thread. The floor for a save is the same save in an empty store.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TITLE = "Store scale: a turn, a save and a listing beside 100,000 agents"
_ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout: tiny models live with the tests


def _ms(samples: list[float]) -> float:
    return round(1e3 * statistics.median(samples), 3)


def _timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _checkout_on_path() -> None:
    if str(_ROOT) not in sys.path:
        sys.path.insert(0, str(_ROOT))


def tiny_model(work: Path) -> Path:
    _checkout_on_path()
    from tests.support.tiny import make_tiny_model_dir

    return make_tiny_model_dir(work / "tiny-llama", "llama")


def populate(directory: Path, fingerprint: str, count: int) -> float:
    """``count`` other agents' files: a small valid record (16 tokens) and a lock file each."""
    import mlx.core as mx

    from kvshelf.kv.record import CacheRecord
    from kvshelf.storage import codec

    t = time.perf_counter()
    record = CacheRecord(tokens=list(range(16)), tensors={"k": mx.arange(8, dtype=mx.uint32)}, meta={})
    for i in range(count):
        aid = f"agent-{i:06d}"
        data = b"".join(bytes(c) for c in codec.encode(record, aid, fingerprint))
        with open(directory / f"{aid}.safetensors", "wb") as f:
            f.write(data)
        with open(directory / f"{aid}.lock", "wb"):
            pass
    return time.perf_counter() - t


def lazy_page(store: Any, after: str | None, limit: int) -> list[tuple[str, int]]:
    """The alternative to the index: ids from a directory listing, then one header each."""
    from kvshelf.storage.records import RECORD_SUFFIX

    ids = sorted(
        e.name[: -len(RECORD_SUFFIX)]
        for e in os.scandir(store.directory)
        if e.name.endswith(RECORD_SUFFIX) and (after is None or e.name[: -len(RECORD_SUFFIX)] > after)
    )
    return [(a, store.token_count(a)) for a in ids[:limit]]


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Turn {i}: say something about rivers and the sea."}]


def open_size(model: Path, work: Path, count: int, repeats: int, rng: random.Random) -> tuple[dict, Any]:
    """One store size: populate it, open a durable engine on it, and measure what depends
    on that store alone (opening, listing, one agent). Returns its row and the engine,
    left open for the interleaved rounds of turns (``turns_side_by_side``)."""
    import httpx

    from kvshelf.runtime.engine import Engine
    from kvshelf.serving.server import create_app

    cache = work / f"store-{count}"
    first = Engine(model, cache, durable=True, progress=False)
    first.chat("me", messages(0), max_tokens=4)
    directory, fingerprint = first.store_dir, first.loaded.fingerprint
    first.close()
    made_s = populate(directory, fingerprint, count)
    os.sync()  # the other agents' files were written long ago, not just now: no dirty pages for a save's fsync

    t = time.perf_counter()
    engine = Engine(model, cache, durable=True, progress=False)
    open_s = time.perf_counter() - t
    store = engine._shelf.store
    index = store.open_index()
    assert index is not None
    t = time.perf_counter()
    index.wait_ready()
    reconcile_s = time.perf_counter() - t + open_s
    t = time.perf_counter()
    listed = len(engine.agents())
    first_walk_s = time.perf_counter() - t
    assert listed == count + 1, (listed, count)
    os.sync()  # that first listing filled the index's token counts: settle them on disk too

    someone = f"agent-{rng.randrange(count):06d}" if count else "me"
    get_one = _timed(lambda: engine.agent(someone), repeats)
    _checkout_on_path()
    from tests.support.servers import ServerThread

    server = ServerThread(create_app(engine, close_engine=False))  # a real uvicorn, over loopback
    client = httpx.Client(base_url=server.url, timeout=60)
    client.get("/health")
    get_http = _timed(lambda: client.get(f"/v1/agents/{someone}").raise_for_status(), repeats)
    cursors: list[str | None] = [None] + [f"agent-{rng.randrange(max(count, 1)):06d}" for _ in range(repeats - 1)]

    def one_page(after: str | None) -> float:
        t = time.perf_counter()
        engine.agents_page(limit=100, after=after)
        return time.perf_counter() - t

    def one_http_page(after: str | None) -> float:
        t = time.perf_counter()
        client.get("/v1/agents", params={"limit": 100, **({"after": after} if after else {})}).raise_for_status()
        return time.perf_counter() - t

    def one_lazy_page(after: str | None) -> float:
        t = time.perf_counter()
        lazy_page(store, after, 100)
        return time.perf_counter() - t

    pages = [one_page(c) for c in cursors]
    pages_http = [one_http_page(c) for c in cursors]
    lazy = [one_lazy_page(c) for c in cursors[: max(3, repeats // 3)]]
    client.close()
    server.stop()
    row_out = {
        "agents": count,
        "get_one_ms": _ms(get_one),
        "get_one_http_ms": _ms(get_http),
        "page100_ms": _ms(pages),
        "page100_http_ms": _ms(pages_http),
        "page100_lazy_ms": _ms(lazy),
        "engine_open_ms": round(1e3 * open_s, 1),  # model load included
        "index_ready_ms": round(1e3 * reconcile_s, 1),  # from the open
        "first_full_listing_s": round(first_walk_s, 3),
        "raw": {
            "page_s": pages,
            "lazy_page_s": lazy,
            "populate_s": made_s,
        },
    }
    return row_out, engine


def turns_side_by_side(engines: list[Any], repeats: int, rng: random.Random) -> list[dict]:
    """Saves, loads and whole durable turns of one agent per store, in rounds that visit
    every store in turn, in a new random order each round, so the machine's drift (other
    jobs, page cache) and a store's place in the round hit all alike."""
    from kvshelf.kv.record import agent_record
    from kvshelf.storage.agent_id import AgentId

    out = []
    for engine in engines:
        engine.chat("me", messages(1), max_tokens=4)  # resident again, a turn in
        cache = engine._shelf.pool.get(AgentId("me"))
        assert cache is not None
        index = engine._shelf.store.open_index()
        out.append(
            {"record": agent_record(cache), "row": index.get("me"), "turn": [], "save": [], "load": [], "upsert": []}
        )
    for i in range(repeats):
        for engine, got in rng.sample(list(zip(engines, out, strict=True)), len(engines)):
            store = engine._shelf.store
            got["save"] += _timed(lambda: store.save("me", got["record"]), 1)
            got["load"] += _timed(lambda: store.load("me"), 1)
            got["upsert"] += _timed(lambda: store.open_index().put(got["row"]), 1)
            t = time.perf_counter()
            result = engine.chat("me", messages(2 + i), max_tokens=8)
            got["turn"].append(time.perf_counter() - t)
            assert result.saved is True
    return [
        {
            "turn_ms": _ms(g["turn"]),
            "save_ms": _ms(g["save"]),
            "load_ms": _ms(g["load"]),
            "index_upsert_ms": _ms(g["upsert"]),
            "record_bytes": e._shelf.store.size_on_disk("me"),
            "raw": {"turn_s": g["turn"], "save_s": g["save"], "load_s": g["load"]},
        }
        for e, g in zip(engines, out, strict=True)
    ]


def overlap(engine: Any, repeats: int) -> dict:
    """Chats alone, and with a thread listing every agent in a loop, side by side: the
    engine's listing (``Engine.agents``: index pages of ``FULL_LISTING_PAGE``, paced to
    ``LISTING_SHARE_WHILE_BUSY`` while agents generate), the same unpaced (what the
    pacing buys), with pages of 1,000 (as ``Engine.agents`` read them before: a page's
    Python work holds the GIL ten times as long), and lazy header pages.
    In many short blocks whose order turns each time, so drift in the machine's load and
    a mode's place hit all alike; the ratios are of means (and, less sensitive to a
    stray slow chat, of medians) against the chats alone."""
    from kvshelf.runtime.engine import FULL_LISTING_PAGE
    from kvshelf.runtime.shelf import LISTING_SHARE_WHILE_BUSY

    store = engine._shelf.store
    rng = random.Random(1)
    ids = [a.agent_id for a in engine.agents_page(limit=1000).data]
    turn = [0]

    def chat() -> float:
        turn[0] += 1
        t = time.perf_counter()
        engine.chat("talker", messages(100 + turn[0]), max_tokens=16)
        return time.perf_counter() - t

    def index_pages(size: int, share: float) -> Callable[[threading.Event], None]:
        def walk(stop: threading.Event) -> None:
            engine._shelf.listing_share = share
            after = None
            try:
                while not stop.is_set():
                    page = engine.agents_page(limit=size, after=after)  # as Engine.agents() walks
                    after = page.last_id if page.has_more else None
            finally:
                engine._shelf.listing_share = LISTING_SHARE_WHILE_BUSY

        return walk

    def lazy_pages(stop: threading.Event) -> None:
        while not stop.is_set():
            lazy_page(store, rng.choice(ids), 100)

    modes: dict[str, Callable[[threading.Event], None] | None] = {
        "alone": None,
        "with_index_listing": index_pages(FULL_LISTING_PAGE, LISTING_SHARE_WHILE_BUSY),
        "with_index_listing_unpaced": index_pages(FULL_LISTING_PAGE, 1.0),
        "with_index_listing_pages_of_1000": index_pages(1000, LISTING_SHARE_WHILE_BUSY),
        "with_lazy_headers_listing": lazy_pages,
    }
    samples: dict[str, list[float]] = {m: [] for m in modes}
    chat()  # warm
    per_block, blocks = 3, max(4, (2 * repeats) // 3)
    order = list(modes)
    for b in range(blocks):
        for mode in order[b % len(order) :] + order[: b % len(order)]:
            lister = modes[mode]
            stop = threading.Event()
            thread = threading.Thread(target=lister, args=(stop,), daemon=True) if lister else None
            if thread:
                thread.start()
                time.sleep(0.05)  # the listing is under way before the chats start
            try:
                samples[mode] += [chat() for _ in range(per_block)]
            finally:
                stop.set()
                if thread:
                    thread.join()
    alone, alone_median = statistics.mean(samples["alone"]), statistics.median(samples["alone"])
    result: dict[str, Any] = {f"{m}_s": v for m, v in samples.items()}
    result["chats_per_mode"] = len(samples["alone"])
    for mode in modes:
        result[f"{mode}_ms"] = round(1e3 * statistics.mean(samples[mode]), 2)
        result[f"{mode}_median_ms"] = round(1e3 * statistics.median(samples[mode]), 2)
    for mode, key in [
        ("with_index_listing", "index"),
        ("with_index_listing_unpaced", "index_unpaced"),
        ("with_index_listing_pages_of_1000", "index_pages_of_1000"),
        ("with_lazy_headers_listing", "lazy_headers"),
    ]:
        result[f"{key}_ratio"] = round(statistics.mean(samples[mode]) / alone, 3)
        result[f"{key}_median_ratio"] = round(statistics.median(samples[mode]) / alone_median, 3)
    return result


def measure(sizes: list[int], repeats: int, work: Path, seed: int = 0) -> dict:
    from kvbench.machine import load_average

    rng = random.Random(seed)
    model = tiny_model(work)
    started = load_average()
    rows, engines = [], []
    try:
        for count in sizes:
            print(f"[store_scale] {count} agents ...", flush=True)
            row, engine = open_size(model, work, count, repeats, rng)
            rows.append(row)
            engines.append(engine)
        print("[store_scale] saves, loads and turns, side by side ...", flush=True)
        for row, turns in zip(rows, turns_side_by_side(engines, repeats, rng), strict=True):
            row["raw"] |= turns.pop("raw")
            row |= turns
        print(f"[store_scale] chats overlapping listings, {sizes[-1]} agents ...", flush=True)
        over = overlap(engines[-1], repeats) | {"agents": sizes[-1]}
    finally:
        for engine in engines:
            engine.close()
        for count in sizes:
            shutil.rmtree(work / f"store-{count}", ignore_errors=True)
    for row in rows:
        print(f"[store_scale] { ({k: v for k, v in row.items() if k != 'raw'}) }", flush=True)
    base = rows[0]["turn_ms"]
    for row in rows:
        row["turn_vs_empty"] = round(row["turn_ms"] / base, 3)
    return {
        "title": TITLE,
        "description": (__doc__ or "").strip().split("\n\n")[0],
        "table": [{k: v for k, v in r.items() if k != "raw"} for r in rows],
        "raw": [r["raw"] for r in rows],
        "overlap": over,
        "goals": {"turn_vs_empty_max": 1.2, "overlap_ratio_max": 1.1, "get_one_ms_max": 5.0},
        "load_average_start": started,
        "load_average_end": load_average(),
    }


# -- as a section of ``kvshelf bench`` -----------------------------------------------------------
def run(ctx: Any) -> dict:
    sizes = list(ctx.settings.store_sizes)
    return measure(sizes, ctx.settings.store_repeats, ctx.work_dir / "store-scale", ctx.settings.seed)


def headline(result: dict) -> str:
    last = result["table"][-1]
    over = result.get("overlap", {})
    return (
        f"Store scale: a durable turn beside {last['agents']:,} agents takes {last['turn_vs_empty']:.2f}× the turn "
        f"in an empty store (goal ≤ 1.2×); chats overlapping a full listing {over.get('index_ratio', 0):.2f}× "
        f"(goal ≤ 1.1×; with pages of 1,000: {over.get('index_pages_of_1000_ratio', 0):.2f}×); "
        f"one agent's metadata {last['get_one_http_ms']:.2f} ms over HTTP (goal ≤ 5 ms)"
    )


def chart(result: dict, path: Path) -> Path | None:
    from kvbench.charts import bars

    rows = result.get("table") or []
    if not rows:
        return None
    return bars(
        path,
        TITLE,
        "ms (median)",
        [f"{r['agents']:,}" for r in rows],
        {
            "durable turn": [r["turn_ms"] for r in rows],
            "save": [r["save_ms"] for r in rows],
            "page of 100 (index)": [r["page100_ms"] for r in rows],
            "page of 100 (lazy headers)": [r["page100_lazy_ms"] for r in rows],
        },
        logy=True,
    )
