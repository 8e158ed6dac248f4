"""The server process's life: uvicorn with a drain on SIGTERM, an exit code that tells a
supervisor the engine died, and connections that cannot be held open by a slow client.

- **SIGTERM drains**: new requests get 503 ``draining`` (and ``/health`` says so), what is in
  flight runs on for up to ``--shutdown-timeout`` seconds, then what remains is ended with an
  error event in each stream, and the process exits 0. A second SIGTERM, or SIGINT, stops at
  once (uvicorn's own shutdown).
- **A dead engine ends the process** with exit code 1 once what was in flight has been told
  (every stream gets its error event), so that a supervisor restarts it, as vLLM does.
- **Slow clients**: a connection must deliver a whole request (headers and body) within
  ``--request-read-timeout`` seconds of opening or of its previous response, else it is
  closed (a slowloris holds no connection); an idle keep-alive connection is closed after
  ``--timeout-keep-alive`` seconds (uvicorn's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hlserve.errors import ServiceUnavailableError
from hlserve.server.runtime.bridge import EngineBridge

log = logging.getLogger("hlserve.server")

DEAD_ENGINE_EXIT_CODE = 1
FLUSH_S = 0.5  # after the last error events are handed out: time to write them
GRACEFUL_CLOSE_S = 5  # uvicorn's wait for connections once the drain is over


@dataclass(frozen=True)
class Lifecycle:
    shutdown_timeout_s: float = 30.0
    request_read_timeout_s: float | None = 60.0
    timeout_keep_alive_s: float = 5.0

    @classmethod
    def from_settings(cls, settings: Any) -> Lifecycle:
        names = {"shutdown_timeout_s", "request_read_timeout_s", "timeout_keep_alive_s"}
        return cls(**{n: getattr(settings, n) for n in names if hasattr(settings, n)})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for reading each request: armed when the
    connection opens and after each response, it closes the connection if by then the
    request's headers and body have not all arrived (h11's peer state is still IDLE or
    SEND_BODY). uvicorn alone waits forever for headers that trickle in."""

    read_timeout_s: float | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._arm_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None
        if self.read_timeout_s is not None and not self.transport.is_closing():
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        if self.conn.their_state is h11.IDLE and self.cycle is not None \
                and not self.cycle.response_complete:
            return  # a response is still being written (pipelining): not ours to cut
        log.info("closing a connection that did not send its request within %gs",
                 self.read_timeout_s)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()


def guarded_protocol(read_timeout_s: float | None) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout_s": read_timeout_s})


class HLServeServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM as a drain and the engine's death as exit code 1."""

    def __init__(self, config: uvicorn.Config, bridge: EngineBridge, life: Lifecycle) -> None:
        super().__init__(config)
        self.bridge = bridge
        self.life = life
        self.exit_code = 0
        self._drain_asked = False
        self._drain: asyncio.Task | None = None
        self._dead_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: only flags here, the work happens in on_tick on the loop
        if sig == signal.SIGTERM and not self._drain_asked and not self.should_exit:
            self._drain_asked = True  # not re-raised on exit (uvicorn would): we exit 0
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_asked and self._drain is None:
            self._drain = asyncio.ensure_future(self.drain())
        if self._dead_at is None and self.bridge.dead_reason is not None \
                and not self.bridge.draining:
            log.critical("the engine is dead (%s); exiting with code %d so that a supervisor "
                         "restarts the server", self.bridge.dead_reason, DEAD_ENGINE_EXIT_CODE)
            self.exit_code = DEAD_ENGINE_EXIT_CODE
            self._dead_at = time.monotonic()
        if self._dead_at is not None and time.monotonic() - self._dead_at >= FLUSH_S:
            self.should_exit = True
        return await super().on_tick(counter)

    async def drain(self) -> None:
        bridge, timeout = self.bridge, self.life.shutdown_timeout_s
        log.warning("SIGTERM: draining %d requests in flight (up to %gs), taking no new ones",
                    bridge.num_in_flight(), timeout)
        bridge.start_drain()
        deadline = time.monotonic() + timeout
        while bridge.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if left := bridge.num_in_flight():
            log.warning("shutdown timeout (%gs): ending %d requests still in flight", timeout, left)
            bridge.fail_all(ServiceUnavailableError(
                f"The server shut down before this request finished (--shutdown-timeout "
                f"{timeout:g}s)", code="server_shutdown"))
            end = time.monotonic() + 5
            while bridge.num_in_flight() and time.monotonic() < end:
                await asyncio.sleep(0.02)
        await asyncio.sleep(FLUSH_S)  # let the streams write their last events
        self.should_exit = True


def run_server(app: Any, bridge: EngineBridge, settings: Any) -> int:
    """Serve ``app`` until SIGTERM (drain, then 0), SIGINT (0) or the engine's death (1)."""
    life = Lifecycle.from_settings(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, access_log=settings.access_log,
                            timeout_graceful_shutdown=GRACEFUL_CLOSE_S, backlog=4096,
                            timeout_keep_alive=life.timeout_keep_alive_s,
                            http=guarded_protocol(life.request_read_timeout_s))
    server = HLServeServer(config, bridge, life)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return server.exit_code
