"""What a shared store costs per turn: the version check before a RAM copy is reused, a
conditional save, and a load, on a shared directory and on an S3 server (issue 20).

Side by side in one run, for one record of ``--mb`` megabytes: ``is_current`` (a ``stat``
on a directory, a HEAD on S3), a conditional save (``If-Match`` on S3), a load whose
local copy is current (a 304 and a local read on S3) and a load by a node with no copy
(the whole object). The S3 side is moto's standalone server, started here on a loopback
port: an emulator in Python, so its figures are an upper bound on the client's cost, not
a measure of any real service. Transfer rates are printed beside the bytes moved.

    python benchmarks/shared_store.py [--mb 8] [--repeats 30]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the emulator harness lives with the tests

from common import write_json  # noqa: E402

from kvshelf.kv.record import CacheRecord  # noqa: E402
from kvshelf.storage.location import open_store  # noqa: E402
from kvshelf.storage.records import RecordStore  # noqa: E402
from tests.support.s3 import moto_server  # noqa: E402

FINGERPRINT = hashlib.sha256(b"shared-store-bench").hexdigest()


def record_of(mb: float) -> CacheRecord:
    words = int(mb * 2**20 / 4)
    return CacheRecord(tokens=list(range(1024)), tensors={"l0.k.w": mx.random.randint(0, 2**31, (words,), mx.uint32)})


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 3)


def measure(store: RecordStore, fresh: Callable[[str], RecordStore], record: CacheRecord, repeats: int) -> dict:
    size = store.save("bench", record)
    times = {
        "is_current_ms": median_ms(lambda: store.is_current("bench"), repeats * 10),
        "save_ms": median_ms(lambda: store.save("bench", record), repeats),
        "load_current_copy_ms": median_ms(lambda: store.load("bench"), repeats),
        "load_without_copy_ms": median_ms(lambda: fresh(f"n{time.perf_counter_ns()}").load("bench"), repeats),
    }
    moved = [k for k in times if k != "is_current_ms"]
    rates = {k.replace("_ms", "_MB_per_s"): round(size / 2**20 / (times[k] / 1000), 1) for k in moved}
    return {"record_bytes": size, **times, **rates, "counters": store.counters.snapshot()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    record = record_of(args.mb)
    load_start = os.getloadavg()
    out: dict = {"mb": args.mb, "repeats": args.repeats}
    with tempfile.TemporaryDirectory(prefix="kvshelf-shared-", dir=Path.home()) as work:
        root = Path(work)

        def directory(name: str) -> RecordStore:
            return open_store(root / "dir", FINGERPRINT, shared=True, node_id=name)

        out["directory"] = measure(directory("a"), directory, record, args.repeats)
        with moto_server() as endpoint:
            os.environ.update(
                AWS_ENDPOINT_URL=endpoint,
                AWS_ALLOW_HTTP="true",
                AWS_ACCESS_KEY_ID="bench",
                AWS_SECRET_ACCESS_KEY="bench",
                AWS_REGION="us-east-1",
            )
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/bench", method="PUT"), timeout=10).read()

            def bucket(name: str) -> RecordStore:
                return open_store("s3://bench/p", FINGERPRINT, shared=True, node_id=name, cache_dir=root / name)

            out["s3_emulator"] = measure(bucket("a"), bucket, record, args.repeats)
    out["loadavg_start"], out["loadavg_end"] = [round(x, 2) for x in load_start], [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=1))
    print(write_json("shared_store", out))


if __name__ == "__main__":
    main()
