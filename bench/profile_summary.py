"""Summarise a py-spy speedscope profile: where the samples of a gateway run went.

    .venv/bin/python bench/profile_summary.py PROFILE.speedscope.json [--top 10]

Four views of the same samples (py-spy records no idle samples, so 100 % is the time the
process was on CPU): the functions that were on CPU themselves (self time); the project's own
functions with everything they called (inclusive time, recursion counted once per sample,
the process's entry point left out); the asyncio task each sample ran in, named by its
outermost coroutine (so request handling, the projection runner, telemetry and the ledger's
appender are told apart); and self time by package.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_PROJECT = ("router/", "ledger/", "otel/")
_ENTRY_POINT = "router/cli/main.py"  # main -> serve_command -> uvicorn: in every sample
_EVENT_LOOP_STEP = "Handle._run"  # the frame above it is the running task's outermost one
_PREFIXES = (
    "site-packages/",
    f"/lib/python{sys.version_info.major}.{sys.version_info.minor}/",
    f"{Path(__file__).resolve().parent.parent}/",
)


def _short(path: str) -> str:
    """A file path without the interpreter's or the repository's prefix."""
    for marker in _PREFIXES:
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _package(short: str) -> str:
    head = short.split("/", 1)[0]
    return head.removesuffix(".py") if head else short


def _task(stack: list[tuple[str, str]]) -> str:
    names = [name for name, _ in stack]
    if names[0] != "<module>":
        # SQLAlchemy runs its sync core in greenlets: their stacks do not show the task.
        return "(a greenlet: SQLAlchemy core, task not visible)"
    if _EVENT_LOOP_STEP not in names:
        return "(the event loop itself)"
    step = len(names) - 1 - names[::-1].index(_EVENT_LOOP_STEP)
    if step + 1 >= len(stack):
        return "(the event loop itself)"
    name, file = stack[step + 1]
    return f"{name} ({file})"


def _samples(profile: dict[str, Any]) -> Iterator[tuple[list[tuple[str, str]], float]]:
    """Each sample's stack and its weight (seconds on CPU)."""
    frames = [(f["name"], _short(f.get("file") or "?")) for f in profile["shared"]["frames"]]
    for thread in profile["profiles"]:
        for stack, weight in zip(thread["samples"], thread["weights"], strict=True):
            # speedscope lists a sampled stack from the root to the leaf.
            yield [frames[i] for i in stack], float(weight)


def summarize(profile: dict[str, Any], top: int = 10) -> dict[str, Any]:
    own: Counter[tuple[str, str]] = Counter()
    inclusive: Counter[tuple[str, str]] = Counter()
    packages: Counter[str] = Counter()
    tasks: Counter[str] = Counter()
    cpu_s = 0.0
    count = 0  # py-spy samples at a fixed rate: shares of samples are shares of CPU time
    for stack, weight in _samples(profile):
        if not stack:
            continue
        cpu_s += weight
        count += 1
        own[stack[-1]] += 1
        packages[_package(stack[-1][1])] += 1
        tasks[_task(stack)] += 1
        for frame in set(stack):
            if frame[1].startswith(_PROJECT) and frame[1] != _ENTRY_POINT:
                inclusive[frame] += 1

    def rows(counter: Counter[Any]) -> list[dict[str, Any]]:
        out = []
        for key, samples in counter.most_common(top):
            name, file = key if isinstance(key, tuple) else (key, "")
            percent = round(100 * samples / max(count, 1), 1)
            out.append({"function": name, "file": file, "percent": percent})
        return out

    result: dict[str, Any] = {
        "samples": count,
        "cpu_s": round(cpu_s, 2),
        "self_top": rows(own),
        "project_inclusive_top": rows(inclusive),
        "tasks": rows(tasks),
        "packages_self": rows(packages),
    }
    result["text"] = _text(result)
    return result


def _text(result: dict[str, Any]) -> str:
    lines = [f"profile: {result['samples']} samples, {result['cpu_s']} s on CPU"]
    for title, key in (
        ("self time (the function itself on CPU)", "self_top"),
        ("inclusive time, project functions", "project_inclusive_top"),
        ("by asyncio task (outermost coroutine)", "tasks"),
        ("self time by package", "packages_self"),
    ):
        lines.append(f"  {title}:")
        for row in result[key]:
            where = f"  ({row['file']})" if row["file"] else ""
            lines.append(f"    {row['percent']:5.1f}%  {row['function']}{where}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    data = json.loads(Path(args.profile).read_text())
    sys.stdout.write(summarize(data, args.top)["text"] + "\n")


if __name__ == "__main__":
    main()
