"""Which proxy an endpoint goes through: the environment read as curl reads it, the endpoint's
``proxy:`` key, and what of either may be recorded."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from router.config import ConfigError, Endpoint, parse_config
from router.config.egress import (
    environment_proxy,
    no_proxy_matches,
    split_proxy_url,
    split_userinfo,
)

PASSWORD = "pr0xy-pa55-DO-NOT-LEAK"
TOKEN = "dXNlcjpwcjB4eS1wYTU1LURPLU5PVC1MRUFL"  # base64("user:" + PASSWORD)
NOT_A_PROXY = "must be a proxy URL such as http://proxy.example:3128, none or environment"

# --- NO_PROXY ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "port", "no_proxy", "exempt"),
    [
        ("api.example.com", 443, "example.com", True),  # a name covers the names under it
        ("example.com", 443, "example.com", True),
        ("badexample.com", 443, "example.com", False),  # ...never a longer name
        ("example.com", 443, ".example.com", True),  # a leading dot changes nothing
        ("api.example.com", 443, "*.example.com", True),
        ("API.Example.COM.", 443, "example.com", True),  # case and a trailing dot
        ("example.com", 443, "other.org, example.com", True),
        ("example.com", 443, "other.org example.com", True),  # spaces separate too
        ("anything.org", 443, "*", True),
        ("anything.org", 443, "other.org,*", True),
        ("example.com", 443, "example.com:443", True),  # a port: that port only
        ("example.com", 8443, "example.com:443", False),
        ("10.1.2.3", 80, "10.1.2.3", True),
        ("10.1.2.3", 80, "10.1.2.4", False),
        ("10.1.2.3", 80, "10.0.0.0/8", True),  # CIDR
        ("11.1.2.3", 80, "10.0.0.0/8", False),
        ("::1", 80, "::1", True),
        ("::1", 80, "[::1]", True),
        ("fd00::5", 80, "fd00::/8", True),
        ("127.0.0.1", 80, "localhost", False),  # names are never resolved
        ("example.com", 443, "", False),
        ("example.com", 443, " , ", False),
    ],
)
def test_no_proxy_matches_as_curl_does(host: str, port: int, no_proxy: str, exempt: bool) -> None:
    assert no_proxy_matches(host, port, no_proxy) is exempt


# --- the environment -----------------------------------------------------------------------

HTTPS = "https://api.example.com/v1"
HTTP = "http://10.0.0.5:8000/v1"
P, Q = "http://p:3128", "http://q:8080"


@pytest.mark.parametrize(
    ("url", "environ", "expected"),
    [
        (HTTPS, {}, None),
        (HTTPS, {"HTTPS_PROXY": P}, ("HTTPS_PROXY", P)),
        (HTTPS, {"https_proxy": P}, ("https_proxy", P)),
        # The lower-case name wins; an empty one means no proxy.
        (HTTPS, {"HTTPS_PROXY": P, "https_proxy": Q}, ("https_proxy", Q)),
        (HTTPS, {"HTTPS_PROXY": P, "https_proxy": ""}, None),
        (HTTPS, {"HTTP_PROXY": P}, None),  # an https upstream reads HTTPS_PROXY
        (HTTP, {"HTTP_PROXY": P}, ("HTTP_PROXY", P)),
        (HTTP, {"HTTPS_PROXY": P}, None),
        (HTTPS, {"ALL_PROXY": P}, None),  # not read
        (HTTPS, {"HTTPS_PROXY": "p:3128"}, ("HTTPS_PROXY", P)),  # no scheme: http://
        (HTTPS, {"HTTPS_PROXY": P, "NO_PROXY": "example.com"}, None),
        (HTTPS, {"HTTPS_PROXY": P, "no_proxy": "*"}, None),
        (HTTPS, {"HTTPS_PROXY": P, "NO_PROXY": "*", "no_proxy": ""}, ("HTTPS_PROXY", P)),
        (HTTP, {"HTTP_PROXY": P, "NO_PROXY": "10.0.0.0/16"}, None),
        (HTTP, {"HTTP_PROXY": P, "NO_PROXY": "10.0.0.5:443"}, ("HTTP_PROXY", P)),
    ],
)
def test_the_environment_names_the_proxy_for_an_upstream(
    url: str, environ: dict[str, str], expected: tuple[str, str] | None
) -> None:
    assert environment_proxy(url, environ) == expected


def test_a_proxy_url_is_only_scheme_userinfo_host_and_port() -> None:
    assert split_userinfo("http://u:p%40ss@proxy:3128/") == ("http://proxy:3128/", "u:p%40ss")
    assert split_userinfo("http://proxy:3128") == ("http://proxy:3128", None)
    assert split_proxy_url("http://proxy.corp:3128/") == ("proxy.corp", 3128)
    assert split_proxy_url("http://proxy.corp") == ("proxy.corp", 80)
    assert split_proxy_url("http://[fd00::1]:3128") == ("fd00::1", 3128)
    for bad in ("https://p:1", "socks5://p:1", "http://p:1/path", "http://p:1?q", "http://:1"):
        with pytest.raises(ValueError) as caught:
            split_proxy_url(bad)
        assert bad not in str(caught.value)


# --- the endpoint's proxy: key -----------------------------------------------------------------


def _endpoint(environ: dict[str, str] | None = None, **extra: Any) -> Endpoint:
    raw = {
        "id": "east",
        "driver": "openai",
        "base_url": HTTPS,
        "region": "us-east",
        "data_classes": ["internal"],
        **extra,
    }
    return Endpoint.model_validate(raw, context={"environ": environ or {}})


def _errors(environ: dict[str, str], proxy: object) -> list[tuple[str, str]]:
    document = {
        "endpoints": [
            {
                "id": "east",
                "driver": "openai",
                "base_url": HTTPS,
                "region": "us-east",
                "data_classes": ["internal"],
                **({} if proxy is None else {"proxy": proxy}),
            }
        ],
        "models": [
            {
                "name": "chat",
                "mappings": [
                    {
                        "endpoint": "east",
                        "model": "m",
                        "context_window": 1000,
                        "max_output_tokens": 100,
                        "price": {"input_per_mtok": 1, "output_per_mtok": 2},
                    }
                ],
            }
        ],
        "workspaces": [
            {"id": "acme", "models": ["chat"], "regions": ["us-east"], "data_class": "internal"}
        ],
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(document), environ=environ)
    assert caught.value.__cause__ is None and caught.value.__context__ is None
    return list(caught.value.errors)


def test_without_the_key_the_environment_decides_at_load() -> None:
    assert _endpoint({}).proxy is None
    proxy = _endpoint({"HTTPS_PROXY": "http://proxy.corp:3128"}).proxy
    assert proxy is not None
    assert (proxy.host, proxy.port, proxy.source) == ("proxy.corp", 3128, "environment")
    assert proxy.username is None
    exempt = {"HTTPS_PROXY": "http://proxy.corp:3128", "NO_PROXY": ".example.com"}
    assert _endpoint(exempt).proxy is None
    assert _endpoint(exempt, proxy="environment").proxy is None


def test_environment_credentials_are_percent_decoded_and_secret() -> None:
    proxy = _endpoint({"HTTPS_PROXY": "http://us%65r:p%40ss@proxy.corp:3128"}).proxy
    assert proxy is not None and proxy.username is not None and proxy.password is not None
    assert (proxy.username.get_secret_value(), proxy.password.get_secret_value()) == (
        "user",
        "p@ss",
    )


def test_the_key_beats_the_environment() -> None:
    environ = {"HTTPS_PROXY": "http://env-proxy:3128", "NO_PROXY": "example.com"}
    assert _endpoint(environ, proxy="none").proxy is None
    # A named proxy is the endpoint's own choice: NO_PROXY does not apply to it.
    proxy = _endpoint(environ, proxy="http://cfg-proxy:8080").proxy
    assert proxy is not None
    assert (proxy.address, proxy.source) == ("cfg-proxy:8080", "config")


@pytest.mark.parametrize(
    "userinfo", ["${env:PROXY_USER}:${env:PROXY_PASSWORD}", "${env:PROXY_CREDENTIALS}"]
)
def test_key_credentials_come_only_from_env_references(userinfo: str) -> None:
    environ = {
        "PROXY_USER": "user",
        "PROXY_PASSWORD": PASSWORD,
        "PROXY_CREDENTIALS": f"user:{PASSWORD}",
        "PROXY_HOST": "proxy.corp",
    }
    endpoint = _endpoint(environ, proxy=f"http://{userinfo}@${{env:PROXY_HOST}}:3128/")
    proxy = endpoint.proxy
    assert proxy is not None and proxy.username is not None and proxy.password is not None
    assert proxy.address == "proxy.corp:3128"
    assert (proxy.username.get_secret_value(), proxy.password.get_secret_value()) == (
        "user",
        PASSWORD,
    )
    for text in (repr(endpoint), str(endpoint), endpoint.model_dump_json()):
        assert PASSWORD not in text


def test_a_literal_credential_is_refused_without_being_echoed() -> None:
    errors = _errors({}, f"http://user:{PASSWORD}@proxy.corp:3128")
    assert errors == [
        ("endpoints[0].proxy", "credentials must be ${env:NAME} references, never literal")
    ]
    assert PASSWORD not in repr(errors)


@pytest.mark.parametrize(
    ("environ", "proxy", "message"),
    [
        ({}, "http://${env:NOPE}@p:1", "unresolvable ${env:NOPE}"),
        ({}, "https://p:3128", "https:// proxies are not supported"),
        ({}, "socks5://p:1080", "socks5:// proxies are not supported"),
        ({}, "http://p:3128/path", "no path or query"),
        ({}, "proxy.corp:3128", "must be a URL such as"),
        ({}, True, NOT_A_PROXY),
        (
            {"HTTPS_PROXY": f"socks5://u:{PASSWORD}@p:1080"},
            None,
            "HTTPS_PROXY (from the environment) must be an http:// proxy URL",
        ),
    ],
)
def test_an_unusable_proxy_is_reported_at_load_with_its_path(
    environ: dict[str, str], proxy: object, message: str
) -> None:
    errors = _errors(environ, proxy)
    assert [path for path, _ in errors] == ["endpoints[0].proxy"]
    assert message in errors[0][1]
    assert PASSWORD not in repr(errors)


def test_yaml_null_is_not_taken_for_none() -> None:
    text = "endpoints:\n  - {id: e, driver: openai, base_url: 'https://x.example', region: r,"
    text += " data_classes: [public], proxy: null}\nmodels: []\nworkspaces: []\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, environ={})
    assert ("endpoints[0].proxy", NOT_A_PROXY) in caught.value.errors


def test_the_summary_records_where_a_proxy_is_never_its_credentials() -> None:
    environ = {
        "PROXY_USER": "user",
        "PROXY_PASSWORD": PASSWORD,
        "HTTPS_PROXY": f"http://user:{PASSWORD}@env-proxy:3128",
    }
    document = {
        "endpoints": [
            {
                "id": name,
                "driver": "openai",
                "base_url": HTTPS,
                "region": "us-east",
                "data_classes": ["internal"],
                **extra,
            }
            for name, extra in (
                ("configured", {"proxy": "http://${env:PROXY_USER}:${env:PROXY_PASSWORD}@cfg:80"}),
                ("environment", {}),
                ("direct", {"proxy": "none"}),
            )
        ],
        "models": [
            {
                "name": "chat",
                "mappings": [
                    {
                        "endpoint": "direct",
                        "model": "m",
                        "context_window": 1000,
                        "max_output_tokens": 100,
                        "price": {"input_per_mtok": 1, "output_per_mtok": 2},
                    }
                ],
            }
        ],
        "workspaces": [
            {"id": "acme", "models": ["chat"], "regions": ["us-east"], "data_class": "internal"}
        ],
    }
    config = parse_config(yaml.safe_dump(document), environ=environ)
    summary = config.redacted_summary()
    assert [e["proxy"] for e in summary["endpoints"]] == [
        {"address": "cfg:80", "source": "config", "has_credentials": True},
        {"address": "env-proxy:3128", "source": "environment", "has_credentials": True},
        None,
    ]
    for text in (json.dumps(summary), repr(config), config.model_dump_json()):
        assert PASSWORD not in text and TOKEN not in text
