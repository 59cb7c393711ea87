"""The failure classifier against contract §5's table, row by row."""

from __future__ import annotations

import pytest

from ledger.events import Evidence, FailureClass
from router.request.classify import MAX_RETRY_AFTER_MS, RULES, UpstreamOutcome, classify


def _c(trust: bool = False, **facts: object):
    return classify(UpstreamOutcome(**facts), trust_not_started=trust)  # type: ignore[arg-type]


def test_429_rate_limit_is_rate_limited_opens_endpoint_breaker_at_once_and_may_fail_over():
    c = _c(http_status=429, error_code="rate_limit_exceeded", retry_after_ms=2000)
    assert c.failure_class is FailureClass.RATE_LIMITED
    assert c.evidence is Evidence.NOT_STARTED
    assert (c.breaker_scope, c.breaker_opens_at_once, c.may_fail_over) == ("endpoint", True, "yes")
    assert c.retry_after_ms == 2000


def test_retry_after_is_capped_at_five_minutes():
    assert _c(http_status=429, retry_after_ms=3_600_000).retry_after_ms == MAX_RETRY_AFTER_MS


@pytest.mark.parametrize(
    "facts",
    [
        {"error_code": "insufficient_quota"},
        {"error_type": "insufficient_quota"},
        {"error_message": "You exceeded your current quota, check your billing details."},
        {"error_message": "Your credit balance is exhausted."},
    ],
)
def test_429_insufficient_quota_is_quota_exhausted_and_fails_over_only_by_policy(facts):
    c = _c(http_status=429, **facts)
    assert c.failure_class is FailureClass.QUOTA_EXHAUSTED
    assert c.evidence is Evidence.NOT_STARTED
    assert c.breaker_scope == "endpoint"
    assert c.may_fail_over == "per_on_quota_exhausted"  # on_quota_exhausted: stop by default


def test_anthropic_402_billing_error_is_quota_exhausted():
    c = _c(http_status=402, error_type="billing_error", error_message="credit balance too low")
    assert c.failure_class is FailureClass.QUOTA_EXHAUSTED
    assert c.may_fail_over == "per_on_quota_exhausted"


@pytest.mark.parametrize("status", [401, 403])
def test_401_and_403_are_credentials_disabling_the_endpoint(status):
    c = _c(http_status=status, error_code="invalid_api_key", error_message="Incorrect API key.")
    assert c.failure_class is FailureClass.CREDENTIALS
    assert c.disables_endpoint
    # Only while the disabling cannot be recorded does the endpoint's breaker stand in.
    assert (c.breaker_scope, c.breaker_opens_at_once) == ("endpoint", True)
    assert c.evidence is Evidence.NOT_STARTED
    assert c.may_fail_over == "per_on_credentials_error"


def test_no_other_class_disables_an_endpoint():
    others = [rule for rule in RULES if rule.failure_class is not FailureClass.CREDENTIALS]
    assert not any(rule.disables_endpoint for rule in others)


def test_403_permission_message_without_policy_is_credentials():
    c = _c(http_status=403, error_type="permission_error", error_message="no permission")
    assert c.failure_class is FailureClass.CREDENTIALS


@pytest.mark.parametrize(
    ("status", "facts"),
    [
        (400, {"error_code": "content_policy_violation"}),
        (400, {"error_code": "content_filter"}),
        (403, {"error_message": "Blocked by our usage policy."}),
        (400, {"error_message": "Output blocked by content filtering policy."}),
        (403, {"error_message": "Request denied by compliance rules."}),
    ],
)
def test_400_or_403_naming_a_policy_is_policy_denied_and_never_fails_over(status, facts):
    c = _c(http_status=status, **facts)
    assert c.failure_class is FailureClass.POLICY_DENIED
    assert c.breaker_scope is None
    assert c.evidence is Evidence.NOT_STARTED
    assert c.may_fail_over == "never"


@pytest.mark.parametrize(
    "facts",
    [
        {"error_code": "model_not_found"},
        {"error_type": "not_found_error", "error_message": "model: claude-x"},
    ],
)
def test_404_model_not_found_is_model_unavailable_opening_the_mapping_breaker(facts):
    c = _c(http_status=404, **facts)
    assert c.failure_class is FailureClass.MODEL_UNAVAILABLE
    assert (c.breaker_scope, c.breaker_opens_at_once) == ("mapping", True)
    assert c.may_fail_over == "yes"


