"""Who may read and do what (contract §3 roles), as pure functions of the authenticated caller.

- ``client``: only the requests made with its own key;
- ``auditor`` and ``finance``: everything in their workspace;
- ``admin``: every workspace.

A request, settlement or reconciliation the caller may not read is answered exactly like one
that does not exist (404, never 403), and lists are narrowed by the same scope, so nothing of
another workspace (or, for a client, of another key) leaks through either. A role this
module does not know gets the narrowest scope, a client's.

The API (``router.http.queries``, ``router.http.spend``, ``router.http.reconcile``,
``router.http.proofs``) and the console (``router.http.console``) both ask here: one rule, one
place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ledger.views.spend_queries import SpendScope
from router.request.gateway import Caller

__all__ = [
    "ReadScope",
    "can_import_provider_report",
    "can_read_reconciliation",
    "can_read_request",
    "can_reconcile",
    "can_settle",
    "can_use_console",
    "can_verify_ledger",
    "narrowed",
    "read_scope",
    "spend_scope",
]

_WORKSPACE_READERS: Final = frozenset({"auditor", "finance"})
_LEDGER_VERIFIERS: Final = frozenset({"admin", "auditor"})
_SETTLERS: Final = frozenset({"admin", "finance"})
_RECONCILERS: Final = frozenset({"admin", "finance"})
_CONSOLE_ROLES: Final = frozenset({"admin", "auditor", "finance"})


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


def narrowed(caller: Caller, workspace: str | None, key_id: str | None) -> ReadScope | None:
    """The workspace and key a search for ``workspace`` and ``key_id`` (None: any) may cover:
    the caller's scope, narrowed further by what it asked; None when what it asked lies
    wholly outside its scope (the answer is then an empty list, as for no match)."""
    scope = read_scope(caller)
    if scope.workspace is not None and workspace not in (None, scope.workspace):
        return None
    if scope.key_id is not None and key_id not in (None, scope.key_id):
        return None
    return ReadScope(workspace=scope.workspace or workspace, key_id=scope.key_id or key_id)


def spend_scope(caller: Caller, workspace: str | None = None) -> SpendScope:
    """What spend, budgets and settlements the caller may see. An admin may narrow to one
    ``workspace``; nobody may widen their scope (another workspace asked for is ignored)."""
    scope = read_scope(caller)
    chosen = scope.workspace if scope.workspace is not None else workspace
    return SpendScope(workspace=chosen, key_id=scope.key_id)


def can_read_request(caller: Caller, workspace: str, key_id: str) -> bool:
    """May ``caller`` read the request made in ``workspace`` with the key ``key_id``?"""
    scope = read_scope(caller)
    return scope.workspace in (None, workspace) and scope.key_id in (None, key_id)


def can_verify_ledger(caller: Caller) -> bool:
    """The hash-chain check covers every workspace's events: admins and auditors only."""
    return caller.role in _LEDGER_VERIFIERS


def can_settle(caller: Caller) -> bool:
    """Settling unknown usage by hand: admin and finance keys."""
    return caller.role in _SETTLERS


def can_reconcile(caller: Caller) -> bool:
    """Importing and reading reconciliations: admin and finance keys."""
    return caller.role in _RECONCILERS


def can_read_reconciliation(caller: Caller, report_workspace: str | None) -> bool:
    """A reconciler reads the reports of its own scope: a finance key its workspace's (an
    admin's report spans every workspace, ``report_workspace`` None); an admin every one."""
    scope = read_scope(caller)
    return can_reconcile(caller) and scope.workspace in (None, report_workspace)


def can_import_provider_report(caller: Caller) -> bool:
    """A provider report's buckets count every workspace's traffic on an identity: only a
    caller who sees every workspace (an admin) imports one."""
    return can_reconcile(caller) and read_scope(caller).workspace is None


def can_use_console(caller: Caller) -> bool:
    """The console is for the people who ask the ledger questions: admin, auditor and
    finance keys. A client key calls the API."""
    return caller.role in _CONSOLE_ROLES
