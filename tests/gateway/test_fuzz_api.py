"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis) against a real gateway.

For every route the schema declares, schemathesis sends the schema's examples, its coverage
cases (boundaries, missing and wrongly typed values, undeclared methods) and random valid
and invalid requests, and checks every answer: no 5xx (the fake provider answers ok, so a
5xx is a bug), status codes, content types, headers and bodies as declared, valid data
accepted, invalid data refused, authentication enforced. On top of that every error must be
contract §3's controlled body with a code and type its status may carry (router.errors), and
every authenticated route must refuse the same request without a key, or with an unknown one,
with that body's 401.

The gateway runs in a thread of its own (schemathesis calls it synchronously), once per
ledger backend: PostgreSQL refuses values SQLite takes (NUL characters, huge numbers).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
import requests
import schemathesis
from fastapi import FastAPI
from schemathesis import Case, CheckContext, Response
from schemathesis.checks import positive_data_acceptance

from ledger import apikeys
from router.config import parse_config
from router.errors import codes_by_status, error_type
from router.http.app import AppSettings, create_app
from tests.conftest import BACKENDS, cloned_postgres
from tests.gateway.harness import ANTHROPIC_ENV, Route, config_text, running_gateway

pytestmark = pytest.mark.slow

# Cases per route and phase; FUZZ_EXAMPLES=500 for a longer hunt.
MAX_EXAMPLES: Final = int(os.environ.get("FUZZ_EXAMPLES", "15"))

# The codes each status may carry: contract §3's table, as router.errors defines it.
CODES_BY_STATUS: Final = codes_by_status()
# Routes only admin (or finance) keys may use are fuzzed with an admin key, so that their
# bodies get read; every other route with a client key.
ADMIN_ROUTES: Final = frozenset(
    {
        "POST /v1/admin/config/reload",
        "GET /v1/endpoints",
        "POST /v1/admin/endpoints/{endpoint_id}/enable",
        "POST /v1/reconciliations",
        "GET /v1/reconciliations/{reconciliation_id}",
        "POST /v1/settlements/unknown/{settlement_id}",
        "GET /v1/ledger/verify",
        "POST /v1/admin/keys",
        "GET /v1/admin/keys",
        "POST /v1/admin/keys/{key_id}/revoke",
    }
)

CONFIG: Final = schemathesis.Config.from_dict(
    {
        "generation": {
            "mode": "all",  # valid and invalid requests
            "max-examples": MAX_EXAMPLES,
            # The key is the Authorization header the test sends, never a generated one.
            "with-security-parameters": False,
            # The gateway refuses a NUL in any URL (the schema says so in words, and
            # test_surface_e2e checks it): schemathesis would count that as valid data refused.
            "allow-x00": False,
        },
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": True},
            "fuzzing": {"enabled": True},
        },
        "checks": {
            # A valid request may still find no route or no budget (contract §3 402, 422).
            "positive_data_acceptance": {
                "expected-statuses": ["2xx", "401", "402", "403", "404", "409", "422", "429"]
            },
        },
        "output": {"sanitization": {"enabled": False}},  # show the failing request whole
    }
)


class _Nowhere:
    base_url = "http://127.0.0.1:9/v1"


def _served_schema() -> dict[str, Any]:
    """What GET /openapi.json serves: it follows from the routes, not from the config."""
    text = config_text({"east": _Nowhere()}, [Route("east")])  # type: ignore[dict-item]
    app: FastAPI = create_app(AppSettings(parse_config(text, environ=ANTHROPIC_ENV), "sqlite://"))
    document: dict[str, Any] = app.app.openapi()  # type: ignore[attr-defined]
    return document


# Built at import so that schemathesis makes one test per route at collection; its lazy
# loader (schemathesis.pytest.from_fixture) reads Node._nodeid, which pytest 9.2 removed.
# The first test checks that the gateway really serves this document.
SERVED_SCHEMA: Final = _served_schema()
schema = schemathesis.openapi.from_dict(SERVED_SCHEMA, config=CONFIG)


@schemathesis.serializer("application/x-ndjson")
def _jsonl(ctx: Any, value: Any) -> bytes:
    """A JSONL usage export is text: sent as it is."""
    return value.encode() if isinstance(value, str) else str(value).encode()


@dataclass(frozen=True)
class Fuzzed:
    url: str
    client_key: str
    admin_key: str

    def key_for(self, label: str) -> str:
        return self.admin_key if label in ADMIN_ROUTES else self.client_key


@pytest.fixture(scope="module", params=BACKENDS)
def fuzzed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fuzzed]:
    """A real gateway with a fake provider on the backend's ledger, served from a thread."""
    directory = tmp_path_factory.mktemp("fuzz")
    with (
        _database(request, directory) as database_url,
        pytest.MonkeyPatch.context() as env,
    ):
        env.setenv("FAKE_KEY", ANTHROPIC_ENV["FAKE_KEY"])  # a reload reads the file's ${env:..}
        with _served_from_a_thread(database_url, directory / "waybill.yaml") as gateway:
            yield gateway


@contextmanager
def _database(request: pytest.FixtureRequest, directory: Path) -> Iterator[str]:
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        (directory / "ledger.db").write_bytes(template.read_bytes())
        yield f"sqlite:///{directory / 'ledger.db'}"
    else:
        with cloned_postgres(request.getfixturevalue("pg_template")) as url:
            yield url


