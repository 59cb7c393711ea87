"""``waybill keys create|list|revoke``: API keys (contract §1, §3 "Authentication and roles")."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

import typer
from rich.markup import escape

from ledger import apikeys
from ledger.events import KeyLimits
from ledger.store import EventStore
from router.cli._shared import (
    CliError,
    ConfigFile,
    DatabaseUrl,
    err,
    friendly_errors,
    out,
    read_config,
    with_store,
)
from router.request.scope import PROVIDER_PREFIX, bad_scope_name

__all__ = ["keys_app"]

keys_app = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)


@keys_app.command("create")
def keys_create(
    workspace: Annotated[str, typer.Option("--workspace", help="Workspace id.")],
    role: Annotated[
        str, typer.Option("--role", help="client | admin | finance | auditor")
    ] = "client",
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    budget_usd: Annotated[
        str | None,
        typer.Option("--budget-usd", help="This key's own budget (overrides key_budget)."),
    ] = None,
    budget_window: Annotated[
        str, typer.Option("--budget-window", help="day | month | total")
    ] = "day",
    config_file: ConfigFile = None,
    endpoints_csv: Annotated[
        str | None,
        typer.Option(
            "--endpoints",
            help="The key's standing endpoint scope: endpoint ids and provider:NAME labels, "
            "comma-separated; every request of the key is narrowed to them.",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", help="What people call the key (shown in lists and the console)."),
    ] = None,
    expires_at: Annotated[
        str | None,
        typer.Option(
            "--expires-at",
            help="When the key stops working: an ISO 8601 date or date and time (UTC unless "
            "it has an offset); refused like a revoked key from then on.",
        ),
    ] = None,
    requests_per_minute: Annotated[
        int | None,
        typer.Option(
            "--requests-per-minute",
            min=1,
            help="This key's own limit of requests per minute (overrides key_limits).",
        ),
    ] = None,
    tokens_per_minute: Annotated[
        int | None,
        typer.Option(
            "--tokens-per-minute",
            min=1,
            help="This key's own limit of tokens per minute, worst case at admission "
            "(overrides key_limits).",
        ),
    ] = None,
) -> None:
    """Create an API key; prints its secret once. With a config (--config or
    WAYBILL_CONFIG), a workspace the config does not know is refused, and so is an
    endpoint of --endpoints it does not have."""
    endpoints = _endpoints(endpoints_csv)
    key_name = _name(name)
    expiry = _expiry(expires_at)
    limits = (
        None
        if requests_per_minute is None and tokens_per_minute is None
        else KeyLimits(requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute)
    )
    if config_file:
        with friendly_errors():
            config = read_config(config_file)
            known = [w.id for w in config.workspaces]
            if workspace not in known:
                raise CliError(
                    f"workspace {workspace!r} is not in {config_file} (it has: "
                    f"{', '.join(known) or 'none'}); its keys would be refused"
                )
            unknown = [
                name
                for name in endpoints or ()
                if not name.startswith(PROVIDER_PREFIX) and config.endpoint(name) is None
            ]
            if unknown:
                raise CliError(
                    f"--endpoints names {', '.join(map(repr, unknown))}, which {config_file} "
                    "does not have"
                )
    else:
        err.print(
            f"[yellow]warning:[/yellow] no config given: workspace {escape(workspace)!r} is "
            "not checked (a workspace the gateway's config lacks has its keys refused; "
            "pass --config to check)",
            highlight=False,
        )
    if not apikeys.is_role(role):
        err.print(f"[red]error:[/red] --role must be one of {', '.join(apikeys.ROLES)}")
        raise typer.Exit(2)
    budget: tuple[Decimal, Any] | None = None
    if budget_usd is not None:
        try:
            limit = Decimal(budget_usd)
        except InvalidOperation:
            limit = Decimal(-1)
        if not limit.is_finite() or limit < 0 or budget_window not in ("day", "month", "total"):
            err.print(
                "[red]error:[/red] --budget-usd must be a non-negative decimal and "
                "--budget-window one of day, month, total"
            )
            raise typer.Exit(2)
        budget = (limit, budget_window)

    async def work(store: EventStore) -> apikeys.NewKey:
        return await apikeys.create_key(
            store,
            workspace,
            role,
            created_by="cli",
            budget=budget,
            endpoints=endpoints,
            name=key_name,
            expires_at=expiry,
            limits=limits,
        )

    key = with_store(database_url, work)
    if as_json:
        print(
            json.dumps(
                {
                    "key_id": key.key_id,
                    "name": key.name,
                    "secret": key.secret,
                    "workspace": key.workspace,
                    "role": key.role,
                    "endpoints": list(key.endpoints) if key.endpoints is not None else None,
                    "expires_at": _instant(key.expires_at),
                    "limits": _limits(key.limits),
                }
            )
        )
        return
    out.print(f"key id:    {key.key_id}")
    if key.name is not None:
        out.print(f"name:      {escape(key.name)}", highlight=False)
    out.print(f"workspace: {key.workspace}\nrole:      {key.role}")
    if key.expires_at is not None:
        out.print(f"expires:   {_instant(key.expires_at)}")
    if key.limits is not None:
        out.print(f"limits:    {_limits_text(key.limits)}")
    if key.endpoints is not None:
        out.print(f"endpoints: {escape(', '.join(key.endpoints))}", highlight=False)
    out.print(f"secret:    {key.secret}")
    err.print("Store the secret now: Waybill keeps only its hash and cannot show it again.")


def _name(value: str | None) -> str | None:
    """``--name`` as recorded: one line of printable text, at most 200 characters; exit 2
    otherwise."""
    if value is None:
        return None
    try:
        return apikeys.key_name_of(value)
    except ValueError as error:
        err.print(f"[red]error:[/red] --name: {escape(str(error))}")
        raise typer.Exit(2) from None


def _expiry(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return apikeys.parse_expiry(value, datetime.now(UTC))
    except ValueError as error:
        err.print(f"[red]error:[/red] --expires-at: {escape(str(error))}")
        raise typer.Exit(2) from None


def _limits(limits: KeyLimits | None) -> dict[str, int] | None:
    return None if limits is None else limits.model_dump(exclude_none=True)


def _limits_text(limits: KeyLimits) -> str:
    parts = [
        f"{figure} {name.replace('_per_minute', '')}/min"
        for name, figure in limits.model_dump(exclude_none=True).items()
    ]
    return ", ".join(parts)


def _instant(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")


def _endpoints(value: str | None) -> tuple[str, ...] | None:
    """``--endpoints`` as the key's scope: sorted, each name once; exit 2 if it names no
    endpoint or an unknown provider."""
    if value is None:
        return None
    names = tuple(sorted({part.strip() for part in value.split(",") if part.strip()}))
    whys = [why for name in names if (why := bad_scope_name(name)) is not None]
    if not names or whys:
        err.print(
            "[red]error:[/red] --endpoints must name endpoint ids or provider:NAME labels"
            + (f": {escape(whys[0])}" if whys else "")
        )
        raise typer.Exit(2)
    return names


@keys_app.command("list")
def keys_list(
    workspace: Annotated[
        str | None, typer.Option("--workspace", help="Only this workspace's keys.")
    ] = None,
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List API keys, oldest first: id, name, workspace, role, state (active, revoked,
    expired), budget, endpoint scope, expiry. Never a secret."""

    async def work(store: EventStore) -> list[apikeys.KeyListing]:
        return await apikeys.list_keys(store, workspace)

    keys = with_store(database_url, work)
    if as_json:
        print(json.dumps([_listed(key) for key in keys]))
        return
    now = datetime.now(UTC)
    for key in keys:
        scope = ", ".join(key.endpoints) if key.endpoints is not None else "all"
        budget = f"{key.budget[0]} per {key.budget[1]}" if key.budget else "-"
        expiry = f"  expires {_instant(key.expires_at)}" if key.expires_at else ""
        limits = f"  limits {_limits_text(key.limits)}" if key.limits else ""
        out.print(
            escape(
                f"{key.key_id}  {key.name or '-'}  {key.workspace}  {key.role}  "
                f"{key.state(now)}  budget {budget}  endpoints {scope}{expiry}{limits}"
            ),
            highlight=False,
        )


def _listed(key: apikeys.KeyListing) -> dict[str, Any]:
    return {
        "key_id": key.key_id,
        "name": key.name,
        "workspace": key.workspace,
        "role": key.role,
        "created_at": key.created_at.isoformat(),
        "revoked": key.revoked,
        "expires_at": _instant(key.expires_at),
        "state": key.state(datetime.now(UTC)),
        "limits": _limits(key.limits),
        "budget_usd": str(key.budget[0]) if key.budget else None,
        "budget_window": key.budget[1] if key.budget else None,
        "endpoints": list(key.endpoints) if key.endpoints is not None else None,
    }


@keys_app.command("revoke")
def keys_revoke(key_id: str, database_url: DatabaseUrl = None) -> None:
    """Revoke a key; it is refused from now on."""

    async def work(store: EventStore) -> None:
        await apikeys.revoke_key(store, key_id, revoked_by="cli")

    with_store(database_url, work)
    out.print(f"revoked {key_id}")
