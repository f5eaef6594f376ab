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

import uvicorn

from .app import create_app
from .config import ServeConfig
from .service import Service

log = logging.getLogger(__name__)


def serve(config: ServeConfig) -> None:
    """Load the model and serve until interrupted (SIGINT / SIGTERM stop it cleanly)."""
    service = Service.load(config)
    uvicorn.run(create_app(service), host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=5)


class Background:
    """``service`` served on ``host`` from a thread: ``with Background(service) as server: server.url``."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0) -> None:
        self.service = service
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(create_app(service), log_level="warning", timeout_graceful_shutdown=2,
                                lifespan="on")
        self.server = uvicorn.Server(config)
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
    return Background(Service.load(config), config.host, config.port)
