"""The ledger's tables, as SQLAlchemy Core metadata.

Alembic migrations (``ledger/migrations/versions``) are the only way these tables change;
this module describes the current shape for queries and must agree with the latest
migration (a test compares them).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    select,
    text,
    union_all,
)

from ledger.types import MoneyColumn

__all__ = [
    "all_request_views",
    "all_spend_attempts",
    "api_keys",
    "appends",
    "archived_streams",
    "budget_accounts",
    "budget_holds",
    "budget_open_holds",
    "budget_resolutions",
    "console_sign_outs",
    "gateway_instances",
    "idempotency_records",
    "ledger_archives",
    "ledger_head",
    "ledger_verifications",
    "metadata",
    "open_request_views",
    "open_spend_attempts",
    "projection_checkpoints",
    "request_views",
    "spend_attempts",
    "unknown_settlements",
]

metadata = MetaData()

# One row per append: its events' positions and versions from the first on, their types,
# the last one's chain hash and their canonical bytes (compressed); see ledger.store.stored.
appends = Table(
    "appends",
    metadata,
    # Assigned by the appender under the head-row lock, never by a sequence: see store.py.
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    Column("version", Integer, nullable=False),
    Column("stream_id", String(200), nullable=False),
    Column("types", Text, nullable=False),  # one character per event (ledger.store.stored)
    Column("hash", LargeBinary, nullable=False),  # the last event's chain hash (32 bytes)
    Column("payloads", LargeBinary, nullable=False),  # the hashed bytes, compressed
    CheckConstraint("version >= 1", name="ck_appends_version_positive"),
)
# Not a unique key: on PostgreSQL the table is partitioned by month (ledger.store.partitions), and
# a stream's first append is checked by the write itself (THE LOCK, in ledger.store.postgres).
# Every read of a stream asks for its rows by stream id equality (`=` or `= ANY`), and a
# stream has few rows (a request's 2 or 3) that are sorted by version after the probe; so on
# PostgreSQL a hash index, whose entries hold a 4-byte hash instead of the ~40-character id
# (bench/README.md, "Ledger size"). SQLite has no hash index: a B-tree of the id there.
Index("ix_appends_stream", appends.c.stream_id, postgresql_using="hash")
# The appends that hold a recorded reconciliation (`ReconciliationImported`, type char Q: see
# ledger.store.stored.holding, whose literal predicate this matches): the reconciliations list
# reads them newest first without scanning the ledger. A few rows, however long the ledger.
_HOLDS_A_REPORT = text("types LIKE '%Q%'")
Index(
    "ix_appends_reports",
    appends.c.position,
    postgresql_where=_HOLDS_A_REPORT,
    sqlite_where=_HOLDS_A_REPORT,
)

# One row per archived month (ledger.audit.archive): the live ledger starts after the last.
ledger_archives = Table(
    "ledger_archives",
    metadata,
    Column("month", String(7), primary_key=True),
    Column("first_position", BigInteger, nullable=False),
    Column("last_position", BigInteger, nullable=False, unique=True),
    Column("previous_hash", LargeBinary, nullable=False),
    Column("end_hash", LargeBinary, nullable=False),  # where the live ledger's chain starts
    Column("events", BigInteger, nullable=False),
    Column("file", String(200), nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("archived_at", DateTime(timezone=True), nullable=False),
)

# Each stream that has events in an archived month, at its version there: a stream goes
# on from it (a key's revocation, the config's next activation, a late settlement).
archived_streams = Table(
    "archived_streams",
    metadata,
    Column("stream_id", String(200), primary_key=True),
    Column("version", Integer, nullable=False),
)

# One row: the last appended position and hash. Every append locks it; see store.py.
ledger_head = Table(
    "ledger_head",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("position", BigInteger, nullable=False),
    Column("hash", String(64), nullable=False),
    CheckConstraint("id = 1", name="ck_ledger_head_single_row"),
)

projection_checkpoints = Table(
    "projection_checkpoints",
    metadata,
    Column("name", String(100), primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

# --- read models (projections; rebuilt from events by `waybill replay`) ---

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(200), primary_key=True),
    Column("workspace", String(200), nullable=False),
    Column("role", String(20), nullable=False),
    Column("secret_sha256", String(64), nullable=False, unique=True),
    Column("name", String(200)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("revoked_at", DateTime(timezone=True)),
    Column("budget_limit_usd", MoneyColumn),  # this key's budget, over the workspace default
    Column("budget_window", String(10)),
    Column("endpoints", Text),  # its standing endpoint scope, a JSON array; NULL: unrestricted
    Column("expires_at", DateTime(timezone=True)),  # NULL: never
    # Its own rate limits, over the workspace's key_limits; both NULL: none of its own.
    Column("requests_per_minute", Integer),
    Column("tokens_per_minute", Integer),
    Column("created_by", String(200)),  # the actor: an admin key's id, or "cli"
)

request_views = Table(
    "request_views",
    metadata,
    Column("request_id", String(200), primary_key=True),
    Column("workspace", String(200), nullable=False),
    Column("key_id", String(200), nullable=False),
    Column("model", String(200), nullable=False),
    Column("status", String(20), nullable=False),
    Column("endpoint", String(200)),
    Column("upstream_model", String(200)),
    Column("attempts", Integer, nullable=False),
    Column("reserved_usd", MoneyColumn, nullable=False),
    Column("settled_usd", MoneyColumn, nullable=False),
    Column("held_unknown_usd", MoneyColumn, nullable=False),
    Column("http_status", Integer),
    Column("error_code", String(100)),
    Column("input_tokens", BigInteger),
    Column("output_tokens", BigInteger),
    Column("duration_ms", BigInteger),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("completed_at", DateTime(timezone=True)),
    Column("last_position", BigInteger, nullable=False),
)
Index("ix_request_views_workspace_created", request_views.c.workspace, request_views.c.created_at)
# The console's pages, newest first: created_at alone (the request id, ~4 times its size, only
# breaks ties of one microsecond, which the sort after the probe does; migration 0020).
Index("ix_request_views_created", request_views.c.created_at)
# The console's status filter. Only the rare statuses (failed, partial_failure; in_progress
# rows are in open_request_views): a filter on the common one, succeeded, is served by
# ix_request_views_created as well. PostgreSQL infers the predicate from `status = 'failed'`;
# SQLite needs it stated, which ledger.views.queries.search_request_views does.
Index(
    "ix_request_views_status_created",
    request_views.c.status,
    request_views.c.created_at,
    postgresql_where=text("status <> 'succeeded'"),
    sqlite_where=text("status <> 'succeeded'"),
)
Index("ix_request_views_key_created", request_views.c.key_id, request_views.c.created_at)

# A request in flight: its view row lives here (same columns, the primary key its only
# index) until its end, when it is deleted and its `request_views` row written once: the
# end changes indexed columns, so an update there would write a second version of the row
# and of every index entry, dead until a vacuum (bench/README.md, "Ledger size").
open_request_views = Table(
    "open_request_views",
    metadata,
    *(c._copy() for c in request_views.columns),
)


# One row per attempt's hold: what it reserved, settled, or still holds as unknown usage.
spend_attempts = Table(
    "spend_attempts",
    metadata,
    Column("reservation_id", String(200), primary_key=True),
    Column("request_id", String(200), nullable=False),
    Column("attempt_id", String(200), nullable=False),
    Column("workspace", String(200), nullable=False),
    Column("key_id", String(200), nullable=False),
    Column("model_group", String(200), nullable=False),
    Column("endpoint", String(200), nullable=False),
    Column("model", String(200), nullable=False),
    # The door the request came through (BudgetReserved.api); rows from before it was
    # recorded are chat completions, the only door there was.
    Column("api", String(40), nullable=False, server_default="openai.chat_completions"),
    Column("day", String(10), nullable=False),  # UTC date of the reservation
    Column("state", String(20), nullable=False),  # held|settled|released|unknown|unknown_settled
    Column("reserved_usd", MoneyColumn, nullable=False),
    Column("settled_usd", MoneyColumn, nullable=False),
    Column("held_unknown_usd", MoneyColumn, nullable=False),
    Column("overrun_usd", MoneyColumn, nullable=False),  # settled beyond the reservation
    # What PeriodAdjusted events moved the attempt by since its period closed
    # (ledger.views.spend_queries);
    # NULL (no bytes on disk) for the attempts none moved: nearly all.
    Column("adjustment_settled_usd", MoneyColumn),
    Column("adjustment_held_unknown_usd", MoneyColumn),
    Column("adjustment_overrun_usd", MoneyColumn),
    Column("reserved_at", DateTime(timezone=True), nullable=False),
    # From the attempt's AttemptFinished: what a provider's usage export can be matched on.
    Column("upstream_request_id", String(200)),
    Column("response_id", String(200)),
    Column("input_tokens", BigInteger),
    Column("output_tokens", BigInteger),
    Column("cached_input_tokens", BigInteger),
    Column("last_position", BigInteger, nullable=False),
)
Index("ix_spend_attempts_workspace_day", spend_attempts.c.workspace, spend_attempts.c.day)
Index("ix_spend_attempts_upstream_request", spend_attempts.c.upstream_request_id)
# A Responses previous_response_id is served by the endpoint that answered it (contract §4
# response_affinity): found by the provider's response id; reconciliation also matches
# provider lines on it, of every door (ledger.finance.reconcile). Only equality lookups: a
# hash index on PostgreSQL, smaller than a B-tree of the ids.
Index("ix_spend_attempts_response", spend_attempts.c.response_id, postgresql_using="hash")
Index("ix_spend_attempts_day", spend_attempts.c.day)
# The attempts a closed period's adjustments moved, which the spend report reads apart.
Index(
    "ix_spend_attempts_adjusted",
    spend_attempts.c.reservation_id,
    postgresql_where=text("adjustment_settled_usd IS NOT NULL"),
    sqlite_where=text("adjustment_settled_usd IS NOT NULL"),
)

# An attempt's hold while it is held: as `open_request_views` for `request_views`.
open_spend_attempts = Table(
    "open_spend_attempts",
    metadata,
    *(c._copy() for c in spend_attempts.columns),
)

# What the readers query: the ended rows and the open ones, as one relation with the
# tables' columns (a row is in one of the two, never both).
all_request_views = union_all(select(request_views), select(open_request_views)).subquery(
    "all_request_views"
)
all_spend_attempts = union_all(select(spend_attempts), select(open_spend_attempts)).subquery(
    "all_spend_attempts"
)

unknown_settlements = Table(
    "unknown_settlements",
    metadata,
    Column("settlement_id", String(200), primary_key=True),
    Column("request_id", String(200), nullable=False),
    Column("attempt_id", String(200), nullable=False),
    Column("reservation_id", String(200), nullable=False),
    Column("workspace", String(200), nullable=False),
    Column("key_id", String(200), nullable=False),
    Column("endpoint", String(200), nullable=False),
    Column("model", String(200), nullable=False),
    Column("cause", String(100), nullable=False),
    Column("held_usd", MoneyColumn, nullable=False),
    Column("state", String(20), nullable=False),  # open | settled
    Column("settled_usd", MoneyColumn),
    Column("opened_at", DateTime(timezone=True), nullable=False),
    Column("settled_at", DateTime(timezone=True)),
    Column("last_position", BigInteger, nullable=False),
)
Index(
    "ix_unknown_settlements_workspace_state",
    unknown_settlements.c.workspace,
    unknown_settlements.c.state,
)
Index(
    "ix_unknown_settlements_state_opened",
    unknown_settlements.c.state,
    unknown_settlements.c.opened_at,
    unknown_settlements.c.settlement_id,
)

# --- gateway state (not a projection: the recorded answers to Idempotency-Key retries) ---

idempotency_records = Table(
    "idempotency_records",
    metadata,
    Column("workspace", String(200), primary_key=True),
    # Scoped to the API key (contract §9): another key's use of the same Idempotency-Key is an
    # independent request. The key id is no secret; the Idempotency-Key is kept as SHA-256.
    Column("key_id", String(200), primary_key=True),
    Column("key_sha256", String(64), primary_key=True),
    Column("body_sha256", String(64), nullable=False),
    Column("request_id", String(200), nullable=False),
    Column("state", String(20), nullable=False),  # in_flight | done
    Column("status_code", Integer),
    Column("content_type", String(200)),
    Column("headers", Text),
    Column("body", LargeBinary),
    # A process that dies mid-request leaves an in-flight row: after its lease another
    # request with the same key may take it over instead of waiting forever.
    Column("lease_until", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    CheckConstraint("state IN ('in_flight', 'done')", name="ck_idempotency_records_state"),
)
Index("ix_idempotency_records_expires", idempotency_records.c.expires_at)


# --- the books (contract §6): live balances, changed only in the transaction that appends the
# budget events they follow (see ledger.books.accounting and ledger.books.balances) ---

budget_accounts = Table(
    "budget_accounts",
    metadata,
    Column("account_id", String(300), primary_key=True),
    Column("kind", String(20), nullable=False),  # request | key | workspace
    Column("workspace", String(200), nullable=False),
    Column("key_id", String(200)),
    Column("window_start", String(10)),  # ISO date of the window's first day; None: total
    Column("limit_usd", MoneyColumn, nullable=False),
    Column("held_usd", MoneyColumn, nullable=False),
    Column("settled_usd", MoneyColumn, nullable=False),  # overruns included
    Column("overrun_usd", MoneyColumn, nullable=False),  # settled beyond the holds
    Column("updated_at", DateTime(timezone=True), nullable=False),
    # On PostgreSQL the migrations add CHECK (held + settled - overrun <= limit): the
    # invariant is the database's own. It is not declared here because SQLite keeps money
    # as text.
)

# Key and workspace accounts, newest window first (GET /v1/budgets, the console); a request's
# own account (one per request with a budget) is left out of it.
Index(
    "ix_budget_accounts_listed",
    budget_accounts.c.window_start.desc(),
    budget_accounts.c.account_id,
    postgresql_where=text("kind IN ('key', 'workspace')"),
    sqlite_where=text("kind IN ('key', 'workspace')"),
)

budget_holds = Table(
    "budget_holds",
    metadata,
    Column("reservation_id", String(200), primary_key=True),
    Column("request_id", String(200), nullable=False),
    # Not a unique key of its own (migration 0020): the one writer of holds derives the
    # reservation id from the attempt id (ledger.books.accounting.reservation_id, one attempt,
    # one hold), so the primary key already refuses a second hold of an attempt; the
    # derivation is tested (tests/ledger/test_books.py).
    Column("attempt_id", String(200), nullable=False),
    Column("workspace", String(200), nullable=False),
    Column("key_id", String(200), nullable=False),
    Column("endpoint", String(200), nullable=False),
    Column("model", String(200), nullable=False),
    Column("amount_usd", MoneyColumn, nullable=False),
    Column("accounts", Text, nullable=False),  # JSON list of account ids
    Column("created_at", DateTime(timezone=True), nullable=False),
)

# The holds not yet resolved: a row from the reservation until the settlement or release
# (deleted then), with the gateway incarnation that took the hold (crash recovery looks for
# the held holds of dead owners) and whether its usage became unknown. A hold whose
# reservation has no row here is resolved, and its resolution is in budget_resolutions. The
# hold itself is never updated: a hold row written once, and the short row of its open
# state written and deleted, cost the ledger less than a second version of the whole hold.
budget_open_holds = Table(
    "budget_open_holds",
    metadata,
    Column(
        "reservation_id",
        String(200),
        ForeignKey("budget_holds.reservation_id"),
        primary_key=True,
    ),
    Column("state", String(20), nullable=False),  # held | unknown
    Column("owner", String(100), nullable=False),  # the gateway incarnation that took it
    CheckConstraint("state IN ('held', 'unknown')", name="ck_budget_open_holds_state"),
)
Index("ix_budget_open_holds_state_owner", budget_open_holds.c.state, budget_open_holds.c.owner)

# One row per hold, ever: the primary key makes "every hold is resolved exactly once" a
# constraint rather than a convention.
budget_resolutions = Table(
    "budget_resolutions",
    metadata,
    Column(
        "reservation_id",
        String(200),
        ForeignKey("budget_holds.reservation_id"),
        primary_key=True,
    ),
    Column("kind", String(20), nullable=False),  # settled | released | unknown_settled
    Column("settled_usd", MoneyColumn, nullable=False),
    Column("released_usd", MoneyColumn, nullable=False),
    Column("overrun_usd", MoneyColumn, nullable=False),
    Column("resolved_at", DateTime(timezone=True), nullable=False),
    CheckConstraint(
        "kind IN ('settled', 'released', 'unknown_settled')", name="ck_budget_resolutions_kind"
    ),
)

# The console sessions signed out before their expiry (router.http.console.sessions): a session
# cookie is signed, not stored, so every gateway process asks here before taking one. Rows
# whose expiry passed are removed at each sign-out.
console_sign_outs = Table(
    "console_sign_outs",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)

# One row per run (incarnation) of a gateway: ``instance_id`` is ``<instance id>/<incarnation
# id>``, the owner of the holds it takes (ledger.books.recovery). A hold whose owner stopped
# heartbeating, or whose instance started again, was abandoned by a crash.
gateway_instances = Table(
    "gateway_instances",
    metadata,
    Column("instance_id", String(100), primary_key=True),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("heartbeat_at", DateTime(timezone=True), nullable=False),
    Column("stopped_at", DateTime(timezone=True)),
)

# One row per run of the hash-chain check (`waybill verify`, GET /v1/ledger/verify): what the
# console's Health page shows as the last verify. Outside the chain it checks, on purpose: a
# record inside it would change what the next check and the next checkpoint read.
ledger_verifications = Table(
    "ledger_verifications",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("verified_at", DateTime(timezone=True), nullable=False),
    Column("verified_by", String(200), nullable=False),  # "cli", or the API key's id
    Column("ok", Boolean, nullable=False),
    Column("checked", BigInteger, nullable=False),
    Column("head_position", BigInteger, nullable=False),
    Column("first_bad_position", BigInteger),
    Column("problem", Text),
    Column("books_ok", Boolean),  # --books: None when not asked
    Column("checkpoints_ok", Boolean),  # --checkpoints: None when not asked
)
