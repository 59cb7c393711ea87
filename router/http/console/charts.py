"""Charts as inline SVG, drawn from plain values: no script, no library, no request.

Pure functions from numbers to markup. Colours are presentation attributes (never ``style``),
so a Content-Security-Policy without inline styles still draws them; every bar and point has
a ``<title>``, the browser's own tooltip, so the figures read without JavaScript.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from html import escape
from typing import Final

from markupsafe import Markup

__all__ = [
    "Bar",
    "LateMark",
    "TimelineBar",
    "bar_chart",
    "line_chart",
    "timeline_chart",
    "usd_format",
]

_WIDTH: Final = 420
_HEIGHT: Final = 190
_LEFT: Final = 56
_RIGHT: Final = 12
_TOP: Final = 14
_BOTTOM: Final = 30
_INK: Final = "#1f2933"
_GRID: Final = "#d9e2ec"
_BAR: Final = "#2f6fb0"
_LINE: Final = "#b4452f"
_MAX_LABELS: Final = 6
_TIMELINE_WIDTH: Final = 1100
_LATE: Final = "#8a94a6"
_OUTCOME_COLOURS: Final = {"succeeded": "#2e7d4f", "failed": "#b4452f", "in_progress": "#8a94a6"}


@dataclass(frozen=True, slots=True)
class Bar:
    label: str  # the x axis: a day
    value: Decimal | float | int | None  # None: no value that day (a line has a gap)
    tip: str  # what its tooltip says


@dataclass(frozen=True, slots=True)
class TimelineBar:
    label: str  # "#1 east/gpt-4o-mini"
    start_ms: int  # after the request was received
    duration_ms: int | None  # None: still running
    outcome: str  # succeeded | failed | in_progress
    note: str  # the failure class and evidence, or "ok"


@dataclass(frozen=True, slots=True)
class LateMark:
    label: str  # "unknown usage settled"
    at_ms: int  # after the request was received, past the axis's end


def _svg(width: int, height: int, title: str, body: list[str]) -> Markup:
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="100%" role="img" aria-label="{escape(title)}" class="chart">'
        f"<title>{escape(title)}</title>{''.join(body)}</svg>"
    )


def _axis(maximum: float, fmt: str) -> list[str]:
    """Three horizontal grid lines (0, half, top) with their values."""
    parts = []
    plot_height = _HEIGHT - _TOP - _BOTTOM
    for fraction in (0.0, 0.5, 1.0):
        y = _TOP + plot_height * (1 - fraction)
        value = fmt.format(maximum * fraction)
        parts.append(
            f'<line x1="{_LEFT}" y1="{y:.1f}" x2="{_WIDTH - _RIGHT}" y2="{y:.1f}" '
            f'stroke="{_GRID}" stroke-width="1"/>'
            f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11" '
            f'fill="{_INK}">{escape(value)}</text>'
        )
    return parts


def _x_labels(labels: Sequence[str], centre: list[float]) -> list[str]:
    step = max(1, -(-len(labels) // _MAX_LABELS))
    parts = []
    for i in range(0, len(labels), step):
        parts.append(
            f'<text x="{centre[i]:.1f}" y="{_HEIGHT - 10}" text-anchor="middle" '
            f'font-size="11" fill="{_INK}">{escape(labels[i][5:] or labels[i])}</text>'
        )
    return parts


def usd_format(top: float) -> str:
    """The axis format for dollar amounts up to ``top``: cents, or as many places as a
    sub-cent top needs for two significant digits, so that its ticks never all read $0.00."""
    places = 2
    while places < 12 and 0 < top < 10 ** (1 - places):
        places += 1
    return f"${{:.{places}f}}"


def bar_chart(title: str, bars: Sequence[Bar], *, fmt: str = "{:.0f}", usd: bool = False) -> Markup:
    """One bar per point, scaled to the largest; ``fmt`` formats the axis values (``usd``:
    dollars, to the places the largest needs)."""
    if not bars:
        return _svg(_WIDTH, _HEIGHT, title, [_empty()])
    top = max(float(b.value or 0) for b in bars) or 1.0
    if usd:
        fmt = usd_format(top)
    plot_width = _WIDTH - _LEFT - _RIGHT
    plot_height = _HEIGHT - _TOP - _BOTTOM
    slot = plot_width / len(bars)
    width = max(1.0, slot * 0.7)
    parts = _axis(top, fmt)
    centres = []
    for i, bar in enumerate(bars):
        height = plot_height * float(bar.value or 0) / top
        x = _LEFT + slot * i + (slot - width) / 2
        centres.append(x + width / 2)
        parts.append(
            f'<rect x="{x:.1f}" y="{_TOP + plot_height - height:.1f}" width="{width:.1f}" '
            f'height="{height:.1f}" fill="{_BAR}"><title>{escape(bar.tip)}</title></rect>'
        )
    parts += _x_labels([b.label for b in bars], centres)
    return _svg(_WIDTH, _HEIGHT, title, parts)


def line_chart(title: str, points: Sequence[Bar], *, fmt: str = "{:.0%}") -> Markup:
    """A line through the points that have a value (a rate, from 0 to its largest value and
    at least 10%), each at its place on the axis; a point without a value breaks the line."""
    valued = [float(p.value) for p in points if p.value is not None]
    if not valued:
        return _svg(_WIDTH, _HEIGHT, title, [_empty()])
    top = max(0.1, *valued)
    plot_width = _WIDTH - _LEFT - _RIGHT
    plot_height = _HEIGHT - _TOP - _BOTTOM
    slot = plot_width / len(points)
    parts = _axis(top, fmt)
    centres = [_LEFT + slot * (i + 0.5) for i in range(len(points))]
    runs: list[list[tuple[float, float, Bar]]] = [[]]
    for x, point in zip(centres, points, strict=True):
        if point.value is None:
            runs.append([])
            continue
        runs[-1].append((x, _TOP + plot_height * (1 - float(point.value) / top), point))
    for run in runs:
        if len(run) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in run)
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{_LINE}" stroke-width="2"/>'
            )
        for x, y, point in run:
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{_LINE}">'
                f"<title>{escape(point.tip)}</title></circle>"
            )
    parts += _x_labels([p.label for p in points], centres)
    return _svg(_WIDTH, _HEIGHT, title, parts)


def timeline_chart(
    title: str, bars: Sequence[TimelineBar], total_ms: int, late: Sequence[LateMark] = ()
) -> Markup:
    """A request's attempts on one time axis: one row each, from its start to its end. Late
    events (a settlement a minute on) are marks past a break at the axis's end, each with
    its offset, so that they never squeeze the request into the left edge."""
    row, label_width, right = 26, 220, 16
    height = _TOP + row * max(1, len(bars)) + _BOTTOM
    span = max(1, total_ms)
    width = _TIMELINE_WIDTH
    late_width = 190 if late else 0
    plot = width - label_width - right - late_width
    parts = _late_marks(late, label_width + plot, late_width, height) if late else []
    for tick in (0.0, 0.5, 1.0):
        x = label_width + plot * tick
        parts.append(
            f'<line x1="{x:.1f}" y1="{_TOP - 4}" x2="{x:.1f}" y2="{height - _BOTTOM + 4}" '
            f'stroke="{_GRID}" stroke-width="1"/>'
            f'<text x="{x:.1f}" y="{height - 10}" text-anchor="middle" font-size="11" '
            f'fill="{_INK}">{round(span * tick)} ms</text>'
        )
    for i, bar in enumerate(bars):
        y = _TOP + row * i
        start = label_width + plot * min(bar.start_ms, span) / span
        length = (span - bar.start_ms) if bar.duration_ms is None else bar.duration_ms
        length_px = max(2.0, plot * max(0, length) / span)
        colour = _OUTCOME_COLOURS.get(bar.outcome, _OUTCOME_COLOURS["in_progress"])
        tip = f"{bar.label}: {bar.note}, from {bar.start_ms} ms for {length} ms"
        parts.append(
            f'<text x="{label_width - 8}" y="{y + 15}" text-anchor="end" font-size="12" '
            f'fill="{_INK}">{escape(bar.label)}</text>'
            f'<rect x="{start:.1f}" y="{y + 3}" width="{length_px:.1f}" height="16" rx="2" '
            f'fill="{colour}"><title>{escape(tip)}</title></rect>'
            + _note(bar.note, start, start + length_px, width, y + 15)
        )
    return _svg(width, height, title, parts)


def _late_marks(late: Sequence[LateMark], left: float, room: int, height: int) -> list[str]:
    """A break (two slanted strokes) after the axis, then each late event as a diamond with
    its offset in seconds, spaced evenly: their distance in time is not drawn to scale."""
    bottom = height - _BOTTOM + 4
    gap = left + 14
    parts = [
        f'<path d="M{gap - 4:.1f},{bottom + 5} l6,-12 M{gap + 2:.1f},{bottom + 5} l6,-12" '
        f'stroke="{_INK}" stroke-width="1.5" fill="none" class="axis-break"/>'
    ]
    step = (room - 40) / max(1, len(late))
    for i, mark in enumerate(late):
        x = gap + 30 + step * i
        y = _TOP + 10
        seconds = f"+{mark.at_ms / 1000:.1f} s"
        tip = f"{mark.label}, {seconds} after the request was received"
        parts.append(
            f'<path d="M{x:.1f},{y - 7} l7,7 l-7,7 l-7,-7 z" fill="{_LATE}" class="late-mark">'
            f"<title>{escape(tip)}</title></path>"
            f'<line x1="{x:.1f}" y1="{y + 7}" x2="{x:.1f}" y2="{bottom}" stroke="{_GRID}" '
            f'stroke-dasharray="3,3"/>'
            f'<text x="{x:.1f}" y="{height - 10}" text-anchor="middle" font-size="11" '
            f'fill="{_INK}">{escape(seconds)}</text>'
            f'<text x="{x + 10:.1f}" y="{y + 4}" font-size="11" fill="{_INK}">'
            f"{escape(mark.label)}</text>"
        )
    return parts


def _note(text: str, start: float, end: float, width: int, y: float) -> str:
    """A bar's note after it, or before it where a bar reaches the right edge."""
    if end + 170 <= width:
        x, anchor = end + 6, "start"
    else:
        x, anchor = start - 6, "end"
    return (
        f'<text x="{x:.1f}" y="{y}" text-anchor="{anchor}" font-size="11" '
        f'fill="{_INK}">{escape(text)}</text>'
    )


def _empty() -> str:
    return (
        f'<text x="{_WIDTH / 2}" y="{_HEIGHT / 2}" text-anchor="middle" font-size="13" '
        f'fill="{_INK}">nothing in this range</text>'
    )
