"""The server in a thread of this process (tests, benchmarks, notebooks): uvicorn on a free
port of 127.0.0.1, stopped gracefully (requests in flight finish) on exit."""

from __future__ import annotations

import threading
from types import TracebackType

import uvicorn
from starlette.applications import Starlette

STARTUP_TIMEOUT_S = 60.0


class ServerThread:
    """``with ServerThread(app) as server: ... server.url ...``"""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=60)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="ov_kvcrush-server", daemon=True)
        self._ready = threading.Event()

    def __enter__(self) -> ServerThread:
        original = self.server.startup

        async def startup(sockets=None) -> None:  # type: ignore[no-untyped-def]
            await original(sockets)
            self._ready.set()

        self.server.startup = startup  # type: ignore[method-assign]
        self.thread.start()
        if not self._ready.wait(STARTUP_TIMEOUT_S) or not self.server.started:
            raise RuntimeError("the server did not start")
        return self

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.should_exit = True
        self.thread.join()
