"""Which egress proxy an upstream call goes through: proxy URLs taken apart, and the standard
environment variables read the way curl reads them.

Pure functions over strings. ``router.config`` calls them once per endpoint at load time, so
each endpoint's way out is fixed, validated and recorded with its config generation; the
drivers only follow it (``router.drivers.http`` tunnels through the proxy with CONNECT).

The environment, for an upstream URL:

- ``https_proxy`` / ``HTTPS_PROXY`` for an https upstream, ``http_proxy`` / ``HTTP_PROXY``
  for an http one. The lower-case name wins when both are set (curl, urllib, requests);
  an empty value means no proxy. ``ALL_PROXY`` is not read (it mostly names SOCKS proxies,
  which are not supported).
- ``no_proxy`` / ``NO_PROXY``: a list separated by commas or spaces. ``*`` alone matches
  every host. A name matches itself and every name under it (``example.com`` matches
  ``api.example.com``, never ``badexample.com``); a leading ``.`` or ``*.`` changes
  nothing. ``name:port`` matches that port only. An IP address matches itself, a CIDR block
  (``10.0.0.0/8``, ``fd00::/8``) every address in it; host names are never resolved.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Final
from urllib.parse import unquote, urlsplit

__all__ = [
    "environment_proxy",
    "no_proxy_matches",
    "percent_decoded_credentials",
    "split_proxy_url",
    "split_userinfo",
]

_SCHEME: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_DEFAULT_PORT: Final = 80


def split_userinfo(url: str) -> tuple[str, str | None]:
    """``url`` without its userinfo, and the userinfo as written (``None`` without one)."""
    scheme = _SCHEME.match(url)
    if scheme is None:
        return url, None
    rest = url[scheme.end() :]
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    userinfo, at, hostport = rest[:end].rpartition("@")
    if not at:
        return url, None
    return f"{url[: scheme.end()]}{hostport}{rest[end:]}", userinfo


def split_proxy_url(url: str) -> tuple[str, int]:
    """Host and port of an ``http://host[:port][/]`` proxy URL (the port defaults to 80);
    take any userinfo off first (:func:`split_userinfo`).

    ``ValueError`` for anything else: another scheme (an ``https://`` or SOCKS proxy is not
    supported), a path, a query, no host. Its message never quotes ``url``.
    """
    scheme = _SCHEME.match(url)
    if scheme is None:
        raise ValueError("must be a URL such as http://proxy.example:3128")
    if scheme.group(1).lower() != "http":
        name = scheme.group(1).lower()
        raise ValueError(f"must be an http:// proxy URL; {name}:// proxies are not supported")
    hostport, _, path = url[scheme.end() :].partition("/")
    if path or "?" in hostport or "#" in hostport or "@" in hostport:
        raise ValueError("must be only scheme, host and port, with no path or query")
    try:
        parts = urlsplit(f"http://{hostport}")
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ValueError("must have a valid host and port") from None
    if not host:
        raise ValueError("must name the proxy's host")
    if port == 0:
        raise ValueError("must have a valid host and port")
    return host, _DEFAULT_PORT if port is None else port


def percent_decoded_credentials(userinfo: str) -> tuple[str, str]:
    """User and password from a URL's userinfo, where they are percent-encoded."""
    user, _, password = userinfo.partition(":")
    return unquote(user), unquote(password)


def environment_proxy(url: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The environment variable naming the proxy for ``url``, and its value; ``None`` when
    no variable applies or ``NO_PROXY`` matches the URL's host."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    found = _variable(f"{scheme}_proxy", environ)
    if found is None or not found[1].strip():
        return None
    bypass = _variable("no_proxy", environ)
    port = parts.port or (443 if scheme == "https" else 80)
    if bypass is not None and no_proxy_matches(parts.hostname, port, bypass[1]):
        return None
    name, value = found
    value = value.strip()
    # curl, requests and httpx read a value without a scheme as an http:// proxy.
    return name, value if "://" in value else f"http://{value}"


def no_proxy_matches(host: str, port: int, no_proxy: str) -> bool:
    """Whether a ``NO_PROXY`` value exempts ``host`` (a name or IP, without brackets)."""
    host = host.lower().rstrip(".")
    address = _ip(host)
    for entry in re.split(r"[\s,]+", no_proxy.strip()):
        if not entry:
            continue
        if entry == "*":
            return True
        name, entry_port = _split_port(entry.lower())
        if entry_port is not None and entry_port != port:
            continue
        if address is not None:
            if _address_matches(address, name):
                return True
            continue
        name = name.removeprefix("*").lstrip(".").rstrip(".")
        if name and (host == name or host.endswith(f".{name}")):
            return True
    return False


def _variable(name: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    for candidate in (name, name.upper()):
        value = environ.get(candidate)
        if value is not None:
            return candidate, value
    return None


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):  # [v6] or [v6]:port
        inside, _, after = entry[1:].partition("]")
        port = after.removeprefix(":")
        return inside, int(port) if port.isdigit() else None
    name, colon, port = entry.rpartition(":")
    if colon and port.isdigit() and ":" not in name:  # not a bare IPv6 address
        return name, int(port)
    return entry, None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _address_matches(address: ipaddress.IPv4Address | ipaddress.IPv6Address, entry: str) -> bool:
    try:
        network = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False  # a name: never resolved, so never an address's match
    return address.version == network.version and address in network
