"""Who may read what (contract §3 roles), as pure functions of the authenticated caller.

- ``client``: only the requests made with its own key;
- ``auditor`` and ``finance``: everything in their workspace;
- ``admin``: every workspace.

A request the caller may not read is answered exactly like one that does not exist (404,
never 403), and search is narrowed by the same scope, so nothing of another workspace (or,
for a client, of another key) leaks through either. A role this module does not know gets
the narrowest scope, a client's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from router.gateway import Caller

__all__ = ["ReadScope", "can_read_request", "can_verify_ledger", "read_scope"]

_WORKSPACE_READERS: Final = frozenset({"auditor", "finance"})
_LEDGER_VERIFIERS: Final = frozenset({"admin", "auditor"})


@dataclass(frozen=True, slots=True)
class ReadScope:
    """The requests a caller may read. None: not narrowed on that field."""

    workspace: str | None
    key_id: str | None


def read_scope(caller: Caller) -> ReadScope:
    if caller.role == "admin":
        return ReadScope(workspace=None, key_id=None)
    if caller.role in _WORKSPACE_READERS:
        return ReadScope(workspace=caller.workspace.id, key_id=None)
    return ReadScope(workspace=caller.workspace.id, key_id=caller.key_id)


def can_read_request(caller: Caller, workspace: str, key_id: str) -> bool:
    """May ``caller`` read the request made in ``workspace`` with the key ``key_id``?"""
    scope = read_scope(caller)
    return scope.workspace in (None, workspace) and scope.key_id in (None, key_id)


def can_verify_ledger(caller: Caller) -> bool:
    """The hash-chain check covers every workspace's events: admins and auditors only."""
    return caller.role in _LEDGER_VERIFIERS
