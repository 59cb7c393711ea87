"""``waybill fake-provider``: the bundled fake provider, standalone, for one's own config.

It is the test kit's :class:`router.fake_provider.FakeUpstream` (the demo's providers): one
port speaks both dialects (OpenAI ``/v1/chat/completions`` and ``/v1/models``, Anthropic
``/v1/messages``), answering each request with the next fault of its plan, then its default.
With ``--admin-port`` it also serves the providers' admin report API
(:class:`router.fake_provider.FakeAdminApi`): saved report pages, or for usage what it
billed itself, so that ``waybill reconcile fetch`` runs offline against its traffic.
``python -m router.fake_provider`` is the same command. The fake provider is imported when
the command runs, not with the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

import typer

from router.cli._shared import CliError, friendly_errors

if TYPE_CHECKING:
    from router.fake_provider import Behavior, Continuation, FakeAdminApi, FakeUpstream

__all__ = ["REPORTS", "fake_provider_app", "fake_provider_command"]

# What each admin endpoint serves, by the name `--admin-report NAME=FILE` gives it.
REPORTS: Final = (
    "openai-usage",
    "openai-costs",
    "anthropic-usage",
    "anthropic-costs",
    "anthropic-analytics-usage",
    "anthropic-analytics-costs",
)

fake_provider_app = typer.Typer(
    help="Run the bundled fake provider (both dialects, faults on demand, an admin report API).",
    invoke_without_command=True,
    rich_markup_mode=None,  # as `waybill --help` (router.cli.main), run as python -m too
)


@fake_provider_app.callback()
def fake_provider_command(
    host: Annotated[str, typer.Option("--host", help="The address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", help="The port for both dialects; 0 picks a free one.")
    ] = 8900,
    name: Annotated[
        str, typer.Option("--name", help="The provider's name, echoed in its replies.")
    ] = "fake",
    models: Annotated[
        str, typer.Option("--models", help="Comma-separated model ids for GET /v1/models.")
    ] = "fake-model",
    faults: Annotated[
        list[str] | None,
        typer.Option(
            "--fault",
            help="How the next request is answered, in order (repeat it): a kind "
            "(rate_limited, server_error, stall, mid_stream_disconnect, ...) or a JSON "
            'behavior such as \'{"kind": "rate_limited", "retry_after": 2}\'.',
        ),
    ] = None,
    then: Annotated[
        str,
        typer.Option("--then", "--default", help="How every request after the faults is answered."),
    ] = "ok",
    plan: Annotated[
        str | None,
        typer.Option("--plan", help="The faults as one JSON list of behaviors (as --fault)."),
    ] = None,
    continuation: Annotated[
        str,
        typer.Option(
            "--continuation",
            help="The form of a partial assistant message continued on the OpenAI wire: "
            "none, assistant_prefill, prefix_flag or continue_final_message.",
        ),
    ] = "none",
    admin_port: Annotated[
        int | None,
        typer.Option(
            "--admin-port",
            help="Also serve the admin report API on this port (0: a free one); an "
            "endpoint's admin_base_url points there.",
        ),
    ] = None,
    admin_key: Annotated[
        str, typer.Option("--admin-key", help="The admin key the report API accepts.")
    ] = "sk-admin-fake",
    admin_reports: Annotated[
        list[str] | None,
        typer.Option(
            "--admin-report",
            help="NAME=FILE: report pages to serve (repeat it); NAME is one of "
            + ", ".join(REPORTS)
            + ". Without one, OpenAI's usage and Anthropic's analytics usage are what this "
            "fake billed, hour by hour.",
        ),
    ] = None,
    project_id: Annotated[
        str, typer.Option("--project-id", help="The OpenAI project its usage names.")
    ] = "proj_fake",
    api_key_id: Annotated[
        str, typer.Option("--api-key-id", help="The API key id its usage names.")
    ] = "key_fake",
    workspace_id: Annotated[
        str, typer.Option("--workspace-id", help="The Anthropic workspace its usage names.")
    ] = "wrkspc_fake",
) -> None:
    """Serve the fake provider until Ctrl-C; prints `listening URL` (and `admin API URL`)."""
    from router.fake_provider import FakeAdminApi, FakeUpstream, Identity

    with friendly_errors():
        upstream = FakeUpstream(
            name,
            _plan(faults or [], plan),
            _behavior(then, "--then"),
            host=host,
            port=port,
            models=[m for m in models.split(",") if m],
            continuation=_continuation(continuation),
        )
        admin = None
        if admin_port is not None:
            reports = dict(_report(spec) for spec in admin_reports or [])
            admin = FakeAdminApi(
                reports,
                admin_key=admin_key,
                host=host,
                port=admin_port,
                billed_by=upstream,
                identity=Identity(project_id, api_key_id, workspace_id),
            )
        elif admin_reports:
            raise CliError("--admin-report needs --admin-port")
        try:
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(_serve(upstream, admin))
        except OSError as error:  # the port is taken, the address not this machine's
            raise CliError(f"cannot listen on {host}: {error.strerror or error}") from None


def _behavior(text: str, flag: str) -> Behavior:
    from router.fake_provider import Behavior

    text = text.strip()
    try:
        return Behavior.from_json(json.loads(text) if text.startswith("{") else text)
    except ValueError as error:  # a JSONDecodeError is one
        raise CliError(f"{flag}: {error}") from None


def _plan(faults: list[str], plan: str | None) -> list[Behavior]:
    behaviors = [_behavior(fault, "--fault") for fault in faults]
    if plan is not None:
        try:
            items = json.loads(plan)
        except ValueError as error:
            raise CliError(f"--plan: {error}") from None
        if not isinstance(items, list):
            raise CliError("--plan: a JSON list of behaviors")
        behaviors += [_behavior(json.dumps(item), "--plan") for item in items]
    return behaviors


def _continuation(text: str) -> Continuation:
    from router.fake_provider import CONTINUATIONS

    for form in CONTINUATIONS:
        if text == form:
            return form
    raise CliError(f"--continuation must be one of {', '.join(CONTINUATIONS)}")


def _report(spec: str) -> tuple[str, list[dict[str, Any]]]:
    """`NAME=FILE`: the buckets (or the analytics API's rows) of the pages FILE holds."""
    report, _, file = spec.partition("=")
    if report not in REPORTS or not file:
        raise CliError(f"--admin-report takes NAME=FILE, NAME one of {', '.join(REPORTS)}")
    try:
        text = Path(file).read_text()
    except OSError as error:
        raise CliError(f"cannot read {file}: {error.strerror or error}") from None
    try:  # one page, a list of pages, or a page a line (as `reconcile fetch --save` writes)
        loaded = json.loads(text)
        pages = loaded if isinstance(loaded, list) else [loaded]
    except ValueError:
        try:
            pages = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as error:
            raise CliError(f"{file}: not JSON pages: {error}") from None
    if not all(isinstance(p, dict) and isinstance(p.get("data"), list) for p in pages):
        raise CliError(f"{file}: a report page is an object with a `data` list")
    return report, [bucket for page in pages for bucket in page["data"]]


async def _serve(upstream: FakeUpstream, admin: FakeAdminApi | None) -> None:
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(upstream)
        # The first line says where to connect (the bound port when --port 0), for a parent
        # process that reads it.
        print(f"listening {upstream.root_url}", flush=True)
        if admin is not None:
            await stack.enter_async_context(admin)
            print(f"admin API {admin.root_url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
