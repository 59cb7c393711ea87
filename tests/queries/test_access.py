"""The read policy of contract §3's roles, as a pure function of the caller."""

from __future__ import annotations

import pytest

from router.config import Workspace
from router.http.access import ReadScope, can_read_request, can_verify_ledger, read_scope
from router.request.gateway import Caller

ACME = Workspace(id="acme", models=("chat",), regions=frozenset({"us-east"}), data_class="internal")


def caller(role: str, key_id: str = "k_me") -> Caller:
    return Caller(key_id=key_id, workspace=ACME, role=role)


@pytest.mark.parametrize(
    ("role", "scope"),
    [
        ("client", ReadScope("acme", "k_me")),
        ("auditor", ReadScope("acme", None)),
        ("finance", ReadScope("acme", None)),
        ("admin", ReadScope(None, None)),
        ("someday-a-new-role", ReadScope("acme", "k_me")),  # unknown: the narrowest
    ],
)
def test_each_role_reads_within_its_scope(role: str, scope: ReadScope) -> None:
    assert read_scope(caller(role)) == scope


@pytest.mark.parametrize(
    ("role", "own", "peer", "other_workspace"),
    [
        ("client", True, False, False),
        ("auditor", True, True, False),
        ("finance", True, True, False),
        ("admin", True, True, True),
    ],
)
def test_can_read_request(role: str, own: bool, peer: bool, other_workspace: bool) -> None:
    me = caller(role)
    assert can_read_request(me, "acme", "k_me") is own
    assert can_read_request(me, "acme", "k_peer") is peer
    assert can_read_request(me, "other", "k_me") is other_workspace


def test_only_admins_and_auditors_verify_the_ledger() -> None:
    allowed = {r for r in ("client", "auditor", "finance", "admin") if can_verify_ledger(caller(r))}
    assert allowed == {"admin", "auditor"}
