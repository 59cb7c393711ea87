"""An attempt's run, in a task of its own: its upstream call (the one built while its start
committed, else built now) sent under the request's deadline, and what came back — an
answer held to the shape its request demanded, a stream up to its first content, or a
failure, classified — reported to the request's mailbox, where the executor hears of it.
"""

from __future__ import annotations

import asyncio
from typing import Final

from ledger import events as ev
from router.config import Defaults
from router.drivers import DriverResult, PreparedCall, UpstreamFailure
from router.request.attempt import Attempt, AttemptRoute, Mailbox
from router.request.call import Call
from router.request.classify import Classification
from router.request.output_check import INVALID_OUTPUT, demands_a_shape, output_violation
from router.request.ports import Ports
from router.request.relay import SEAM_BROKEN, SEAM_UNVERIFIED, SeamBroken, StreamRelay
from router.request.resume import Seam
from router.request.upstream_call import attempt_binding, chat_request

__all__ = ["AttemptRunner"]

_DEADLINE: Final = Classification(
    failure_class=ev.FailureClass.DEADLINE_EXCEEDED,
    evidence=ev.Evidence.UNKNOWN,
    breaker_scope=None,
    breaker_opens_at_once=False,
    may_fail_over="no",
)


class AttemptRunner:
    """Runs one request's attempts; they report to :attr:`mailbox`."""

    __slots__ = (
        "_call",
        "_clock",
        "_config",
        "_deadline",
        "_defaults",
        "_demands_shape",
        "_relay",
        "_request_id",
        "mailbox",
    )

    def __init__(
        self,
        ports: Ports,
        call: Call,
        defaults: Defaults,
        *,
        deadline: float,
        request_id: str,
        relay: StreamRelay,
    ) -> None:
        self._config = ports.config
        self._clock = ports.clock
        self._call = call
        self._defaults = defaults
        self._deadline = deadline
        self._request_id = request_id
        self._relay = relay
        self._demands_shape = not call.stream and demands_a_shape(call.body)
        # What the attempts' tasks and the hedge timer report, in order.
        self.mailbox = Mailbox()

    def start(self, attempt: Attempt) -> None:
        attempt.task = asyncio.create_task(self._run(attempt))

    def prepare(self, route: AttemptRoute, attempt_id: str, seam: Seam | None) -> PreparedCall:
        """The attempt's upstream call, ready to send (``ValueError`` if it cannot be)."""
        endpoint = self._config.endpoint(route.choice.endpoint)
        assert endpoint is not None
        call = self._call
        remaining_s = self._deadline - self._clock.monotonic()
        binding = attempt_binding(
            endpoint, route, attempt_id, self._defaults, remaining_s, self._request_id, call
        )
        return route.driver.prepare(chat_request(call, route, seam), binding)

    async def _run(self, attempt: Attempt) -> None:
        """One attempt up to its answer (buffered) or its first content (streams)."""
        try:
            async with self._clock.timeout_at(self._deadline):
                if self._call.stream:
                    upstream = await attempt.route.driver.stream(self._upstream_call(attempt))
                    attempt.call = None  # sent: what is held for the stream's life is kept small
                    await self._relay.hold_first_content(attempt, upstream)
                else:
                    result = await attempt.route.driver.complete(self._upstream_call(attempt))
                    attempt.result = result
                    if self._demands_shape:
                        self._check_output(attempt, result)
        except UpstreamFailure as failure:
            attempt.classification, attempt.failure = failure.classification, failure
        except SeamBroken:
            attempt.classification, attempt.error_code = SEAM_BROKEN, SEAM_UNVERIFIED
        except TimeoutError:
            attempt.classification = _DEADLINE
        except Exception as error:  # a bug or the ledger: the request's own task raises it
            attempt.error = error
        self.mailbox.put(attempt)

    def _upstream_call(self, attempt: Attempt) -> PreparedCall:
        """The one built while its start committed, else built now (raising what building
        raises)."""
        return attempt.call or self.prepare(attempt.route, attempt.attempt_id, attempt.seam)

    def _check_output(self, attempt: Attempt, result: DriverResult) -> None:
        """Hold a buffered answer to the shape its request demanded (contract §5 "Output
        validation"): one that breaks it fails as ``invalid_output`` for the walk to fail
        over, or, with ``on_invalid_output: return``, is answered as it is, recorded so."""
        attempt.invalid_output = output_violation(self._call.body, result.response)
        if attempt.invalid_output is not None and self._defaults.on_invalid_output == "failover":
            attempt.classification = INVALID_OUTPUT
