"""The explanation as plain text: what ``waybill explain`` and ``?format=text`` print.

Pure, and working on the JSON explanation alone (see :mod:`ledger.views.explain`), so that the
text and the JSON can never tell different stories.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["render_text"]

_WIDTH: Final = 100


def render_text(explanation: Mapping[str, Any]) -> str:
    """The explanation as plain text: what ``waybill explain`` prints."""
    x = explanation
    lines = [
        f"request {x['request_id']}: {x['status']}"
        + (f" ({x['http_status']} {x['error_code']})" if x.get("error_code") else ""),
        f"model group {x['model']} · api {x['api']} · workspace {x['workspace']} · "
        f"key {x['key_id']} · config generation {x['config_generation']}",
        "",
        *textwrap.wrap(x["summary"], _WIDTH, break_on_hyphens=False),
        "",
        "candidates:",
        *_candidate_lines(x["candidates"]),
        "",
        "attempts:",
        *_attempt_lines(x["attempts"]),
        "",
        "decision path:",
        *(
            _wrapped(f"{step['position']:>6}  {step['event']:<24}{step['text']}", 32)
            for step in x["decision_path"]
        ),
    ]
    if x["budget_checks"]:
        lines += ["", "budget checks:"]
        lines += [_budget_line(check) for check in x["budget_checks"]]
    return "\n".join(lines) + "\n"


def _budget_line(check: Mapping[str, Any]) -> str:
    fields = []
    for key, value in check.items():
        if key in ("position", "event", "check"):
            continue
        if key == "accounts":
            value = ",".join(a["account_id"] for a in value) or "-"
        fields.append(f"{key}={value}")
    return _wrapped(f"{check['position']:>6}  {check['check']:<24}{' '.join(fields)}", 32)


def _wrapped(line: str, indent: int) -> str:
    return "\n".join(
        textwrap.wrap(
            line,
            _WIDTH,
            subsequent_indent=" " * indent,
            break_long_words=False,
            break_on_hyphens=False,
        )
    )


def _weight(c: Mapping[str, Any]) -> str:
    effective = c.get("effective_weight")
    return str(c["weight"]) if effective is None else f"{c['weight']} (ramping up: {effective})"


def _candidate_lines(candidates: Sequence[Mapping[str, Any]]) -> list[str]:
    if not candidates:
        return ["  (no route evaluation recorded)"]
    rows = [
        ("eval", "endpoint/model", "tier", "weight", "worst case", "eligible", "reason", "chosen")
    ]
    for c in candidates:
        reason = c["reason_code"] or ""
        if c["detail"]:
            reason += f" ({c['detail']})"
        chosen = f"yes, position {c['selection_position']}" if c["chosen"] else ""
        if c.get("preferred"):
            chosen = "yes, preferred"
        worst = c.get("worst_case_usd")
        # A composed group's levels (contract §4 "Pools"): the composer's pools, then each
        # pool's mappings, indented under the pool.
        path = c.get("group_path") or []
        name = f"{c['endpoint']}/{c['model']}"
        if c.get("pool"):
            name = f"pool {c['pool']} (prefers {name})"
        elif len(path) > 1:
            name = f"  {path[-1]}: {name}"
        rows.append(
            (
                str(c["evaluation"]),
                name,
                str(c["tier"]),
                _weight(c),
                "-" if worst is None else f"${worst}",
                "yes" if c["eligible"] else "no",
                reason,
                chosen,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _attempt_lines(attempts: Sequence[Mapping[str, Any]]) -> list[str]:
    if not attempts:
        return ["  (no attempt was made)"]
    lines = []
    for a in attempts:
        cause = a["cause"]
        if a.get("kind") == "resume":
            cause = f"resume of {a['resumed_from']} after {a['delivered_chars']} characters"
        elif a.get("kind") == "hedge":
            cause = f"hedge beside {a['hedge_of']}"
        head = (
            f"  #{a['attempt_number']} {a['attempt_id']} ({cause}) "
            f"{a['endpoint']}/{a['model']} tier {a['tier']} weight {a['weight']}: {a['status']}"
        )
        if a.get("dispatch"):
            head += f", {a['dispatch']} via {' > '.join(a['group_path'])}"
        if a["failure_class"]:
            status = f"{a['http_status']} " if a["http_status"] else ""
            head += f", {status}{a['failure_class']}"
        if a["evidence"]:
            head += f", evidence {a['evidence']}"
        if a["duration_ms"] is not None:
            head += f", {a['duration_ms']} ms"
        lines.append(_wrapped(head, 6))
        if a.get("timeouts"):
            t = a["timeouts"]
            lines.append(
                _wrapped(
                    f"      under its endpoint's timeouts (attempt {t['attempt_timeout_ms']} ms, "
                    f"first token {t['first_token_timeout_ms']} ms, stream idle "
                    f"{t['stream_idle_timeout_ms']} ms)",
                    6,
                )
            )
        if a["reservation"]:
            lines.append(
                _wrapped(
                    f"      reservation {a['reservation']}: reserved ${a['reserved_usd']}, "
                    f"settled ${a['settled_usd']}, released ${a['released_usd']}, "
                    f"held unknown ${a['held_unknown_usd']}",
                    6,
                )
            )
        failover = a["failover"]
        if failover:
            verdict = "allowed" if failover["allowed"] else "not allowed"
            rule = f" (policy {failover['policy']})" if failover.get("policy") else ""
            lines.append(
                _wrapped(
                    f"      then {failover['action']} ({verdict}): {failover['reason']}{rule}", 6
                )
            )
    return lines
