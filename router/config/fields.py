"""Field types shared by the config models: literals, names, money, env refs, the frozen base."""

from __future__ import annotations

import collections.abc as cabc
import os
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
)
from pydantic_core import PydanticCustomError

from ledger.events import RETENTION_PATTERN, FailureClass

Driver = Literal["openai", "anthropic"]
BudgetWindow = Literal["day", "month", "total"]
# How a mapping's upstream continues a partial assistant message: not at all; a trailing
# assistant message it continues natively (Anthropic); a `prefix: true` flag on that message
# (DeepSeek, Mistral); `continue_final_message` in the body (vLLM).
ResumeMode = Literal["none", "assistant_prefill", "prefix_flag", "continue_final_message"]
"""How a mapping's upstream continues a partial assistant message (contract §5, "Resume")."""
# The two conventions of OpenAI-compatible servers: an Anthropic endpoint knows neither.
OPENAI_WIRE_RESUME: frozenset[str] = frozenset({"prefix_flag", "continue_final_message"})

# `retry_same_endpoint` takes exactly the failure classes of contract §5, as the classifier
# names them (its fields are made from the enum below).
FAILURE_CLASSES: tuple[str, ...] = tuple(c.value for c in FailureClass)

# Capabilities inferred from a request body. Other lowercase tokens are accepted too, because
# clients may require extra ones through `X-Waybill-Capabilities` (contract §3).
KNOWN_CAPABILITIES: frozenset[str] = frozenset(
    {"text", "stream", "tools", "json_schema", "vision", "responses"}
)

_Sized = TypeVar("_Sized", bound=cabc.Sized)

ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
# A proxy URL's userinfo: `${env:USER}:${env:PASSWORD}`, or one reference holding `user:password`.
CREDENTIAL_REFS = re.compile(
    r"\$\{env:(?P<user>[A-Za-z_][A-Za-z0-9_]*)\}(?::\$\{env:(?P<password>[A-Za-z_][A-Za-z0-9_]*)\})?"
)
_CAPABILITY = re.compile(r"[a-z][a-z0-9_.-]*")


class ConfigError(Exception):
    """A config that cannot be used; `errors` holds every `(path, message)` found."""

    def __init__(self, errors: cabc.Iterable[tuple[str, str]]) -> None:
        self.errors: tuple[tuple[str, str], ...] = tuple(errors)
        super().__init__("\n".join(f"{path}: {message}" for path, message in self.errors))


# --- field types -------------------------------------------------------------------------


def custom_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("config", message)


def _check_name(value: str) -> str:
    if not value or any(ch.isspace() for ch in value):
        raise custom_error("must be a non-empty name without spaces")
    return value


def _check_capability(value: str) -> str:
    if not _CAPABILITY.fullmatch(value):
        raise custom_error("must be a lowercase capability token such as 'vision'")
    return value


def _non_empty(value: _Sized) -> _Sized:
    # An AfterValidator, not Field(min_length=1): pydantic would also report a list whose
    # only item is invalid as "too short", doubling that item's error.
    if not value:
        raise custom_error("must not be empty")
    return value


def to_money(value: object) -> Decimal:
    # Via str(): the float 0.15 becomes Decimal('0.15'), not 0.1499999999999999944...
    if isinstance(value, bool) or not isinstance(value, int | float | str | Decimal):
        raise custom_error("must be a number")
    try:
        money = Decimal(str(value).strip())
    except InvalidOperation:
        raise custom_error("must be a number") from None
    if not money.is_finite():
        raise custom_error("must be a finite number")
    if money < 0:
        raise custom_error("must be >= 0")
    return money


Name = Annotated[StrictStr, AfterValidator(_check_name)]
Capability = Annotated[StrictStr, AfterValidator(_check_capability)]
Money = Annotated[Decimal, BeforeValidator(to_money)]
PositiveInt = Annotated[StrictInt, Field(gt=0)]


_RETENTION = re.compile(RETENTION_PATTERN)


def _check_retention(value: str) -> str:
    if _RETENTION.fullmatch(value) is None:
        raise custom_error("must be none, zero or a number of days such as 30d (1d to 99999d)")
    return value


# What a provider keeps of a request, or a bound on it (contract §2 `retention`).
Retention = Annotated[StrictStr, AfterValidator(_check_retention)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
NonEmpty = AfterValidator(_non_empty)


def environ_of(info: ValidationInfo) -> cabc.Mapping[str, str]:
    context = info.context
    if isinstance(context, dict) and context.get("environ") is not None:
        environ: cabc.Mapping[str, str] = context["environ"]
        return environ
    return os.environ


def resolve_env(name: str, environ: cabc.Mapping[str, str]) -> str:
    value = environ.get(name)
    if value is None:
        raise custom_error(
            f"unresolvable ${{env:{name}}}: environment variable '{name}' is not set"
        )
    if not value:
        raise custom_error(f"unresolvable ${{env:{name}}}: environment variable '{name}' is empty")
    return value


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
