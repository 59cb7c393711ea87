"""The OpenAPI operations of the key API (contract §3 "Keys"; router.http.keys)."""

from __future__ import annotations

from typing import Final

from ledger.apikeys import ROLES
from ledger.types import MONEY_PATTERN
from router.http.openapi_parts import (
    MONEY,
    STRING,
    Schema,
    error_responses,
    nullable,
    object_schema,
    ok,
    page,
    query,
)

__all__ = ["CREATE_KEY", "LIST_KEYS", "REVOKE_KEY"]

_WINDOW: Final[Schema] = {"type": "string", "enum": ["day", "month", "total"]}
_PER_MINUTE: Final[Schema] = {"type": "integer", "minimum": 1, "maximum": 2**53 - 1}
_INSTANT: Final[Schema] = {"type": "string", "format": "date-time"}
_LIMITS: Final[Schema] = {
    "type": "object",
    "properties": {"requests_per_minute": _PER_MINUTE, "tokens_per_minute": _PER_MINUTE},
    "minProperties": 1,
    "description": "The key's own rate limits, overriding its workspace's key_limits; at "
    "least one.",
}

_KEY: Final[Schema] = object_schema(
    [
        "key_id",
        "name",
        "workspace",
        "role",
        "state",
        "created_at",
        "created_by",
        "revoked_at",
        "expires_at",
        "budget",
        "endpoints",
        "limits",
    ],
    key_id=STRING,
    name=nullable(STRING),
    workspace=STRING,
    role={"type": "string", "enum": list(ROLES)},
    state={"type": "string", "enum": ["active", "revoked", "expired"]},
    created_at=_INSTANT,
    created_by=nullable(STRING),
    revoked_at=nullable(_INSTANT),
    expires_at=nullable(_INSTANT),
    budget=nullable(object_schema(["limit_usd", "window"], limit_usd=MONEY, window=_WINDOW)),
    endpoints=nullable({"type": "array", "items": STRING}),
    limits=nullable(_LIMITS),
)

CREATE_KEY: Final[Schema] = {
    "summary": "Create an API key; its secret is in this answer only (admin keys)",
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": object_schema(
                    ["workspace"],
                    workspace={"type": "string", "description": "A workspace of the config."},
                    role={"type": "string", "enum": list(ROLES), "default": "client"},
                    name=nullable(
                        {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 200,
                            "description": "What people call the key: one line of text.",
                        }
                    ),
                    budget=nullable(
                        object_schema(
                            ["limit_usd"],
                            limit_usd={**MONEY, "pattern": MONEY_PATTERN},
                            window={**_WINDOW, "default": "day"},
                        )
                    ),
                    endpoints=nullable(
                        {
                            "type": "array",
                            "items": {"type": "string", "minLength": 1},
                            "minItems": 1,
                            "description": "Its standing endpoint scope: endpoint ids of the "
                            "config and provider:NAME labels.",
                        }
                    ),
                    expires_at=nullable(
                        {
                            "anyOf": [
                                {"type": "string", "format": "date"},
                                {"type": "string", "format": "date-time"},
                            ],
                            "description": "When the key stops working, in the future; "
                            "a date is midnight UTC, an instant without an offset UTC.",
                        }
                    ),
                    limits=nullable(_LIMITS),
                )
            }
        },
    },
    "responses": {
        "201": ok(
            {
                **_KEY,
                "required": [*_KEY["required"], "secret"],
                "properties": {**_KEY["properties"], "secret": STRING},
            }
        ),
        **error_responses(400, 403),
    },
}
LIST_KEYS: Final[Schema] = {
    "summary": "The API keys, oldest first, never a secret (admin keys)",
    "parameters": [query("workspace", STRING, "Only this workspace's keys.")],
    "responses": {"200": ok(page(_KEY)), **error_responses(403)},
}
REVOKE_KEY: Final[Schema] = {
    "summary": "Revoke an API key: refused from its next request on (admin keys)",
    "responses": {"200": ok(_KEY), **error_responses(403, 404)},
}
