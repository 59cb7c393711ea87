"""Who calls: the caller behind a request's key (Bearer or the Anthropic door's ``x-api-key``),
and the request's headers read once by name, a single-valued one sent twice refused."""

from __future__ import annotations

from collections.abc import (
    Iterable,
    Mapping,
)
from datetime import UTC, datetime
from typing import Final

from fastapi import Request

from ledger.apikeys import ApiKey, find_key, find_key_by_id
from router.config import (
    Config,
    RateLimits,
)
from router.errors import (
    GatewayError,
    invalid_api_key,
    invalid_request,
)
from router.request.gateway import Caller, Gateway


async def authenticate(request: Request) -> Caller:
    """The caller behind ``Authorization: Bearer <key>``; 401 ``invalid_api_key`` otherwise.

    The key is looked up in the keys read model on every request, so a revocation (which
    brings that model up to date before it returns) is refused at once.
    """
    gateway: Gateway = request.app.state.gateway
    return await authenticate_with(request, gateway.config)


async def authenticate_with(request: Request, config: Config) -> Caller:
    refuse_repeated(request.scope["headers"])
    return caller_of_key(
        await find_key(request.app.state.store, bearer_secret(request.headers)), config
    )


async def identify_anthropic(request: Request) -> tuple[Caller, dict[str, str]]:
    """The caller of an Anthropic-door route other than inference (its key read from the
    ledger every time), and the request's headers by name."""
    named = headers_by_name(request)
    gateway: Gateway = request.app.state.gateway
    key = await find_key(request.app.state.store, anthropic_secret(named))
    return caller_of_key(key, gateway.config), named


async def caller_of_secret(request: Request, secret: str) -> Caller:
    """The console's sign-in: the key given in its form, read as a Bearer key is."""
    gateway: Gateway = request.app.state.gateway
    return caller_of_key(await find_key(request.app.state.store, secret), gateway.config)


async def caller_of_key_id(request: Request, key_id: str) -> Caller:
    """A console session's key, read again on each request (a revoked key: 401)."""
    gateway: Gateway = request.app.state.gateway
    return caller_of_key(await find_key_by_id(request.app.state.store, key_id), gateway.config)


def bearer_secret(headers: Mapping[str, str]) -> str:
    header = headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise invalid_api_key("missing API key: send Authorization: Bearer <key>")
    return secret.strip()


def anthropic_secret(headers: Mapping[str, str]) -> str:
    """The Anthropic door's key: ``x-api-key``, as Anthropic's clients send it, or a Bearer
    key (``ANTHROPIC_AUTH_TOKEN``); both at once is refused as ambiguous."""
    key = headers.get("x-api-key")
    if key is None:
        return bearer_secret(headers)
    if "authorization" in headers:
        raise invalid_api_key("send the key once: x-api-key or Authorization, not both")
    if not key.strip():
        raise invalid_api_key("missing API key: send x-api-key: <key>")
    return key.strip()


def caller_of_key(key: ApiKey | None, config: Config) -> Caller:
    """The caller behind ``key``: 401 ``invalid_api_key`` for an unknown, revoked or expired
    key (the same answer for each, contract §3), or one of a workspace not configured."""
    if key is None or key.refused(datetime.now(UTC)):
        raise invalid_api_key()
    workspace = config.workspace(key.workspace)
    if workspace is None:
        raise invalid_api_key(f"the key's workspace {key.workspace!r} is not configured")
    limits = key.limits
    return Caller(
        key.key_id,
        workspace,
        key.role,
        key.budget,
        key.version,
        key.endpoints,
        None
        if limits is None
        else RateLimits(
            requests_per_minute=limits.requests_per_minute,
            tokens_per_minute=limits.tokens_per_minute,
        ),
    )


def headers_by_name(request: Request) -> dict[str, str]:
    """The request's headers by (lowercase) name: one pass, where each Starlette
    ``Headers.get`` scans them all (the chat route reads a dozen). A single-valued header
    sent twice is refused (:func:`refuse_repeated`)."""
    named: dict[str, str] = {}
    for name, value in request.scope["headers"]:
        key = name.decode("latin-1")
        if key in named and _single_valued(key):
            raise _repeated(key)
        named[key] = value.decode("latin-1")
    return named


def _single_valued(name: str) -> bool:
    """A header that must come once (contract §3): with two, which one wins is a guess — a
    proxy adding a stricter cost limit would be ignored, a second key silently dropped."""
    return name in _SINGLE_VALUED or name.startswith("x-waybill-")


_SINGLE_VALUED: Final = frozenset({"authorization", "x-api-key", "idempotency-key"})


def refuse_repeated(raw: Iterable[tuple[bytes, bytes]]) -> None:
    seen: set[str] = set()
    for name, _ in raw:
        key = name.decode("latin-1")
        if _single_valued(key):
            if key in seen:
                raise _repeated(key)
            seen.add(key)


def _repeated(name: str) -> GatewayError:
    shown = "-".join(part.capitalize() for part in name.split("-"))
    return invalid_request(f"header {shown}: sent more than once; send it once", param=shown)