def test_404_not_about_a_model_is_non_retryable():
    assert _c(http_status=404, error_message="no such route").failure_class is (
        FailureClass.NON_RETRYABLE
    )


@pytest.mark.parametrize(
    "facts",
    [
        {"error_code": "context_length_exceeded"},
        {"error_message": "prompt is too long: 200001 tokens > 200000 maximum"},
    ],
)
def test_400_context_length_exceeded_is_context_too_small_larger_context_only(facts):
    c = _c(http_status=400, **facts)
    assert c.failure_class is FailureClass.CONTEXT_TOO_SMALL
    assert c.breaker_scope is None
    assert c.may_fail_over == "larger_context_only"


@pytest.mark.parametrize("status", [408, 500, 502, 503, 504, 529])
def test_408_and_5xx_are_upstream_unavailable_with_unknown_evidence(status):
    c = _c(http_status=status)
    assert c.failure_class is FailureClass.UPSTREAM_UNAVAILABLE
    assert c.evidence is Evidence.UNKNOWN
    assert (c.breaker_scope, c.breaker_opens_at_once) == ("endpoint", False)
    assert c.may_fail_over == "per_on_unknown_execution"


def test_5xx_not_started_header_from_a_trusted_endpoint_is_not_started_and_may_fail_over():
    c = _c(True, http_status=503, execution_state_header="not-started")
    assert c.evidence is Evidence.NOT_STARTED
    assert c.may_fail_over == "yes"


def test_5xx_not_started_header_from_an_untrusted_endpoint_stays_unknown():
    c = _c(False, http_status=503, execution_state_header="not-started")
    assert c.evidence is Evidence.UNKNOWN
    assert c.may_fail_over == "per_on_unknown_execution"


def test_trusted_endpoint_without_the_header_stays_unknown():
    assert _c(True, http_status=500).evidence is Evidence.UNKNOWN


def test_connect_error_before_send_is_network_error_not_started():
    c = _c(transport="connect_error")
    assert (c.failure_class, c.evidence) == (FailureClass.NETWORK_ERROR, Evidence.NOT_STARTED)
    assert (c.breaker_scope, c.may_fail_over) == ("endpoint", "yes")


def test_reset_after_send_is_network_error_unknown():
    c = _c(transport="sent_then_reset")
    assert (c.failure_class, c.evidence) == (FailureClass.NETWORK_ERROR, Evidence.UNKNOWN)
    assert c.may_fail_over == "per_on_unknown_execution"


def test_timeout_before_headers_is_timeout_unknown():
    c = _c(transport="timeout_before_headers")
    assert (c.failure_class, c.evidence) == (FailureClass.TIMEOUT, Evidence.UNKNOWN)
    assert c.may_fail_over == "per_on_unknown_execution"


def test_first_token_timeout_is_timeout_unknown_on_the_endpoint():
    c = _c(transport="first_token_timeout", http_status=200)
    assert (c.failure_class, c.evidence, c.breaker_scope) == (
        FailureClass.TIMEOUT,
        Evidence.UNKNOWN,
        "endpoint",
    )


def test_broken_stream_is_network_error_unknown():
    c = _c(transport="broken_stream", http_status=200)
    assert (c.failure_class, c.evidence) == (FailureClass.NETWORK_ERROR, Evidence.UNKNOWN)


def test_response_too_large_is_started_on_the_mapping_and_may_fail_over():
    c = _c(transport="response_too_large", http_status=200)
    assert c.failure_class is FailureClass.RESPONSE_TOO_LARGE
    assert (c.evidence, c.breaker_scope, c.may_fail_over) == (Evidence.STARTED, "mapping", "yes")
    # A mapping that answers beyond the endpoint's limit will do so again: like a missing
    # model, its breaker opens on the first failure.
    assert c.breaker_opens_at_once


