"""FakeAdminApi: the providers' usage and cost report endpoints, over real HTTP on 127.0.0.1.

It serves OpenAI ``GET /v1/organization/usage/completions``, ``/usage/embeddings`` (its
buckets under ``openai-embeddings-usage``) and ``/v1/organization/costs``
and Anthropic ``GET /v1/organizations/usage_report/messages`` and
``/v1/organizations/cost_report`` (legacy) from buckets a test gives (each as the provider
writes it), ``page_size`` buckets a page with ``has_more`` / ``next_page``, within the
requested window and narrowed by the requested ids; and Anthropic's Usage and Cost Analytics
API, ``GET /v1/organizations/analytics/usage`` and ``/analytics/cost``, from rows a test
gives (``{"starting_at", "ending_at", "group", "usage" | "cost"}``), ``page_size`` rows a
page, narrowed by the ids in each row's ``group``; it asks for the API's ``anthropic-beta``
header, as a beta endpoint does. It checks each provider's auth (``Authorization:
Bearer`` / ``x-api-key`` with ``anthropic-version``) and answers in its error shapes; faults
queued with :meth:`FakeAdminApi.fail_next` answer the next requests instead (a 429 with
``Retry-After``, a 401, a 5xx). Every request is recorded.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import parse_qsl

from router.fake_provider._http import BadRequest, Connection, HttpRequest
from router.fake_provider._respond import send_json
from router.fake_provider._serving import Served

if TYPE_CHECKING:
    from router.fake_provider.server import Billed, FakeUpstream

__all__ = [
    "AdminRequest",
    "FakeAdminApi",
    "Identity",
    "analytics_usage_rows",
    "openai_usage_buckets",
]

_OPENAI = {
    "/v1/organization/usage/completions": "openai-usage",
    "/v1/organization/usage/embeddings": "openai-embeddings-usage",
    "/v1/organization/costs": "openai-costs",
}
_ANTHROPIC = {
    "/v1/organizations/usage_report/messages": "anthropic-usage",
    "/v1/organizations/cost_report": "anthropic-costs",
    "/v1/organizations/analytics/usage": "anthropic-analytics-usage",
    "/v1/organizations/analytics/cost": "anthropic-analytics-costs",
}
_ANALYTICS_BETA = "analytics-usage-cost-2026-08-24"
_FILTERS = {
    "project_ids": "project_id",
    "api_key_ids": "api_key_id",
    "workspace_ids[]": "workspace_id",
    "api_key_ids[]": "api_key_id",
}


@dataclass(frozen=True)
class AdminRequest:
    path: str
    params: list[tuple[str, str]]
    headers: dict[str, str]
    status: int


@dataclass(frozen=True)
class _Fault:
    status: int
    retry_after: str | None


class FakeAdminApi(Served):
    """Both providers' admin report endpoints, serving the buckets of ``reports`` (by
    format: ``openai-usage`` ... ``anthropic-costs``; the analytics API's rows under
    ``anthropic-analytics-usage`` and ``anthropic-analytics-costs``) to a caller with
    ``admin_key``."""

    def __init__(
        self,
        reports: dict[str, list[dict[str, Any]]] | None = None,
        *,
        admin_key: str = "sk-admin-fake",
        page_size: int = 2,
        host: str = "127.0.0.1",
        port: int = 0,
        billed_by: FakeUpstream | None = None,
        identity: Identity | None = None,
    ) -> None:
        """``billed_by``: a usage report (OpenAI's, Anthropic's analytics) that ``reports``
        does not give is what that fake provider billed, hour by hour, under ``identity``."""
        self.billed_by = billed_by
        self.identity = identity or Identity()
        self.admin_key = admin_key
        self.page_size = page_size
        self.host = host
        self._requested_port = port  # 0: a free one
        self._reports = {k: list(v) for k, v in (reports or {}).items()}
        self._lock = threading.Lock()
        self._faults: deque[_Fault] = deque()
        self._requests: list[AdminRequest] = []
        self._server: asyncio.Server | None = None
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """OpenAI's form of an admin base URL (ends in /v1)."""
        return f"{self.root_url}/v1"

    @property
    def root_url(self) -> str:
        """Anthropic's form (the host alone)."""
        if not self._port:
            raise RuntimeError("FakeAdminApi is not running")
        return f"http://{self.host}:{self._port}"

    def set_report(self, report_format: str, buckets: list[dict[str, Any]]) -> None:
        with self._lock:
            self._reports[report_format] = list(buckets)

    def fail_next(self, status: int, *, times: int = 1, retry_after: str | None = None) -> None:
        """The next ``times`` report requests answer ``status`` (in the provider's shape)."""
        with self._lock:
            self._faults.extend(_Fault(status, retry_after) for _ in range(times))

    @property
    def requests(self) -> list[AdminRequest]:
        with self._lock:
            return list(self._requests)

    # --- serving ---

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(reader, writer)
        try:
            while not conn.closed:
                try:
                    request = await conn.read_request()
                except BadRequest:
                    break
                if request is None:
                    break
                await self._answer(conn, request)
                if not request.keep_alive:
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if not conn.closed:
                conn.closed = True
                writer.close()

    async def _answer(self, conn: Connection, request: HttpRequest) -> None:
        params = parse_qsl(request.query, keep_blank_values=True)
        headers = {k.lower(): v for k, v in request.headers.items()}
        openai = request.path in _OPENAI
        status, body, extra = self._respond(request.path, params, headers)
        with self._lock:
            self._requests.append(AdminRequest(request.path, params, headers, status))
        if status != 200:
            body = _error(openai, status, body["message"])
        await send_json(conn, status, body, keep_alive=request.keep_alive, headers=extra)

    def _respond(
        self, path: str, params: list[tuple[str, str]], headers: dict[str, str]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        report_format = _OPENAI.get(path) or _ANTHROPIC.get(path)
        if report_format is None or path is None:
            return 404, {"message": f"Unknown request URL: GET {path}"}, {}
        with self._lock:
            fault = self._faults.popleft() if self._faults else None
        if fault is not None:
            extra = {"retry-after": fault.retry_after} if fault.retry_after else {}
            return fault.status, {"message": f"fault {fault.status}"}, extra
        if path in _OPENAI:
            if headers.get("authorization") != f"Bearer {self.admin_key}":
                return 401, {"message": "Incorrect API key provided."}, {}
        elif headers.get("x-api-key") != self.admin_key:
            return 401, {"message": "invalid x-api-key"}, {}
        elif not headers.get("anthropic-version"):
            return 400, {"message": "anthropic-version: header is required"}, {}
        analytics = report_format.startswith("anthropic-analytics")
        betas = {b.strip() for b in headers.get("anthropic-beta", "").split(",")}
        if analytics and _ANALYTICS_BETA not in betas:
            return 400, {"message": f"this endpoint needs anthropic-beta: {_ANALYTICS_BETA}"}, {}
        with self._lock:
            given = self._reports.get(report_format)
        buckets = list(given) if given is not None else self._billed_report(report_format)
        if analytics:
            return 200, self._rows_page(buckets, params), {}
        return 200, self._page(path in _OPENAI, buckets, params), {}

    def _page(
        self, openai: bool, buckets: list[dict[str, Any]], params: list[tuple[str, str]]
    ) -> dict[str, Any]:
        query = dict(params)
        start_key, end_key = ("start_time", "end_time") if openai else ("starting_at", "ending_at")
        start, end = _instant(query.get(start_key)), _instant(query.get(end_key))
        wanted: dict[str, set[str]] = {}
        for key, value in params:
            if key in _FILTERS:
                wanted.setdefault(_FILTERS[key], set()).add(value)
        chosen = []
        for bucket in buckets:
            at = _instant(bucket[start_key])
            if (start is not None and at is not None and at < start) or (
                end is not None and at is not None and at >= end
            ):
                continue
            results = [
                r
                for r in bucket.get("results", [])
                if all(r.get(field) in ids for field, ids in wanted.items())
            ]
            chosen.append({**bucket, "results": results})
        offset = int(query.get("page", "page_0").removeprefix("page_") or 0)
        page = chosen[offset : offset + self.page_size]
        more = offset + self.page_size < len(chosen)
        body: dict[str, Any] = {
            "data": page,
            "has_more": more,
            "next_page": f"page_{offset + self.page_size}" if more else None,
        }
        return {"object": "page", **body} if openai else body

    def _rows_page(
        self, rows: list[dict[str, Any]], params: list[tuple[str, str]]
    ) -> dict[str, Any]:
        """An analytics page: the rows in the window whose group has the requested ids."""
        query = dict(params)
        start, end = _instant(query.get("starting_at")), _instant(query.get("ending_at"))
        wanted: dict[str, set[str]] = {}
        for key, value in params:
            if key in _FILTERS:
                wanted.setdefault(_FILTERS[key], set()).add(value)
        chosen = []
        for row in rows:
            at = _instant(row["starting_at"])
            if at is not None and (
                (start is not None and at < start) or (end is not None and at >= end)
            ):
                continue
            group = row.get("group") or {}
            if all(group.get(field) in ids for field, ids in wanted.items()):
                chosen.append(row)
        offset = int(query.get("page", "page_0").removeprefix("page_") or 0)
        more = offset + self.page_size < len(chosen)
        return {
            "data": chosen[offset : offset + self.page_size],
            "has_more": more,
            "next_page": f"page_{offset + self.page_size}" if more else None,
        }

    def _billed_report(self, report_format: str) -> list[dict[str, Any]]:
        if self.billed_by is None:
            return []
        billed = self.billed_by.billed
        if report_format == "openai-usage":
            return openai_usage_buckets(billed, self.identity)
        if report_format == "anthropic-analytics-usage":
            return analytics_usage_rows(billed, self.identity)
        return []

    # --- lifecycle: on the caller's loop, or on a loop of its own in a thread ---

    async def astart(self) -> Self:
        self._server = await asyncio.start_server(self._serve, self.host, self._requested_port)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()


@dataclass(frozen=True)
class Identity:
    """Who the fake's callers are to the provider: the ids its usage reports name (an
    endpoint's `provider_project_id`, `provider_api_key_id`, `provider_workspace_id`)."""

    project_id: str = "proj_fake"
    api_key_id: str = "key_fake"
    workspace_id: str = "wrkspc_fake"


def _hours(billed: list[Billed], dialect: str) -> dict[tuple[datetime, str], list[Billed]]:
    """The dialect's answers by the hour they began in (UTC) and their model."""
    hours: dict[tuple[datetime, str], list[Billed]] = {}
    for answer in billed:
        if answer.dialect == dialect:
            hour = answer.at.replace(minute=0, second=0, microsecond=0)
            hours.setdefault((hour, answer.model), []).append(answer)
    return dict(sorted(hours.items()))


def openai_usage_buckets(billed: list[Billed], identity: Identity) -> list[dict[str, Any]]:
    """What the fake billed on its OpenAI wire, as OpenAI's hourly completions usage."""
    buckets: dict[datetime, list[dict[str, Any]]] = {}
    for (hour, model), answers in _hours(billed, "openai").items():
        buckets.setdefault(hour, []).append(
            {
                "object": "organization.usage.completions.result",
                "input_tokens": sum(a.input_tokens for a in answers),
                "output_tokens": sum(a.output_tokens for a in answers),
                "input_cached_tokens": sum(a.cached_tokens for a in answers),
                "input_audio_tokens": 0,
                "output_audio_tokens": 0,
                "num_model_requests": len(answers),
                "project_id": identity.project_id,
                "user_id": None,
                "api_key_id": identity.api_key_id,
                "model": model,
                "batch": False,
                "service_tier": None,
            }
        )
    return [
        {
            "object": "bucket",
            "start_time": int(hour.timestamp()),
            "end_time": int((hour + timedelta(hours=1)).timestamp()),
            "results": results,
        }
        for hour, results in buckets.items()
    ]


def analytics_usage_rows(billed: list[Billed], identity: Identity) -> list[dict[str, Any]]:
    """What the fake billed on its Anthropic wire, as the analytics API's hourly usage rows."""
    rows = []
    for (hour, model), answers in _hours(billed, "anthropic").items():
        cached = sum(a.cached_tokens for a in answers)
        uncached = sum(a.input_tokens for a in answers) - cached
        output = sum(a.output_tokens for a in answers)
        rows.append(
            {
                "starting_at": hour.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "ending_at": (hour + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "group": {
                    "actor": None,
                    "actor_type": None,
                    "api_key_id": identity.api_key_id,
                    "model": model,
                    "service_tier": None,
                    "workspace_id": identity.workspace_id,
                },
                "usage": {
                    "uncached_input_tokens": uncached,
                    "cache_creation": {
                        "ephemeral_5m_input_tokens": 0,
                        "ephemeral_1h_input_tokens": 0,
                    },
                    "cache_read_input_tokens": cached,
                    "output_tokens": output,
                    "requests": len(answers),
                    "server_tool_use": {"web_search_requests": 0},
                    "total_tokens": uncached + cached + output,
                },
            }
        )
    return rows


def _instant(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return datetime.fromtimestamp(int(value), UTC)
    try:
        moment = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _error(openai: bool, status: int, message: str) -> dict[str, Any]:
    """Each provider's error shape."""
    if openai:
        kind = "invalid_request_error" if status < 500 else "server_error"
        code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status)
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        429: "rate_limit_error",
        529: "overloaded_error",
    }.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
