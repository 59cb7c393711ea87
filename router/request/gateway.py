"""The gateway of one config generation: what lives as long as the config does — the config,
one driver per endpoint, the breaker board, the weighted round-robin state, the first-answer
times, each model group's plan — composed into the ports (:mod:`router.request.ports`) that
each request's executor (:mod:`router.request.executor`) is given, with its own budget and
journal.

A reload retires a gateway: it finishes the requests it began (an attempt is never
redirected by a reload), then closes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from ledger.apikeys import key_stream
from ledger.events import FailureClass
from ledger.store import ANY_VERSION, EventStore
from ledger.store.db import is_unavailable
from ledger.store.outage import Outage
from ledger.support.frozen import evolve
from router.adapters.breakers import Admission, BreakerBoard, BreakerKey, Standing, Transition
from router.adapters.disabling import Disabling
from router.adapters.latency import InProcessLatency, LatencyBoard
from router.adapters.rate_counters import InProcessRateCounters, RateCounters
from router.adapters.slots import EndpointSlots, InProcessSlots
from router.config import Config, ModelGroup, Workspace
from router.drivers import Driver, driver_for
from router.request.budget import RequestBudget, StoreBalances
from router.request.call import Call, Caller, Completion, StreamingCompletion
from router.request.classify import Classification
from router.request.executor import Executor
from router.request.journal import Journal, KeyMoved
from router.request.policy import FirstAnswerTimes
from router.request.ports import Ports, SystemClock
from router.request.records import breaker_transitioned
from router.request.routing import GroupPlan, plan_for
from router.request.selection import WeightedRoundRobin
from router.support.ids import new_id

__all__ = ["Caller", "Completion", "Gateway", "KeyMoved", "StreamingCompletion"]

log = logging.getLogger("waybill.gateway")


class Gateway:
    """Everything one config generation needs to serve requests."""

    def __init__(
        self,
        config: Config,
        store: EventStore,
        breakers: BreakerBoard,
        *,
        drivers: Mapping[str, Driver] | None = None,
        rng: random.Random | None = None,
        instance_id: str | None = None,
        latency: LatencyBoard | None = None,
        slots: EndpointSlots | None = None,
        disabling: Disabling | None = None,
        rate_counters: RateCounters | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.breakers = breakers
        self.latency = latency or InProcessLatency()  # for the least_latency strategy
        # Endpoints' max_in_flight: owned by the app, shared by every config generation (a
        # retiring one's attempts still load the upstreams).
        self.slots = slots or InProcessSlots()
        # Rate limits' counters: the app's too (a window outlives a generation).
        self.rate_counters = rate_counters or InProcessRateCounters()
        # Disabled endpoints outlive a generation (one Disabling per process, the app's);
        # this generation sees those disabled for the keys it gives them.
        self.disabling = disabling or Disabling(store)
        self.disabled = self.disabling.view(config)
        self.instance_id = instance_id or new_id("gw")  # owner of the holds it takes
        self._drivers = dict(drivers) if drivers else {}
        for endpoint in config.endpoints:
            if endpoint.id not in self._drivers:
                self._drivers[endpoint.id] = driver_for(endpoint.driver)
        self.latencies = FirstAnswerTimes()
        self._background: set[asyncio.Task[None]] = set()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._plans: dict[str, GroupPlan] = {g.name: plan_for(config, g) for g in config.models}
        self._balances = StoreBalances(store)
        self._metadata = {"config_generation": config.generation}
        self._ports = Ports(
            config=config,
            drivers=self._drivers,
            breakers=_RecordedBreakers(breakers, store, config.generation),
            slots=self.slots,
            disabled=self.disabled,
            latency=self.latency,
            clock=SystemClock(),
            keep=self._keep,
            first_answers=self.latencies,
            rr=WeightedRoundRobin(),
            rng=rng or random.Random(),
            instance_id=self.instance_id,
            rate_counters=self.rate_counters,
        )

    # A reload retires this gateway: it finishes the requests it began (an attempt is never
    # redirected by a reload), then closes.
    def begin(self) -> None:
        self._active += 1
        self._idle.clear()

    def end(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    async def retire(self) -> None:
        await self._idle.wait()
        await self.aclose()

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for driver in self._drivers.values():
            await driver.aclose()
        await self.breakers.aclose()
        await self.latency.aclose()

    def driver(self, endpoint_id: str) -> Driver:
        """The driver of one of this generation's endpoints (KeyError for another)."""
        return self._drivers[endpoint_id]

    def models_for(self, workspace: Workspace) -> list[ModelGroup]:
        return [g for g in self.config.models if g.name in workspace.models]

    async def complete(self, caller: Caller, call: Call, request_id: str) -> Completion:
        """Serve a buffered request, or raise :class:`GatewayError` (already recorded)."""
        return await self._executor(caller, call, request_id).complete()

    async def stream(self, caller: Caller, call: Call, request_id: str) -> StreamingCompletion:
        """Route a streamed request up to its first content chunk; then the body follows."""
        return await self._executor(caller, call, request_id).stream()

    def _executor(self, caller: Caller, call: Call, request_id: str) -> Executor:
        """A request's executor, with the ports of this generation and its own budget and
        journal."""
        plan = self._plans[call.model_group]  # the app resolves the model group first
        narrowed = caller.narrowing(call.requirements)
        if narrowed is not call.requirements:  # the key has a standing endpoint scope
            call = evolve(call, requirements=narrowed)
        ports = self._ports
        budget = RequestBudget(
            self._balances,
            request_id=request_id,
            workspace=caller.workspace,
            key_id=caller.key_id,
            key_budget=caller.key_budget,
            model_group=call.model_group,
            request_limit=call.requirements.max_cost_usd,
            owner=self.instance_id,
            api=call.api,
        )
        requires = None  # what the first append requires: the key's stream as it was read
        if caller.key_version is not None:
            requires = {key_stream(caller.key_id): caller.key_version}
        journal = Journal(
            self.store,
            request_id,
            budget=budget,
            clock=ports.clock,
            metadata=self._metadata,
            requires=requires,
        )
        return Executor(ports, plan, caller, call, request_id, budget=budget, journal=journal)

    def _keep(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        # Work that must finish even if the client's task is cancelled (recording the end
        # of a stream the client walked away from): its own task, awaited at shutdown.
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(functools.partial(_log_failure, self.store.outage))


class _RecordedBreakers:
    """The breaker board as the executor's port: every transition a request causes is
    recorded on the ``breaker`` stream, naming the request."""

    __slots__ = ("_board", "_generation", "_quota_opened", "_store")

    def __init__(self, board: BreakerBoard, store: EventStore, generation: str) -> None:
        self._board = board
        self._store = store
        self._generation = generation
        self._quota_opened: frozenset[str] = frozenset()

    def quota_opened(self) -> frozenset[str]:
        return self._quota_opened

    def standing(
        self, keys: Sequence[BreakerKey]
    ) -> Coroutine[Any, Any, dict[BreakerKey, Standing]]:
        return self._board.standing(keys)

    async def probe_in(self, keys: Sequence[BreakerKey]) -> dict[BreakerKey, int | None]:
        views = await self._board.inspect(keys)
        return {key: view.probe_in_ms for key, view in views.items()}

    async def admit(self, key: BreakerKey, request_id: str) -> Admission:
        admission, transitions = await self._board.admit(key)
        if transitions:
            await self._record(transitions, request_id)
        return admission

    async def succeeded(
        self, keys: Sequence[BreakerKey], duration_ms: int, request_id: str
    ) -> None:
        transitions: list[Transition] = []
        for key in keys:
            transitions += await self._board.record_success(key, duration_ms=duration_ms)
        if transitions:
            await self._record(transitions, request_id)

    async def failed(
        self,
        key: BreakerKey,
        classification: Classification,
        duration_ms: int,
        request_id: str,
        workspace: str,
    ) -> bool:
        transitions = await self._board.record_failure(
            key,
            classification.failure_class.value,
            opens_at_once=classification.breaker_opens_at_once,
            retry_after_ms=classification.retry_after_ms,
            duration_ms=duration_ms,
            workspace=workspace,
        )
        if transitions:
            await self._record(transitions, request_id)
        return any(t.key == key and t.to_state == "open" for t in transitions)

    async def release_probes(self, keys: Sequence[BreakerKey]) -> None:
        for key in keys:
            await self._board.release_probe(key)

    async def _record(self, transitions: list[Transition], request_id: str) -> None:
        for t in transitions:
            if t.key.scope == "endpoint" and t.to_state == "open":
                endpoint = t.key.endpoint_id
                quota = t.failure_class == FailureClass.QUOTA_EXHAUSTED.value
                opened = self._quota_opened - {endpoint}
                self._quota_opened = opened | {endpoint} if quota else opened
        settings_for = self._board.settings_for
        events = [
            breaker_transitioned(t, settings_for(t.key), self._generation, request_id)
            for t in transitions
        ]
        await self._store.append("breaker", ANY_VERSION, events)


def _log_failure(outage: Outage, task: asyncio.Task[None]) -> None:
    error = None if task.cancelled() else task.exception()
    if error is None:
        return
    if is_unavailable(error):  # the ledger stayed away: told once, with the outage's end
        outage.not_recorded()
        return
    log.error("recording the end of a request failed", exc_info=error)