@contextmanager
def _served_from_a_thread(database_url: str, config_file: Path) -> Iterator[Fuzzed]:
    started: queue.Queue[tuple[Fuzzed, asyncio.AbstractEventLoop, asyncio.Event] | BaseException]
    started = queue.Queue()

    async def serve() -> None:
        try:
            async with running_gateway(
                database_url, ["east"], [Route("east")], config_file=config_file
            ) as gateway:
                admin = await apikeys.create_key(gateway.store, "acme", "admin")
                stop = asyncio.Event()
                fuzzed = Fuzzed(gateway.url, gateway.secret, admin.secret)
                started.put((fuzzed, asyncio.get_running_loop(), stop))
                await stop.wait()
        except BaseException as error:
            started.put(error)
            raise

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    ready = started.get(timeout=60)
    if isinstance(ready, BaseException):
        raise ready
    fuzzed, loop, stop = ready
    try:
        yield fuzzed
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)


def test_the_gateway_serves_the_fuzzed_schema_without_a_key(fuzzed: Fuzzed) -> None:
    response = requests.get(f"{fuzzed.url}/openapi.json", timeout=10)
    assert response.status_code == 200
    assert response.json() == SERVED_SCHEMA


@schema.parametrize()
def test_every_answer_is_declared_and_every_error_controlled(
    case: Case[Any], fuzzed: Fuzzed
) -> None:
    label = case.operation.label
    # Which cursor is valid (one this endpoint handed out) and which text is a provider's
    # usage export, no schema can say: made-up ones are refused (with the controlled 400).
    # Nor which workspaces and endpoints the config has, nor whether an expiry is still
    # to come, for a key to create.
    opaque = "cursor" in (case.query or {}) or label in (
        "POST /v1/reconciliations",
        "POST /v1/admin/keys",
    )
    response = case.call_and_validate(
        base_url=fuzzed.url,
        headers={"Authorization": f"Bearer {fuzzed.key_for(label)}"},
        additional_checks=[controlled_error],
        excluded_checks=[positive_data_acceptance] if opaque else [],
    )
    public = case.operation.definition.raw.get("security") == []
    routed = case.method.upper() == case.operation.method.upper() and not (
        response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    )
    if public or not routed:
        return
    # The same request without a usable key: refused before anything else is read.
    for authorization in (None, "Bearer wb_not-a-key"):
        refused = _send(case, fuzzed.url, authorization)
        assert refused.status_code == 401, (label, refused.status_code, refused.text)
        if _anthropic(case.operation.path):
            assert_anthropic_error(401, refused.headers, refused.json())
        else:
            assert_controlled_error(401, refused.headers, refused.json())


def controlled_error(ctx: CheckContext, response: Response, case: Case[Any]) -> bool | None:
    """Every error is contract §3's JSON body, with a code and type its status may carry (the
    Anthropic door's: Anthropic's error object, with Waybill's code)."""
    if response.status_code >= 400:
        if _anthropic(case.operation.path):
            assert_anthropic_error(response.status_code, response.headers, response.json())
        else:
            assert_controlled_error(response.status_code, response.headers, response.json())
    return None


def _anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# The Anthropic door's (status answered, type) by the gateway's status (contract §3).
_ANTHROPIC_ERRORS: Final = {
    **{status: (status, "invalid_request_error") for status in (400, 405, 409, 422, 431)},
    401: (401, "authentication_error"),
    402: (402, "billing_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    **{status: (status, "api_error") for status in (499, 500, 502)},
    503: (529, "overloaded_error"),
    504: (504, "timeout_error"),
}


def assert_anthropic_error(status: int, headers: Any, body: Any) -> None:
    assert _header(headers, "content-type").startswith("application/json")
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", body
    error = body["error"]
    assert (
        {"type", "message", "code"}
        <= set(error)
        <= {"type", "message", "code", "param", "attempts"}
    )
    gateway_status = next(
        g for g, (s, t) in _ANTHROPIC_ERRORS.items() if (s, t) == (status, error["type"])
    )
    assert error["code"] in CODES_BY_STATUS.get(gateway_status, ()), (status, error["code"])
    assert isinstance(error["message"], str) and "Traceback" not in error["message"]
    assert body["request_id"] == _header(headers, "x-request-id")
    assert _header(headers, "x-should-retry") in ("true", "false")


def assert_controlled_error(status: int, headers: Any, body: Any) -> None:
    assert _header(headers, "content-type").startswith("application/json")
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"type", "code", "message", "param", "request_id", "attempts"}, error
    assert error["code"] in CODES_BY_STATUS.get(status, ()), (status, error["code"])
    assert error["type"] == error_type(status), (status, error["type"])
    assert isinstance(error["message"], str) and "Traceback" not in error["message"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["request_id"] == _header(headers, "x-request-id")
    assert isinstance(error["attempts"], list)
    assert _header(headers, "x-should-retry") in ("true", "false")


def _header(headers: Any, name: str) -> str:
    value = headers.get(name)
    if isinstance(value, list):  # schemathesis's responses hold lists of values
        value = value[0]
    assert isinstance(value, str), f"no {name} header"
    return value


def _send(case: Case[Any], url: str, authorization: str | None) -> requests.Response:
    """``case`` as it is, with ``authorization`` (or none) for its Authorization header."""
    kwargs = case.as_transport_kwargs(base_url=url)
    headers = {
        k: v
        for k, v in kwargs.pop("headers", {}).items()
        if k.lower() not in ("authorization", "x-api-key")
    }
    if authorization is not None:
        headers["Authorization"] = authorization
    return requests.request(**kwargs, headers=headers)
