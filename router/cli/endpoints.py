"""``waybill endpoints enable ID``: lift a credentials failure's disabling (contract §5
"Disabled endpoints"), and ring the gateways' doorbell when they share a Redis."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import typer

from ledger.store import EventStore
from router.cli._shared import CliError, DatabaseUrl, out, with_store

__all__ = ["endpoints_app"]

endpoints_app = typer.Typer(
    help="Endpoints disabled after their credentials were refused (contract §5).",
    no_args_is_help=True,
)


@endpoints_app.command("enable")
def endpoints_enable(
    endpoint_id: Annotated[str, typer.Argument(help="The endpoint's id in the config.")],
    database_url: DatabaseUrl = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the event as JSON.")] = False,
) -> None:
    """Enable an endpoint a credentials failure disabled. Gateways follow on their next
    heartbeat, or at once when WAYBILL_REDIS_URL names the Redis they share."""
    import redis.asyncio as aioredis

    from ledger.endpoints import read_states, record_enabled
    from router.adapters.disabling import DOORBELL_CHANNEL, ring_doorbell

    async def work(store: EventStore) -> dict[str, Any]:
        before = await read_states(store)
        disabled = before.disabled.get(endpoint_id)
        after, enabled = await record_enabled(
            store, endpoint_id, cause="operator", actor="cli", generation=None, states=before
        )
        if enabled is None or disabled is None:
            raise CliError(f"endpoint {endpoint_id!r} is not disabled: nothing to enable")
        redis_url = os.environ.get("WAYBILL_REDIS_URL")
        if redis_url:
            client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=2.0)
            try:
                await ring_doorbell(client, DOORBELL_CHANNEL, after.version)
            finally:
                await client.aclose()
        return {**enabled.model_dump(mode="json"), "disabled": disabled.as_json()}

    enabled = with_store(database_url, work)
    if as_json:
        print(json.dumps(enabled))
        return
    refused = enabled["disabled"]
    answered = " ".join(
        str(part) for part in (refused["http_status"], refused["error_code"]) if part
    )
    out.print(
        f"enabled {endpoint_id}: disabled since {refused['disabled_at']} "
        f"(the upstream answered {answered or 'a credentials failure'})",
        highlight=False,
    )
