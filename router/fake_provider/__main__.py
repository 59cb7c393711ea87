"""Run the fake upstream standalone: `python -m router.fake_provider --port 8900`.

The first line on stdout is `listening http://HOST:PORT` (with the bound port when
`--port 0`), so a parent process can read where to connect. SIGINT / SIGTERM stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys

from router.fake_provider._continuation import CONTINUATIONS, parse_continuation
from router.fake_provider.behavior import Behavior
from router.fake_provider.server import FakeUpstream


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m router.fake_provider",
        description="Fault-injecting fake OpenAI / Anthropic provider.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900, help="0 picks a free port")
    parser.add_argument("--name", default="fake", help="upstream name, echoed in replies")
    parser.add_argument(
        "--models", default="fake-model", help="comma-separated ids for GET /v1/models"
    )
    parser.add_argument("--plan", default="[]", help="JSON list of behaviors")
    parser.add_argument("--default", default='{"kind": "ok"}', help="JSON behavior")
    parser.add_argument(
        "--continuation",
        default="none",
        choices=CONTINUATIONS,
        help="the form of partial assistant message continued on the OpenAI wire",
    )
    return parser.parse_args(argv)


async def _serve(upstream: FakeUpstream) -> None:
    await upstream.astart()
    print(f"listening {upstream.root_url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await upstream.aclose()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        items = json.loads(args.plan)
        if not isinstance(items, list):
            raise ValueError("--plan: a JSON list of behaviors")
        plan = [Behavior.from_json(item) for item in items]
        default = Behavior.from_json(json.loads(args.default))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    upstream = FakeUpstream(
        args.name,
        plan,
        default,
        host=args.host,
        port=args.port,
        models=[m for m in args.models.split(",") if m],
        continuation=parse_continuation(args.continuation),
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(upstream))
    return 0


if __name__ == "__main__":
    sys.exit(main())
