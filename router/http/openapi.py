"""The OpenAPI 3.1 description of the HTTP API (contract §3), served at ``GET /openapi.json``.

The handlers read raw requests on purpose (one JSON parse, errors in the contract's shape),
so FastAPI cannot infer what they accept or answer. Each route declares it here instead,
passed as ``openapi_extra`` on its decorator: the request body, the query and header
parameters, and every response, errors included. The declarations say what the gateway
checks, no more and no less: a fuzzer (tests/gateway/test_fuzz_api.py) holds the two to
each other. :func:`install_openapi` adds the shared components (the error body, the bearer
scheme) and drops what FastAPI guesses for typed parameters the handlers never validate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from router.config import Limits
from router.http.openapi_bodies import schemas_for
from router.http.openapi_doors import (
    ADMIN_RELOAD,
    BUDGETS,
    CHAT_COMPLETIONS,
    EMBEDDINGS,
    ENABLE_ENDPOINT,
    EXPLAIN_REQUEST,
    HEALTHZ,
    IMPORT_RECONCILIATION,
    LIST_ENDPOINTS,
    MESSAGES,
    MESSAGES_COUNT_TOKENS,
    METRICS,
    MODELS,
    READ_RECONCILIATION,
    READ_RECONCILIATION_BUCKET,
    READYZ,
    REQUEST_EVENTS,
    REQUEST_PROOF,
    REQUEST_VIEW,
    RESPONSES,
    SEARCH_REQUESTS,
    SETTLE_UNKNOWN,
    SPEND,
    UNKNOWN_SETTLEMENTS,
    VERIFY_LEDGER,
)
from router.http.openapi_keys import CREATE_KEY, LIST_KEYS, REVOKE_KEY
from router.http.openapi_parts import ERROR_CODES

__all__ = [
    "ADMIN_RELOAD",
    "BUDGETS",
    "CHAT_COMPLETIONS",
    "CREATE_KEY",
    "EMBEDDINGS",
    "ENABLE_ENDPOINT",
    "ERROR_CODES",
    "EXPLAIN_REQUEST",
    "HEALTHZ",
    "IMPORT_RECONCILIATION",
    "LIST_ENDPOINTS",
    "LIST_KEYS",
    "MESSAGES",
    "MESSAGES_COUNT_TOKENS",
    "METRICS",
    "MODELS",
    "READYZ",
    "READ_RECONCILIATION",
    "READ_RECONCILIATION_BUCKET",
    "REQUEST_EVENTS",
    "REQUEST_PROOF",
    "REQUEST_VIEW",
    "RESPONSES",
    "REVOKE_KEY",
    "SEARCH_REQUESTS",
    "SETTLE_UNKNOWN",
    "SPEND",
    "UNKNOWN_SETTLEMENTS",
    "VERIFY_LEDGER",
    "install_openapi",
]

_DESCRIPTION: Final = (
    "Waybill, an OpenAI-compatible LLM gateway with a ledger. Authenticate with "
    "`Authorization: Bearer <key>`. Every error is the one JSON body `Error`, with a code "
    "named in its response's description; every response carries `X-Request-Id`. "
    "No URL may contain a NUL character (%00): 400 invalid_request."
)


def install_openapi(app: FastAPI, limits: Callable[[], Limits] = Limits) -> None:
    """Serve the described schema as the app's OpenAPI: built on first request, and again
    when ``limits`` (the serving config's, which a reload may change) are not the same."""
    built_for: list[Limits] = []

    def build() -> dict[str, Any]:
        current = limits()
        if built_for != [current]:
            app.openapi_schema = None
            built_for[:] = [current]
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, description=_DESCRIPTION, routes=app.routes
            )
            components = document.setdefault("components", {})
            # FastAPI documents a 422 for the typed path parameters; the handlers validate
            # nothing there, and their errors are ours, declared route by route.
            for schema_name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(schema_name, None)
            for operations in document["paths"].values():
                for operation in operations.values():
                    responses = operation["responses"]
                    if "HTTPValidationError" in str(responses.get("422", "")):
                        del responses["422"]
            components.setdefault("schemas", {}).update(schemas_for(current))
            components["securitySchemes"] = {
                "api_key": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A Waybill API key: Authorization: Bearer <key>.",
                }
            }
            document["security"] = [{"api_key": []}]
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
