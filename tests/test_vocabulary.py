"""The documents speak the code's vocabulary: no code, class or reason missing, extra or moved.

Failure classes, reason codes and data classes are defined once in ``ledger.events``, error
codes with their statuses and types in ``router.errors``, the classifier's rows in
``router.request.classify`` and the eligibility checks' order in ``router.request.selection``.
These tests read
the tables of docs/contract.md (and what README.md says of the same things) and fail when a
table and its definition differ, so the documents cannot drift from the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Final

import pytest

from ledger.events import DATA_CLASSES, Evidence, FailureClass, ReasonCode
from router.errors import ERRORS, ErrorCode, error_for_failure
from router.request.classify import RULES
from router.request.composer import POOL_REASONS
from router.request.decision import DECISION_REASONS, REFUSALS, WALK_REASONS
from router.request.selection import CHECK_ORDER

ROOT: Final = Path(__file__).resolve().parent.parent
CONTRACT: Final = (ROOT / "docs" / "contract.md").read_text()
README: Final = (ROOT / "README.md").read_text()
DOCUMENTS: Final = {
    path: (ROOT / path).read_text()
    for path in ("README.md", "docs/contract.md", "docs/architecture.md")
}

_CELL_SEPARATOR: Final = re.compile(r"(?<!\\)\|")  # `a` \| `b` stays inside its cell
_QUOTED: Final = re.compile(r"`([^`]+)`")


def section(text: str, number: int) -> str:
    """The body of the contract's section ``## N.``, up to the next section."""
    match = re.search(rf"^## {number}\. .*?(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no section {number}"
    return match.group(0)


def table(text: str, *header: str) -> list[list[str]]:
    """The rows (cells stripped) of the one table in ``text`` whose header row starts with
    ``header``."""
    found = []
    for block in re.findall(r"(?:^\|.*\n)+", text, re.MULTILINE):
        rows = [
            [cell.strip() for cell in _CELL_SEPARATOR.split(line.strip()[1:-1])]
            for line in block.splitlines()
        ]
        if tuple(rows[0][: len(header)]) == header:
            found.append(rows[2:])  # below the header and its |---| line
    assert len(found) == 1, f"{len(found)} tables headed {header}"
    return found[0]


def quoted(cell: str) -> list[str]:
    return _QUOTED.findall(cell)


def row(rows: list[list[str]], first: str) -> list[str]:
    """The row whose first cell is ``first``."""
    matching = [r for r in rows if r[0] == first]
    assert len(matching) == 1, f"{len(matching)} rows {first}"
    return matching[0]


# --- error codes (router.errors) ------------------------------------------------------------


def test_the_contract_error_table_is_router_errors_row_for_row() -> None:
    documented = [
        (int(status), code, *quoted(error_type))
        for status, codes, error_type, _when in table(section(CONTRACT, 3), "HTTP", "`code`")
        for code in quoted(codes)
    ]
    defined = [(r.status, r.code.value, r.error_type) for r in ERRORS]
    assert documented == defined
    assert {code for _, code, _ in documented} == {code.value for code in ErrorCode}


def _calls(name: str) -> list[tuple[Path, ast.Call]]:
    """Every call of a function called ``name`` in the gateway's code."""
    found = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if called == name:
                    found.append((path.relative_to(ROOT), node))
    return found


def test_errors_are_built_only_by_router_errors_with_statuses_from_its_table() -> None:
    built_elsewhere = [str(p) for p, _ in _calls("GatewayError") if p != Path("router/errors.py")]
    assert built_elsewhere == []
    statuses = {
        keyword.value.value
        for _, call in _calls("invalid_request")
        for keyword in call.keywords
        if keyword.arg == "status" and isinstance(keyword.value, ast.Constant)
    }
    assert statuses  # the 413s and the 431, at least
    assert statuses <= {r.status for r in ERRORS if r.code is ErrorCode.INVALID_REQUEST}


# "409 `idempotency_conflict`", "`402 budget_exceeded`", "503 `a`, `b` or `c`": a status
# followed by the codes it answers with.
_ANSWERS: Final = re.compile(
    r"`(?P<status>\d{3}) (?P<code>[a-z_]+)`"
    r"|\b(?P<list_status>\d{3})\s+(?P<codes>`[a-z_]+`(?:(?:,\s+|,?\s+or\s+|,?\s+and\s+)`[a-z_]+`)*)"
)


def answers(text: str) -> list[tuple[int, str]]:
    """Every (status, code) that ``text`` says the gateway answers with."""
    found = []
    for match in _ANSWERS.finditer(text):
        if match["status"]:
            found.append((int(match["status"]), match["code"]))
        else:
            found += [(int(match["list_status"]), code) for code in quoted(match["codes"])]
    return found


@pytest.mark.parametrize("path", DOCUMENTS)
def test_every_answer_a_document_names_is_in_the_error_table(path: str) -> None:
    named = answers(DOCUMENTS[path])
    assert named, f"{path} names no answer: has the way it writes them changed?"
    assert set(named) <= {(r.status, r.code.value) for r in ERRORS}


def test_the_readme_names_the_chat_codes_and_points_to_the_full_table() -> None:
    named = {code for _, code in answers(README)}
    assert {"ledger_unavailable", "upstream_error", "deadline_exceeded"} <= named
    assert "`docs/contract.md` §3" in README


# --- failure classes (ledger.events, router.request.classify, router.errors)
# --------------------------


def test_the_contract_classifier_table_is_router_classify_row_for_row() -> None:
    rows = table(section(CONTRACT, 5), "upstream outcome", "class")
    assert len(rows) == len(RULES)
    for (outcome, class_, scope, evidence, _may_fail_over), rule in zip(rows, RULES, strict=True):
        assert quoted(class_) == [rule.failure_class.value], outcome
        assert scope.split(",")[0] == (rule.breaker_scope or "none"), outcome
        assert ("opens at once" in scope) == rule.breaker_opens_at_once, outcome
        assert ("disables it" in scope) == rule.disables_endpoint, outcome
        if rule.evidence == "trusted_not_started_else_unknown":
            assert (
                evidence.startswith("unknown; not started if") and "trust_not_started" in evidence
            )
        else:
            assert evidence == Evidence(rule.evidence).value.replace("_", " "), outcome


def test_the_contract_answer_table_names_every_failure_class_once() -> None:
    documented = [
        (*quoted(class_), int(answer.split()[0]), *quoted(answer))
        for class_, answer in table(section(CONTRACT, 5), "failure class", "answer")
    ]
    defined = []
    for failure_class in FailureClass:
        error = error_for_failure(failure_class, "")
        defined.append((failure_class.value, error.status, error.code.value))
    assert documented == defined


def test_the_gateways_own_classes_are_those_no_classifier_row_gives() -> None:
    own = re.search(r"classes are the gateway's own[^:]*:(.*?)\n\n", CONTRACT, re.DOTALL)
    assert own
    named = {token for token in quoted(own.group(1)) if token in set(FailureClass)}
    assert named == set(FailureClass) - {rule.failure_class for rule in RULES}


def test_the_readme_names_only_failure_classes_that_exist() -> None:
    classes = re.search(r"A\s+failed attempt is classified \(.*?\)", README, re.DOTALL)
    assert classes
    assert set(quoted(classes.group(0))) <= set(FailureClass)


# --- reason codes (ledger.events, router.request.selection)
# -------------------------------------------


def test_the_contract_reason_code_table_is_the_eligibility_checks_in_order() -> None:
    rows = table(section(CONTRACT, 4), "reason code", "excluded when")
    assert [quoted(code)[0] for code, _ in rows] == [code.value for code in CHECK_ORDER]
    assert set(CHECK_ORDER) | POOL_REASONS == set(ReasonCode)
    pools = re.search(r"excluded with two more codes.*?\n\n", section(CONTRACT, 4), re.DOTALL)
    assert pools and set(quoted(pools.group(0))) == {code.value for code in POOL_REASONS}


def test_the_contract_names_every_decision_reason() -> None:
    paragraph = re.search(r"with one of these reasons:(.*?`)\.\n", section(CONTRACT, 4), re.DOTALL)
    assert paragraph
    named = set(quoted(paragraph.group(1)))
    # `<class>_stops` stands for one reason per failure class that may stop a request, and
    # `retry_refused_<why>` / `resume_refused_<why>` for one per refusal named after them.
    per_class = {reason for reason in DECISION_REASONS if reason.endswith("_stops")}
    assert "<class>_stops" in named
    refusals = set(REFUSALS)
    assert refusals <= named
    expanded = {f"{plan}_refused_{why}" for plan in ("retry", "resume") for why in refusals}
    placeholders = {"<class>_stops", "<why>", "retry_refused_<why>", "resume_refused_<why>"}
    named = named - placeholders - refusals - per_class
    every = set(DECISION_REASONS) | set(WALK_REASONS)
    assert named | expanded == every - per_class


def test_the_readme_names_only_reason_codes_that_exist() -> None:
    codes = re.search(r"each excluded one gets a reason code:(.*?)\)", README, re.DOTALL)
    assert codes
    assert set(quoted(codes.group(1))) - {"..."} <= set(ReasonCode)


# --- data classes (ledger.events) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "section_number", "header", "first"),
    [
        (CONTRACT, 2, ("key", "required"), "`data_classes`"),
        (CONTRACT, 3, ("header", "meaning"), "`X-Waybill-Data-Class`"),
        (README, None, ("header", "effect"), "`X-Waybill-Data-Class`"),
    ],
    ids=["contract-endpoints", "contract-headers", "readme-headers"],
)
def test_data_class_rows_name_every_data_class_in_order(
    text: str, section_number: int | None, header: tuple[str, ...], first: str
) -> None:
    scope = text if section_number is None else section(text, section_number)
    meaning = row(table(scope, *header), first)[-1]
    assert tuple(quoted(meaning)) == DATA_CLASSES


@pytest.mark.parametrize("path", DOCUMENTS)
def test_every_data_class_order_a_document_gives_is_the_definition(path: str) -> None:
    chains = re.findall(r"`[a-z]+`(?: < `[a-z]+`)+", DOCUMENTS[path])
    assert all(tuple(quoted(chain)) == DATA_CLASSES for chain in chains), chains
