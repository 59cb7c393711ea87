"""The fault-injecting fake LLM provider that tests and `waybill demo` run over real HTTP.

`FakeUpstream` serves OpenAI `POST /v1/chat/completions`, `GET /v1/models` and Anthropic
`POST /v1/messages` (and its free `POST /v1/messages/count_tokens`) and OpenAI
`POST /v1/embeddings` on 127.0.0.1, answering each inference request with the next
`Behavior` of its plan. Its embeddings are deterministic: `embedding(input, dimensions)` is
the vector an input gets from every fake, `embedding_tokens(input)` what it bills. It bills as the
providers do: every choice of `n`, reasoning inside the output,
cached input reported, each image, audio clip or file at its `PART_TOKENS`, audio input and
an answer asked for as audio reported as audio tokens (OpenAI's usage details). On the
Anthropic wire a request asking for `thinking` gets a signed thinking block first
(`THINKING_PIECES`, billed as output). Standalone:
`python -m router.fake_provider --port 8900`. `FakeProxy` is an HTTP CONNECT proxy beside
it, with faults of its own (a refused, dropped or silent tunnel). `FakeAdminApi` serves both
providers' usage and cost report endpoints (paging, auth, 429 / 401 / 5xx faults), from
pages a test gives or, for usage, from what a `FakeUpstream` billed.
`reply_pieces` is the answer's text, piece by piece, for tests that count what was sent.

It continues a partial assistant message as its `continuation` rule says (the form it takes
on the OpenAI wire: `assistant_prefill`, `prefix_flag`, `continue_final_message`, or `none`;
a trailing assistant message always on the Anthropic wire), answering the rest of the answer
and refusing any other form with 400 `invalid_prefill`.
"""

from router.fake_provider._continuation import CONTINUATIONS, MISMATCHED_SEAM, Continuation
from router.fake_provider._embeddings import embedding
from router.fake_provider._embeddings import input_tokens as embedding_tokens
from router.fake_provider._reply import PART_TOKENS, THINKING_PIECES, reply_pieces
from router.fake_provider.admin_api import AdminRequest, FakeAdminApi, Identity
from router.fake_provider.behavior import Behavior, Kind, LineEnding
from router.fake_provider.proxy import FakeProxy, ProxyMode, RecordedConnect
from router.fake_provider.server import Billed, FakeUpstream, RecordedRequest

__all__ = [
    "CONTINUATIONS",
    "MISMATCHED_SEAM",
    "PART_TOKENS",
    "THINKING_PIECES",
    "AdminRequest",
    "Behavior",
    "Billed",
    "Continuation",
    "FakeAdminApi",
    "FakeProxy",
    "FakeUpstream",
    "Identity",
    "Kind",
    "LineEnding",
    "ProxyMode",
    "RecordedConnect",
    "RecordedRequest",
    "embedding",
    "embedding_tokens",
    "reply_pieces",
]
