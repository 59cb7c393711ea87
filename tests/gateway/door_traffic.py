"""A request served by the running gateway's core as another door hands it over: the chat
door's reading of a body, named as coming through ``api``. The doors of other client APIs
(the Anthropic Messages door, ...) are translators onto this same core (router/doors/), so
what the books, explain, spend and the console make of a request's door can be tested before
each door exists."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import orjson

from ledger.events import Api
from router.doors.chat import HeaderNarrowing, parse_body, to_core
from router.request.call import Caller
from tests.gateway.harness import Gateway


async def served_through(gw: Gateway, api: Api, body: dict[str, Any], **requirements: Any) -> str:
    """Serve ``body`` (a chat completions body, buffered) as a request that came through
    ``api``, from the gateway's own key in workspace acme, with ``requirements`` beside what
    the chat door reads (what that door's own reading would add, e.g. ``cache_writes``);
    its request id."""
    workspace = gw.config.workspace("acme")
    assert workspace is not None
    core = to_core(parse_body(orjson.dumps(body)), HeaderNarrowing(), workspace)
    needs = core.requirements.model_copy(update=requirements)
    request_id = f"req_{uuid.uuid4().hex}"
    caller = Caller(key_id=gw.key_id, workspace=workspace, role="client")
    await gw.app_state.gateway.complete(
        caller, dataclasses.replace(core, api=api, requirements=needs), request_id
    )
    return request_id
