"""Console sessions and CSRF tokens: signed values, no state but the secret.

A session is a cookie holding the signed-in key's id, role and workspace, a random session
id and an expiry, signed with HMAC-SHA256 under the console's secret. It never holds the API
key: the key is read by its id on every request (``ledger.apikeys.find_key_by_id``), so a
revoked key's session ends on its next request, as an API call would be refused.

Every form carries a CSRF token derived from the session id with the same secret (the sign-in
form, before there is a session, one derived from a random value in a cookie of its own):
a page of another site can neither read nor compute it. The secret is
``WAYBILL_CONSOLE_SECRET`` when set (several replicas share it; sessions then survive a
restart), else random at start (sessions end when the process does).

Sign-out clears the cookie and records the session id in the database
(``console_sign_outs``) until its expiry, so the same cookie replayed to any process on the
ledger (another worker, another replica) is refused; each process also remembers the
sessions it saw ended, and asks the database only about the others.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

import orjson
from sqlalchemy import delete, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.store.schema import console_sign_outs

__all__ = [
    "CSRF_FIELD",
    "SESSION_COOKIE",
    "SESSION_TTL_S",
    "SIGN_IN_COOKIE",
    "Session",
    "SessionKeeper",
    "is_signed_out",
    "record_sign_out",
    "secret_from",
]

SESSION_COOKIE: Final = "waybill_console"
SIGN_IN_COOKIE: Final = "waybill_console_sign_in"
CSRF_FIELD: Final = "csrf_token"
SESSION_TTL_S: Final = 8 * 60 * 60
_MIN_SECRET_BYTES: Final = 32
_MAX_ENDED: Final = 100_000


def secret_from(configured: str | None) -> bytes:
    """The console's signing secret: the configured one (at least 32 bytes), else random."""
    if configured is None or configured == "":
        return secrets.token_bytes(_MIN_SECRET_BYTES)
    secret = configured.encode()
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"WAYBILL_CONSOLE_SECRET must be at least {_MIN_SECRET_BYTES} bytes long")
    return secret


@dataclass(frozen=True, slots=True)
class Session:
    """Who signed in: a key's id, its role and workspace as they were at sign-in."""

    session_id: str
    key_id: str
    role: str
    workspace: str
    expires_at: int  # Unix seconds


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class SessionKeeper:
    """Issues and checks session cookies and CSRF tokens under one secret."""

    def __init__(self, secret: bytes, *, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._clock = clock
        self._ended: dict[str, int] = {}

    def _mac(self, purpose: str, value: str) -> str:
        return _b64(hmac.new(self._secret, f"{purpose}.{value}".encode(), hashlib.sha256).digest())

    def issue(self, key_id: str, role: str, workspace: str) -> tuple[Session, str]:
        """A new session and its cookie value."""
        session = Session(
            secrets.token_hex(16), key_id, role, workspace, int(self._clock()) + SESSION_TTL_S
        )
        body = _b64(
            orjson.dumps(
                {
                    "sid": session.session_id,
                    "kid": key_id,
                    "role": role,
                    "ws": workspace,
                    "exp": session.expires_at,
                }
            )
        )
        return session, f"{body}.{self._mac('session', body)}"

    def read(self, cookie: str | None) -> Session | None:
        """The session a cookie holds; None if absent, forged, expired or signed out."""
        if not cookie or cookie.count(".") != 1:
            return None
        body, mac = cookie.split(".")
        if not hmac.compare_digest(mac, self._mac("session", body)):
            return None
        try:
            fields = orjson.loads(_unb64(body))
            session = Session(
                str(fields["sid"]),
                str(fields["kid"]),
                str(fields["role"]),
                str(fields["ws"]),
                int(fields["exp"]),
            )
        except (binascii.Error, ValueError, KeyError, TypeError):
            return None
        if session.expires_at <= self._clock() or session.session_id in self._ended:
            return None
        return session

    def end(self, session: Session) -> None:
        """This process refuses the session's cookie from now on (a sign-out is also
        recorded for the others: :func:`record_sign_out`)."""
        now = int(self._clock())
        if len(self._ended) >= _MAX_ENDED:
            self._ended = {sid: exp for sid, exp in self._ended.items() if exp > now}
        self._ended[session.session_id] = session.expires_at

    def csrf_token(self, session: Session) -> str:
        return self._mac("csrf", session.session_id)

    def csrf_ok(self, session: Session, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token, self.csrf_token(session))

    def sign_in_token(self, nonce: str) -> str:
        """The sign-in form's CSRF token, bound to the nonce in its cookie."""
        return self._mac("sign-in", nonce)

    def sign_in_ok(self, nonce: str | None, token: str | None) -> bool:
        return (
            nonce is not None
            and token is not None
            and hmac.compare_digest(token, self.sign_in_token(nonce))
        )


async def record_sign_out(engine: AsyncEngine, session: Session, now: float) -> None:
    """Record that ``session`` was signed out, for every process on the ledger, and forget
    the sign-outs whose sessions have expired anyway."""
    try:
        async with engine.begin() as conn:
            await conn.execute(
                delete(console_sign_outs).where(
                    console_sign_outs.c.expires_at <= datetime.fromtimestamp(now, UTC)
                )
            )
            await conn.execute(
                insert(console_sign_outs).values(
                    session_id=session.session_id,
                    expires_at=datetime.fromtimestamp(session.expires_at, UTC),
                )
            )
    except IntegrityError:
        pass  # signed out already (twice at once, from two processes)


async def is_signed_out(engine: AsyncEngine, session_id: str) -> bool:
    """Whether any process recorded the session's sign-out."""
    async with engine.connect() as conn:
        found = await conn.execute(
            select(console_sign_outs.c.session_id).where(
                console_sign_outs.c.session_id == session_id
            )
        )
        return found.first() is not None
