"""Running the app under uvicorn: in the foreground (``kvwire serve``) or on a thread (tests, benchmarks).

:class:`Background` binds its socket before uvicorn starts (port 0: a free port the
kernel picks, so nothing races for it) and stops uvicorn, and with it the service's
threads, on exit. Readiness is for the caller to check (``GET /health``).
"""

from __future__ import annotations

import logging
import socket
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .. import models
from ..errors import ServeError, reason
from ..store import check_store_url
from ..allocator import limit_arenas, trim_every
from .config import ServeConfig

if TYPE_CHECKING:
    from .service import Service

log = logging.getLogger(__name__)


def serve(config: ServeConfig) -> None:
    """Check the store URL, take the port, load the model, then serve until interrupted (SIGINT /
    SIGTERM stop it cleanly). A bad URL, a taken port or a missing model fail before anything is served."""
    if config.reuse:
        check_store_url(config.store)
    models.resolve(config.model)  # a missing model fails here, before torch is imported
    limit_arenas(config.malloc_arenas)  # before the model and the threads: RSS stays flat under load
    trim_every(config.malloc_trim_s)
    sock = listen(config.host, config.port)
    try:
        import uvicorn

        from .app import create_app
        from .scheduler import on_a_passing_thread
        from .service import Service

        service = on_a_passing_thread(Service.load, config)
        server = draining_server(uvicorn.Config(create_app(service), log_level="info", timeout_graceful_shutdown=5),
                                 service, config.shutdown_grace)
        log.info("listening on http://%s:%d/v1", *sock.getsockname()[:2])
        server.run(sockets=[sock])
    finally:
        sock.close()


def draining_server(config: Any, service: Service, grace_s: float = 30.0) -> Any:
    """A ``uvicorn.Server`` that, told to exit (SIGINT / SIGTERM), drains first: it keeps listening and
    answers new requests 503 with ``Retry-After``, lets the running ones finish for up to ``grace_s``,
    ends those still running with an error (a stream gets an error event, then ``[DONE]``) instead of
    cutting their connections silently, then stops -- and the process exits 0 (a stop asked for is not
    a failure). A second signal stops at once."""
    import uvicorn

    class Draining(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.draining or self.should_exit:  # asked twice: stop now
                service.scheduler.abort("the server is shutting down")
                self.should_exit = True
                return
            self.draining = True
            log.info("shutting down: new requests get 503, running ones have %g s to finish", grace_s)

            def drain() -> None:
                service.scheduler.drain(grace_s)
                self.should_exit = True  # (not uvicorn's handle_exit: it would re-raise the signal at exit)
            threading.Thread(target=drain, name="kvwire-drain", daemon=True).start()

    return Draining(config)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: any free port); :class:`ServeError` if it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {reason(err)}",
                         "pick another --port, or stop what listens there") from None
    return sock


class Background:
    """``service`` served on ``host`` from a thread: ``with Background(service) as server: server.url``.

    For figures, load the service as ``kvwire serve`` does, ``on_a_passing_thread(Service.load,
    config)``: a model loaded on a thread that lives on (the main thread) leaves an OpenMP pool
    beside the decoding thread's, which on a small machine slows every decode step (see
    :func:`~kvwire.serve.scheduler.on_a_passing_thread`). Outputs are the same either way.
    """

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from .app import create_app

        self.service = service
        self.sock = listen(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(create_app(service), log_level="warning", timeout_graceful_shutdown=2,
                                lifespan="on")
        self.server = draining_server(config, service)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="kvwire-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        """The base URL for the openai client (``.../v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Background:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        if self.thread.is_alive():
            log.warning("uvicorn did not stop within 60 s")
        self.sock.close()

    def __enter__(self) -> Background:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def from_config(config: ServeConfig) -> Background:
    """A background server for ``config`` (loads its model)."""
    from .service import Service

    return Background(Service.load(config), config.host, config.port)
