"""moto's standalone S3 server for the S3 store's tests and benchmark.

moto is an emulator written in Python: it checks the protocol (conditional puts, ETags,
listing), not the speed or the consistency of a real service. The production targets are
real S3-compatible services (AWS S3, Cloudflare R2, MinIO, Ceph RGW)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def moto_server(timeout: float = 60) -> Iterator[str]:
    """Start ``python -m moto.server`` on a free local port; yield its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                raise RuntimeError("moto's server exited at start")
            try:
                urllib.request.urlopen(url, timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto's server did not come up") from None
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
