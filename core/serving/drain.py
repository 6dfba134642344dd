"""Draining on SIGTERM: how a node leaves a load balancer's pool without losing a turn.

A node behind HAProxy or nginx that is stopped (a deploy, a scale-down, Kubernetes'
SIGTERM) must not simply close its socket: the balancer would keep sending it agents
until its health check noticed. So on SIGTERM the node first *drains*, for
``drain_s`` seconds (``kvshelf serve --drain-seconds``):

* ``/health`` answers 503 at once, so the balancer's check (``inter 1s fall 2``) takes
  the node out of the pool within about two seconds;
* a request for an agent this node does not hold in RAM (a new agent, or one the
  balancer is moving here) is refused with 503 and ``Retry-After``, which HAProxy's
  ``retry-on 503`` with ``option redispatch`` (and the OpenAI clients' own retries)
  sends to another node; the node's own resident agents are still served;
* then the server stops as on any shutdown: it stops listening, lets the requests in
  flight finish (uvicorn's graceful timeout), and the engine's close flushes the
  write-behind saves and lets go of the store, so another node restores every agent
  from its latest record. The exit status is 0 once every turn is on disk.

SIGINT (Ctrl-C at a terminal) and a second SIGTERM skip the drain window.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)

DRAIN_S_DEFAULT = 3.0
"""Long enough for HAProxy's ``inter 1s fall 2`` (deploy/haproxy.cfg) to mark the node down."""
RETRY_AFTER_S = 1


class Drain:
    """Whether this node is draining, and since when (shared by the app and the server)."""

    def __init__(self) -> None:
        self.since: float | None = None

    @property
    def draining(self) -> bool:
        return self.since is not None

    def start(self) -> None:
        if self.since is None:
            self.since = time.monotonic()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain window between SIGTERM and the usual graceful stop."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_s: float) -> None:
        super().__init__(config)
        self.drain, self.drain_s = drain, drain_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.drain_s <= 0 or self.drain.draining or self.should_exit:
            self.drain.start()
            super().handle_exit(sig, frame)
            return
        self.drain.start()
        log.info("SIGTERM: draining for %.1f s (/health answers 503, no new agents), then stopping", self.drain_s)
        timer = threading.Timer(self.drain_s, self._drained)
        timer.daemon = True
        timer.start()

    def _drained(self) -> None:
        log.info("drain window over: finishing the requests in flight, then flushing saves")
        super().handle_exit(signal.SIGTERM, None)  # uvicorn's own stop, as if the signal came now
