"""The workers' side of a reload (router.serving.reload): one at a time, the accepted bytes
kept whole, and a worker that cannot be asked named."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from router.serving.reload import (
    one_reload_at_a_time,
    read_accepted,
    reload_siblings,
    write_accepted,
)


async def test_a_reload_holds_the_workers_lock_until_it_ends(tmp_path: Path) -> None:
    accepted = str(tmp_path / "accepted-config")
    other = os.open(accepted + ".lock", os.O_RDWR | os.O_CREAT)
    try:
        async with one_reload_at_a_time(accepted):
            with pytest.raises(BlockingIOError):  # another worker's reload waits
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once it ended
    finally:
        os.close(other)


def test_the_accepted_config_is_absent_until_written_then_whole(tmp_path: Path) -> None:
    accepted = str(tmp_path / "accepted-config")
    assert read_accepted(accepted) is None
    write_accepted(accepted, b"generation: a\n")
    write_accepted(accepted, b"generation: b\n")
    assert read_accepted(accepted) == b"generation: b\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accepted-config"]


async def test_a_worker_that_cannot_be_reached_is_named(tmp_path: Path) -> None:
    missing = await reload_siblings((str(tmp_path / "w1.sock"),), "test-2")
    assert missing == ["worker 1 could not be reached (ConnectError)"]
    assert await reload_siblings((), "test-2") == []
