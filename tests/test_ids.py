"""Ids: time-ordered, unguessable, never repeated, not even by a forked child."""

from __future__ import annotations

import os
import re
import time

from router.support.ids import new_id


def test_an_id_is_its_prefix_the_time_and_sixteen_random_hex_digits() -> None:
    before = time.time_ns() // 1_000_000
    made = new_id("req")
    after = time.time_ns() // 1_000_000
    match = re.fullmatch(r"req_([0-9a-f]{12})([0-9a-f]{16})", made)
    assert match is not None
    assert before <= int(match.group(1), 16) <= after


def test_ids_do_not_repeat_across_many_pools_of_randomness() -> None:
    made = [new_id("att") for _ in range(5000)]  # ~10 reads of the system's randomness
    assert len(set(made)) == len(made)
    assert len({m[-16:] for m in made}) == len(made)


def test_a_forked_child_does_not_reuse_its_parent_s_randomness() -> None:
    new_id("req")  # the pool now holds bytes the child would otherwise inherit
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        os.write(writer, "".join(new_id("req")[-16:] for _ in range(10)).encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(child, 0)
    theirs = os.read(reader, 1000).decode()
    os.close(reader)
    ours = "".join(new_id("req")[-16:] for _ in range(10))
    assert len(theirs) == len(ours) == 160
    assert theirs != ours
