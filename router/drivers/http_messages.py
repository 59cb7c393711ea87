"""What an upstream HTTP exchange is made of: its failures, headers, proxies and requests.

The failures are split by what they prove about the request (the evidence contract §5):
:class:`ConnectFailed` (:class:`TunnelFailed` when the proxy would not open the tunnel) means
its bytes were never written; after they were written, every failure leaves the upstream
maybe started. A request is prepared here, as the bytes written in one piece.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeVar, overload
from urllib.parse import urlsplit

__all__ = [
    "USER_AGENT",
    "ConnectFailed",
    "ConnectionBroken",
    "HTTPError",
    "Headers",
    "PreparedRequest",
    "ProtocolError",
    "Proxy",
    "ReadTimeout",
    "Target",
    "TunnelFailed",
    "parse_target",
    "prepare_request",
]

_MANAGED: Final = frozenset({"host", "content-length", "transfer-encoding"})
USER_AGENT: Final = "waybill"
_T = TypeVar("_T")


class HTTPError(Exception):
    """Base of every failure of an upstream exchange."""


class ConnectFailed(HTTPError):
    """No connection (DNS, refused, connect timeout, TLS handshake): nothing was sent."""


class TunnelFailed(ConnectFailed):
    """The proxy did not open a tunnel: unreachable, closed, silent past the connect timeout,
    or it answered CONNECT with ``status`` (not 2xx). Nothing reached the upstream.

    ``detail`` says which, in words fit to show a client (no address, no credentials).
    """

    def __init__(self, proxy: Proxy, detail: str, *, status: int | None = None) -> None:
        self.detail = detail
        self.status = status
        super().__init__(f"proxy {proxy.address}: {detail}")


class ReadTimeout(HTTPError):
    """No response bytes within ``read_timeout`` after the request was written, or by the
    response's ``read_deadline`` (then ``deadline`` is True).

    Deliberately not a :class:`TimeoutError`: callers tell their own deadlines
    (``asyncio.timeout``) from this one by the type.
    """

    def __init__(
        self, message: str = "no response bytes in time", *, deadline: bool = False
    ) -> None:
        super().__init__(message)
        self.deadline = deadline


class ConnectionBroken(HTTPError):
    """Closed or reset after the request was written, before the response ended.

    Also what a pooled connection that the server had already closed gives: the request was
    written to it, so the upstream may have started (as httpx reports it too).
    """


class ProtocolError(HTTPError):
    """The response is not HTTP/1.1 we can read; the request was written."""


class Headers(Mapping[str, str]):
    """Read-only, case-insensitive headers (a response's here; a request's in the fake
    provider).

    A repeated header's values are joined with ", " in arrival order (RFC 9110 §5.3), so
    :meth:`get` returns all of them as one string. Names iterate as first received.
    """

    __slots__ = ("_items",)

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        items: dict[str, tuple[str, str]] = {}
        for name, value in pairs:
            key = name.lower()
            prior = items.get(key)
            items[key] = (name, value) if prior is None else (prior[0], f"{prior[1]}, {value}")
        self._items = items

    def __getitem__(self, name: str) -> str:
        return self._items[name.lower()][1]

    @overload
    def get(self, name: str, /) -> str | None: ...
    @overload
    def get(self, name: str, /, default: str | _T) -> str | _T: ...
    def get(self, name: str, /, default: object = None) -> object:
        item = self._items.get(name.lower())
        return default if item is None else item[1]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._items

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Headers({dict(self)!r})"


@dataclass(frozen=True)
class Target:
    origin: tuple[str, str, int]  # scheme, host, port: what a pooled connection is for
    host_header: str
    path: str  # path and query, the request target


@functools.lru_cache(maxsize=256)
def parse_target(url: str) -> Target:
    # Cached: a driver calls the same few URLs over and over, and urlsplit is not free.
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host = parts.hostname
    default_port = 443 if scheme == "https" else 80
    port = parts.port or default_port
    host_header = f"[{host}]" if ":" in host else host
    if port != default_port:
        host_header = f"{host_header}:{port}"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target((scheme, host, port), host_header, path)


@dataclass(frozen=True, slots=True)
class Proxy:
    """An HTTP proxy to tunnel through, and the ``Proxy-Authorization`` to open it with."""

    host: str
    port: int
    authorization: str | None = field(default=None, repr=False)

    @classmethod
    def basic(cls, host: str, port: int, username: str, password: str) -> Proxy:
        token = base64.b64encode(f"{username}:{password}".encode()).decode("ascii")
        return cls(host, port, f"Basic {token}")

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request's bytes, ready to write, and where they go (through ``proxy``, if any)."""

    target: Target
    data: bytes
    proxy: Proxy | None = None


def prepare_request(
    method: str,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
    proxy: Proxy | None = None,
) -> PreparedRequest:
    """The bytes of one request. ``Host``, ``Content-Length`` and ``User-Agent`` (unless
    given) are written here; a caller's ``Host``, ``Content-Length`` or
    ``Transfer-Encoding`` is ignored. ``ValueError`` for a URL that is not http(s), for
    HEAD (its response framing differs) and for a CR or LF in a header."""
    if method == "HEAD":
        raise ValueError("HEAD is not supported")
    target = parse_target(url)
    return PreparedRequest(target, _request_bytes(method, target, headers or {}, body), proxy)


def _request_bytes(method: str, target: Target, headers: Mapping[str, str], body: bytes) -> bytes:
    lines = [f"{method} {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
    has_agent = False
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in _MANAGED:
            continue  # the framing is ours to write
        has_agent = has_agent or lowered == "user-agent"
        lines.append(f"{name}: {value}\r\n")
    if not has_agent:
        lines.append(f"User-Agent: {USER_AGENT}\r\n")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    head = "".join(lines)
    # Every element ends in exactly one CRLF, the first in two: any other CR or LF came from
    # a method, path, name or value and would let it forge headers.
    expected = len(lines) + 1
    if head.count("\n") != expected or head.count("\r") != expected:
        raise ValueError("CR or LF in the request line or a header")
    return head.encode("latin-1") + body
