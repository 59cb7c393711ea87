"""``waybill serve`` with a ``checkpoints`` block (contract §2, §7): it signs the ledger's
tree into its sink on schedule, off the request path, and serves proofs of requests under
the request-reading rules."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionMessageParam

from ledger import apikeys
from ledger.audit.checkpoints import PublicKeys, generate_key
from ledger.audit.proofs import check_proof
from ledger.audit.sink import read_sink
from tests.gateway.harness import (
    ANTHROPIC_ENV,
    Route,
    closed_port,
    config_text,
    running_gateway,
)
from tests.gateway.processes import new_key, serve_process
from tests.helpers import eventually
from tests.ledger.test_cli import waybill

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


async def test_serve_takes_checkpoints_that_verify_and_serves_proofs(
    database_url: str, tmp_path: Path
) -> None:
    key = generate_key()
    key_file, public = tmp_path / "signing.key", tmp_path / "signing.pub"
    key_file.write_bytes(key.private_pem())
    public.write_bytes(key.public_pem())
    sink = tmp_path / "sink"
    block = f"{{signing_key: {key_file}, out: {sink}, every_events: 12, every_seconds: 0.2}}"
    async with running_gateway(database_url, ["east"], [Route("east")], checkpoints=block) as gw:
        request_ids = []
        for _ in range(5):
            raw = await gw.client().chat.completions.with_raw_response.create(
                model="chat", messages=MESSAGES
            )
            request_ids.append(raw.headers["x-request-id"])
        last = request_ids[-1]
        trail = await gw.events(last)
        assert trail[-1].type == "RequestCompleted"

        async def covered() -> bool:
            sizes = [e.checkpoint.size for e in read_sink(sink) if e.checkpoint]
            return bool(sizes) and max(sizes) >= trail[-1].position

        await eventually(covered, within_s=10)

        async with gw.http() as http:
            answer = await http.get(f"/v1/requests/{last}/proof")
            assert answer.status_code == 200, answer.text
            summary = check_proof(answer.content, PublicKeys([key.public]))
            assert summary.request_id == last
            assert summary.types == tuple(e.type for e in trail)
            assert summary.checkpoint.key_id == key.key_id
            # Its version range is signed with the config's key: the whole stream, provably.
            assert summary.stream_key_id == key.key_id

            wrong = await http.get(f"/v1/requests/{last}/proof", params={"size": "x1"})
            assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "size"
            early = await http.get(f"/v1/requests/{last}/proof", params={"size": "1"})
            assert early.status_code == 409
            assert early.json()["error"]["code"] == "proof_unavailable"
            unknown = await http.get("/v1/requests/req_nope/proof")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["code"] == "request_not_found"

        other = await apikeys.create_key(gw.store, "other", "admin")
        outsider = await apikeys.create_key(gw.store, "acme", "client")
        for secret in (other.secret, outsider.secret):  # another workspace, another key
            async with gw.http() as http:
                hidden = await http.get(
                    f"/v1/requests/{last}/proof", headers={"Authorization": f"Bearer {secret}"}
                )
            if secret == other.secret:  # an admin reads every workspace's requests
                assert hidden.status_code == 200
            else:
                assert hidden.status_code == 404
                assert hidden.json()["error"]["code"] == "request_not_found"

    # The gateway signed what was left when it stopped: every checkpoint it wrote holds,
    # and the ledger's CheckpointTaken events name each of them.
    entries = read_sink(sink)
    sizes = [e.checkpoint.size for e in entries if e.checkpoint]
    assert len(sizes) >= 2 and sizes == sorted(sizes)
    verified = waybill(
        "verify", "--checkpoints", str(sink), "--public-key", str(public), database_url=database_url
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"checkpoints OK: {len(set(sizes))} signed tree sizes" in verified.stdout
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        taken = await gw.store.read_stream("checkpoint")
        assert [e.data["size"] for e in taken] == sizes
        assert {e.data["sink"] for e in taken} == {str(sink.resolve())}
        # A gateway that takes no checkpoints has no proof to give.
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        async with gw.http() as http:
            none = await http.get(
                f"/v1/requests/{last}/proof", headers={"Authorization": f"Bearer {admin.secret}"}
            )
        assert none.status_code == 409 and none.json()["error"]["code"] == "proof_unavailable"


async def test_a_reload_that_adds_or_moves_the_checkpoints_block_acts_at_once(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ANTHROPIC_ENV.items():  # a reload reads ${env:...} as serve does
        monkeypatch.setenv(name, value)
    key = generate_key()
    key_file = tmp_path / "signing.key"
    key_file.write_bytes(key.private_pem())
    config_file = tmp_path / "waybill.yaml"
    routes = [Route("east")]
    async with running_gateway(sqlite_url, ["east"], routes, config_file=config_file) as gw:
        admin = await apikeys.create_key(gw.store, "acme", "admin")
        headers = {"Authorization": f"Bearer {admin.secret}"}
        for sink in (tmp_path / "first", tmp_path / "second"):
            block = f"{{signing_key: {key_file}, out: {sink}, every_seconds: 0.1}}"
            config_file.write_text(config_text(gw.upstreams, routes, checkpoints=block))
            async with gw.http() as http:
                reloaded = await http.post("/v1/admin/config/reload", headers=headers)
                assert reloaded.status_code == 200, reloaded.text
                await gw.client().chat.completions.create(model="chat", messages=MESSAGES)

            async def signed(directory: Path = sink) -> bool:
                return await asyncio.to_thread(_has_checkpoints, directory)

            await eventually(signed, within_s=10)


def _has_checkpoints(directory: Path) -> bool:
    return directory.is_dir() and any(e.checkpoint for e in read_sink(directory))


def test_serve_on_postgres_checkpoints_from_a_child_and_signs_the_rest_when_stopped(
    postgres_url: str, tmp_path: Path
) -> None:
    key = generate_key()
    key_file, public = tmp_path / "signing.key", tmp_path / "signing.pub"
    key_file.write_bytes(key.private_pem())
    public.write_bytes(key.public_pem())
    sink = tmp_path / "sink"
    config = tmp_path / "waybill.yaml"
    config.write_text(
        Path("docs/config.example.yaml").read_text()
        + f"checkpoints: {{signing_key: {key_file}, out: {sink}, every_seconds: 0.2}}\n"
    )
    process = serve_process(
        config, postgres_url, closed_port(), env={"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k"}
    )
    try:
        new_key(postgres_url)  # an event from another process: the checkpointer reads it

        def signed() -> int:
            found = [e.checkpoint.size for e in read_sink(sink, strict=False) if e.checkpoint]
            return max(found, default=0)

        deadline = time.monotonic() + 20
        while signed() < 2:  # ConfigActivated and KeyCreated
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
        # The sink's writer is a process of its own, not the gateway.
        holder = int((sink / ".lock").read_text().split()[1])
        assert holder != process.pid and Path(f"/proc/{holder}").exists()
        new_key(postgres_url)
        new_key(postgres_url)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert not Path(f"/proc/{holder}").exists() or _is_zombie(holder)
    verified = waybill(
        "verify", "--checkpoints", str(sink), "--public-key", str(public), database_url=postgres_url
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    head = waybill("verify", database_url=postgres_url).stdout
    events = int(head.split("ledger OK: ")[1].split()[0])
    assert signed() == events - 1  # everything but its own last record


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True
