"""Bytes that have reached a connection but that the event loop has not read yet.

A timer that says "nothing came for N seconds" (a keep-alive timeout, a read timeout) runs
on the event loop, and on a loop saturated with work it can run while the bytes that would
have stopped it are already in the socket's receive buffer: each turn of the loop runs the
timers that are due before it polls the sockets. Such a timer asks :func:`unread_bytes`
before it acts: a connection with bytes waiting was not silent, the loop was late.
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from typing import Final

__all__ = ["unread_bytes"]

_INT: Final = struct.Struct("i")


def unread_bytes(transport: asyncio.BaseTransport | None) -> int:
    """How many bytes the kernel holds for ``transport``'s socket (0 if it cannot tell)."""
    if transport is None:
        return 0
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        fd = sock.fileno()
        if fd < 0:
            return 0
        answer = fcntl.ioctl(fd, termios.FIONREAD, b"\0" * _INT.size)
    except (OSError, ValueError):
        return 0  # closed meanwhile, or not a socket the kernel can answer for
    count: int = _INT.unpack(answer)[0]
    return count
