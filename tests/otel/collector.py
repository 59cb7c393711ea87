"""A real OpenTelemetry collector for end-to-end tests: the ``rotel`` agent from PyPI.

The agent is a separate process that receives OTLP over HTTP and gRPC on 127.0.0.1. Its
exporter is the blackhole; what it received is handed to ``rotel_processor.py``, a Python
span (and metric) processor run inside the agent, which appends each span as a JSON line to
a file the test reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.gateway.harness import closed_port
from tests.helpers import eventually


def _agent() -> Path:
    # The binary ships inside the ``rotel`` package (a dev dependency); no need to import it.
    spec = importlib.util.find_spec("rotel")
    assert spec is not None and spec.origin, "the rotel package is not installed"
    return Path(spec.origin).resolve().parent / "rotel-agent"


AGENT = _agent()
PROCESSOR = Path(__file__).resolve().with_name("rotel_processor.py")

Span = dict[str, Any]


def _accepts(port: int) -> bool:
    with (
        contextlib.suppress(OSError),
        socket.create_connection(("127.0.0.1", port), timeout=0.2),
    ):
        return True
    return False


class Collector:
    def __init__(self, directory: Path, http_port: int | None = None) -> None:
        self.directory = directory
        self.http_port = http_port or closed_port()
        self.grpc_port = closed_port()
        self.spans_file = directory / "spans.jsonl"
        self._process: asyncio.subprocess.Process | None = None

    @property
    def endpoint(self) -> str:
        """The base URL for ``OTEL_EXPORTER_OTLP_ENDPOINT`` (OTLP/HTTP)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_endpoint(self) -> str:
        """The endpoint for ``OTEL_EXPORTER_OTLP_ENDPOINT`` with ``..._PROTOCOL=grpc``."""
        return f"http://127.0.0.1:{self.grpc_port}"

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "ROTEL_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{self.http_port}",
            "ROTEL_OTLP_GRPC_ENDPOINT": f"127.0.0.1:{self.grpc_port}",
            "ROTEL_EXPORTER": "blackhole",
            "ROTEL_OTLP_WITH_TRACE_PROCESSOR": str(PROCESSOR),
            "ROTEL_OTLP_WITH_METRICS_PROCESSOR": str(PROCESSOR),
            "ROTEL_BATCH_TIMEOUT": "10ms",
            "ROTEL_PID_FILE": str(self.directory / "rotel.pid"),
            "ROTEL_LOG_FILE": str(self.directory / "rotel.log"),
            "WAYBILL_TEST_SPANS_FILE": str(self.spans_file),
        }
        log = (self.directory / "rotel.out").open("ab")
        self._process = await asyncio.create_subprocess_exec(
            str(AGENT), "start", env=env, stdout=log, stderr=log
        )
        log.close()

        async def listening() -> bool:
            assert self._process is not None
            if self._process.returncode is not None:
                output = (self.directory / "rotel.out").read_text(errors="replace")
                raise RuntimeError(f"rotel exited with {self._process.returncode}: {output}")
            return all(map(_accepts, (self.http_port, self.grpc_port)))

        await eventually(listening, within_s=15, interval=0.05)

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            async with asyncio.timeout(10):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()

    async def __aenter__(self) -> Collector:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _lines(self, path: Path) -> list[dict[str, Any]]:
        if not path.exists():
            return []
        text = path.read_text(encoding="utf-8")
        complete = text[: text.rfind("\n") + 1]  # a line being written is not read yet
        return [json.loads(line) for line in complete.splitlines() if line]

    def spans(self) -> list[Span]:
        return self._lines(self.spans_file)

    def metric_names(self) -> set[str]:
        return {m["name"] for m in self._lines(Path(f"{self.spans_file}.metrics"))}

    def spans_of(self, request_id: str) -> list[Span]:
        return [s for s in self.spans() if s["attributes"].get("waybill.request_id") == request_id]

    async def wait_for_request(
        self, request_id: str, count: int, within_s: float = 20
    ) -> list[Span]:
        """The spans of ``request_id`` once ``count`` of them have arrived."""

        async def arrived() -> bool:
            return len(self.spans_of(request_id)) >= count

        await eventually(arrived, within_s=within_s, interval=0.05)
        return self.spans_of(request_id)

    async def wait_until(self, check: Callable[[Collector], bool], within_s: float = 20) -> None:
        async def done() -> bool:
            return check(self)

        await eventually(done, within_s=within_s, interval=0.05)