@pytest.mark.parametrize("status", [400, 405, 409, 422])
def test_other_4xx_is_non_retryable(status):
    c = _c(http_status=status, error_message="bad field")
    assert c.failure_class is FailureClass.NON_RETRYABLE
    assert (c.breaker_scope, c.may_fail_over) == (None, "no")


OPENAI_SCHEMA_400 = {
    "error_type": "invalid_request_error",
    "error_code": "invalid_function_parameters",
    "error_param": "tools[0].function.parameters",
    "error_message": "Invalid schema for function 'f': In context=(), 'additionalProperties' "
    "is required to be supplied and to be false.",
}


@pytest.mark.parametrize(
    "facts",
    [
        OPENAI_SCHEMA_400,
        {"error_message": "Invalid schema for function 'get_weather': schema must be an object"},
        {"error_param": "messages[1].content", "error_message": "Invalid content type."},
        {"error_message": "Invalid 'messages[1].content': string too long."},
        {"error_message": "Invalid value for 'tool_choice': unknown function 'g'."},
        {"error_message": "tools.0.custom.input_schema: JSON schema is invalid"},  # Anthropic
        {"error_message": "messages: roles must alternate between user and assistant"},
        {"error_param": "response_format", "error_message": "Invalid JSON schema."},
    ],
)
def test_a_400_naming_a_field_the_client_wrote_is_its_own_error(facts):
    c = _c(http_status=400, **facts)
    assert (c.failure_class, c.evidence) == (FailureClass.NON_RETRYABLE, Evidence.NOT_STARTED)
    assert (c.clients_own, c.breaker_scope, c.may_fail_over) == (True, None, "no")


@pytest.mark.parametrize(
    ("status", "facts"),
    [
        # The gateway's or the endpoint's own, whatever field they name: never the client's.
        (400, {"error_message": "API key not valid. Please pass a valid API key."}),
        (400, {"error_message": "Your credit balance is too low to access the API."}),
        (400, {"error_message": "This organization has been disabled."}),
        (400, {"error_param": "model", "error_message": "Invalid value for 'model'."}),
        (400, {"error_param": "max_tokens", "error_message": "Unsupported parameter: "
               "'max_tokens' is not supported with this model."}),
        (400, {"error_param": "messages", "error_message": "Invalid 'messages': this model "
               "does not support image inputs."}),
        (400, {"error_message": "messages: assistant message prefill is not supported"}),
        (400, {"error_param": "stream_options", "error_message": "Invalid 'stream_options'."}),
        # Nothing named: a proxy's bare 400, a body the gateway could not read.
        (400, {}),
        (400, {"error_message": "Bad Request"}),
        (400, {"error_message": "Unrecognized request argument supplied: foo"}),
        # Another status than 400.
        (422, OPENAI_SCHEMA_400),
        (404, OPENAI_SCHEMA_400),
    ],
)  # fmt: skip
def test_an_upstream_4xx_the_gateway_may_have_caused_is_not_blamed_on_the_client(status, facts):
    c = _c(http_status=status, **facts)
    assert c.failure_class is FailureClass.NON_RETRYABLE
    assert not c.clients_own


def test_a_policy_or_context_400_naming_the_messages_keeps_its_own_class():
    policy = _c(http_status=400, error_param="messages", error_code="content_policy_violation")
    context = _c(http_status=400, error_param="messages", error_code="context_length_exceeded")
    assert (policy.failure_class, policy.clients_own) == (FailureClass.POLICY_DENIED, False)
    assert (context.failure_class, context.clients_own) == (FailureClass.CONTEXT_TOO_SMALL, False)


def test_transport_wins_over_status():
    # A body cut after a 429's headers is still the transport fact, never a rate limit.
    assert _c(transport="response_too_large", http_status=429).failure_class is (
        FailureClass.RESPONSE_TOO_LARGE
    )


def test_an_outcome_the_table_does_not_name_is_read_as_unknown_execution():
    c = _c(http_status=302)
    assert (c.failure_class, c.evidence) == (FailureClass.UPSTREAM_UNAVAILABLE, Evidence.UNKNOWN)


def test_every_rule_has_a_readable_outcome_name_and_the_last_matches_anything():
    assert all(rule.outcome for rule in RULES)
    assert RULES[-1].matches(UpstreamOutcome())
