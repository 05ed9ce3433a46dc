"""Draw a :class:`~ftrun.report.timeline.Timeline` as one self-contained SVG document.

Hand-drawn rather than plotted with a library: the picture is a few lines, marks and bars, and SVG is text that
any browser (and most image viewers) opens, that a README shows, and that needs no dependency. Pure: a
timeline in, a string out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from html import escape

from ftrun.report.timeline import Mark, Timeline
from ftrun.tally import RECOVERY_PHASES

WIDTH = 960
LEFT, RIGHT = 64, 24  # margins of every panel's plot area
PLOT = WIDTH - LEFT - RIGHT
PANEL = 130  # height of a plot
GAP = 56  # room for a panel's title above it and its axis below it
ROW = 18  # height of one recovery's bar
MAX_RECOVERIES = 20  # the latest ones are drawn; the header counts all
LABEL_ROWS = 4  # rows of fault labels at the top of the world size panel
LABEL_CHAR = 5.0  # width of one character of a 9 px label, about
BAR_SHARE = 0.6  # of the plot's width, taken by the longest recovery's bar
FONT = "font-family='Helvetica, Arial, sans-serif'"
COLOURS = {"world": "#1f77b4", "rate": "#2ca02c", "loss": "#8c564b", "fault": "#d62728", "drill": "#9467bd",
           "restart": "#ff7f0e", "recovery": "#2ca02c", "grid": "#e5e5e5", "text": "#333333"}
PHASE_COLOURS = dict(zip(RECOVERY_PHASES, ("#d62728", "#ff7f0e", "#bcbd22", "#17becf", "#1f77b4", "#9467bd",
                                           "#2ca02c")))
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
"""Characters XML 1.0 does not allow (and surrogates, which no UTF-8 file holds)."""


def _xml(text: str) -> str:
    """``text`` as the content of an SVG element: escaped, each character XML does not allow a ``?``."""
    return escape(_NOT_XML.sub("?", text))


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2 or 5 times a power of ten."""
    if not high - low >= 1e-300:  # empty, or too narrow for a float's powers of ten
        high = low + 1
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step) * step
    return [round(first + i * step, 10) for i in range(int((high - first) / step + 1e-9) + 1)]


def _number(value: float) -> str:
    return f"{value:g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"


def _text(x: float, y: float, text: str, size: int = 11, anchor: str = "start", colour: str = COLOURS["text"],
          weight: str = "normal") -> str:
    return (f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' fill='{colour}' "
            f"font-weight='{weight}' {FONT}>{_xml(text)}</text>")


class _Axes:
    """One panel's plot area: data coordinates to SVG coordinates, its frame, grid and tick labels."""

    def __init__(self, top: float, x_range: tuple[float, float], y_range: tuple[float, float],
                 height: float = PANEL) -> None:
        self.top, self.height = top, height
        self.x0, self.x1 = x_range
        self.y0, self.y1 = y_range if y_range[1] > y_range[0] else (y_range[0], y_range[0] + 1)
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1

    def x(self, value: float) -> float:
        return LEFT + (value - self.x0) / (self.x1 - self.x0) * PLOT

    def y(self, value: float) -> float:
        return self.top + self.height - (value - self.y0) / (self.y1 - self.y0) * self.height

    def frame(self, title: str, x_label: str, y_label: str, y_format: Callable[[float], str] = _number) -> list[str]:
        parts = [_text(LEFT, self.top - 10, title, 13, weight="bold")]
        for tick in nice_ticks(self.y0, self.y1, 4):
            y = self.y(tick)
            parts.append(f"<line x1='{LEFT}' x2='{LEFT + PLOT}' y1='{y:.1f}' y2='{y:.1f}' stroke='{COLOURS['grid']}'/>")
            parts.append(_text(LEFT - 6, y + 4, y_format(tick), 10, "end"))
        for tick in nice_ticks(self.x0, self.x1, 8):
            x = self.x(tick)
            parts.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{self.top + self.height}' "
                         f"y2='{self.top + self.height + 4}' stroke='{COLOURS['text']}'/>")
            parts.append(_text(x, self.top + self.height + 16, _number(tick), 10, "middle"))
        parts.append(f"<rect x='{LEFT}' y='{self.top}' width='{PLOT}' height='{self.height}' fill='none' "
                     f"stroke='#999999'/>")
        parts.append(_text(LEFT + PLOT, self.top + self.height + 30, x_label, 10, "end"))
        parts.append(_text(14, self.top + self.height / 2, y_label, 10, "middle").replace(
            "<text ", f"<text transform='rotate(-90 14 {self.top + self.height / 2:.1f})' ", 1))
        return parts

    def steps(self, points: Sequence[tuple[float, float]], colour: str) -> str:
        """A line that holds each value until the next point (a world size)."""
        path = []
        for i, (t, v) in enumerate(points):
            if i:
                path.append(f"L{self.x(t):.1f},{self.y(points[i - 1][1]):.1f}")
            path.append(f"{'M' if not i else 'L'}{self.x(t):.1f},{self.y(v):.1f}")
        return f"<path d='{' '.join(path)}' fill='none' stroke='{colour}' stroke-width='2'/>"

    def line(self, points: Sequence[tuple[float, float]], colour: str) -> str:
        """A polyline through ``points`` (at most one per pixel column), with dots where they are few."""
        if len(points) > PLOT:
            points = [points[round(i * (len(points) - 1) / (PLOT - 1))] for i in range(PLOT)]
        coords = " ".join(f"{self.x(t):.1f},{self.y(v):.1f}" for t, v in points)
        dots = "".join(f"<circle cx='{self.x(t):.1f}' cy='{self.y(v):.1f}' r='2' fill='{colour}'/>"
                       for t, v in points) if len(points) <= 60 else ""
        return f"<polyline points='{coords}' fill='none' stroke='{colour}' stroke-width='1.5'/>{dots}"

    def marks(self, marks: Sequence[Mark], colour: str) -> list[str]:
        """Dashed vertical lines at ``marks``, each with its label as a tooltip."""
        return [f"<line x1='{self.x(m.time):.1f}' x2='{self.x(m.time):.1f}' y1='{self.top}' "
                f"y2='{self.top + self.height}' stroke='{colour}' stroke-dasharray='4 3'><title>{_xml(m.label)} "
                f"(+{m.time:.2f} s)</title></line>" for m in marks]

    def labels(self, marks: Sequence[tuple[Mark, str]]) -> list[str]:
        """The marks' labels at the top of the plot, each in the first of LABEL_ROWS rows where it overlaps
        no other; a label with no room left is only a tooltip."""
        rows: list[list[tuple[float, float]]] = [[] for _ in range(LABEL_ROWS)]
        parts = []
        for mark, colour in sorted(marks, key=lambda mc: mc[0].time):
            x, width = self.x(mark.time), LABEL_CHAR * len(mark.label) + 6
            left = x - width if x + width > LEFT + PLOT else x
            for row, taken in enumerate(rows):
                if all(left + width <= a or left >= b for a, b in taken):
                    taken.append((left, left + width))
                    parts.append(_text(left + 3, self.top + 12 + 12 * row, mark.label, 9, colour=colour))
                    break
        return parts


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _header(timeline: Timeline) -> list[str]:
    median = timeline.median_recovery
    recovered = (f"{_count(len(timeline.recoveries), 'recovery', 'recoveries')} in place (median {median * 1000:.0f} ms)"
                 if median is not None else "no recovery in place")
    summary = (f"{timeline.outcome}, {timeline.duration:.1f} s; {_count(timeline.workers_lost, 'worker')} lost, "
               f"{recovered}, {_count(len(timeline.restarts), 'group restart')}, {_count(len(timeline.drills), 'drill')}")
    return [_text(LEFT, 26, f"ftrun run {timeline.run_id}", 15, weight="bold"), _text(LEFT, 44, summary, 12)]


def _world_panel(timeline: Timeline, top: float) -> list[str]:
    peak = max((size for _, size in timeline.world), default=1)
    axes = _Axes(top, (0, timeline.duration), (0, max(peak + 1, peak / 0.6)))  # the labels' rows above the line
    parts = axes.frame("World size, faults and recoveries", "seconds since start", "workers", lambda v: f"{v:.0f}")
    for span in timeline.recoveries:
        x0, x1 = axes.x(span.start), axes.x(span.end)
        parts.append(f"<rect x='{x0:.1f}' y='{top}' width='{max(x1 - x0, 2):.1f}' height='{PANEL}' "
                     f"fill='{COLOURS['recovery']}' opacity='0.35'><title>{_xml(span.label)}: "
                     f"{(span.end - span.start) * 1000:.0f} ms</title></rect>")
    parts += axes.marks(timeline.faults, COLOURS["fault"]) + axes.marks(timeline.drills, COLOURS["drill"])
    parts += axes.marks(timeline.restarts, COLOURS["restart"])
    parts.append(axes.steps(timeline.world, COLOURS["world"]))
    parts += axes.labels([(m, COLOURS["fault"]) for m in timeline.faults] +
                         [(m, COLOURS["restart"]) for m in timeline.restarts])
    legend = [("world size", COLOURS["world"]), ("fault", COLOURS["fault"]), ("drill", COLOURS["drill"]),
              ("group restart", COLOURS["restart"]), ("recovery in place", COLOURS["recovery"])]
    x = LEFT + PLOT
    for name, colour in reversed(legend):
        x -= 8 + 6.2 * len(name)
        parts.append(f"<rect x='{x:.1f}' y='{top - 19}' width='10' height='10' fill='{colour}'/>")
        parts.append(_text(x + 13, top - 10, name, 10))
        x -= 14
    return parts


def _rate_panel(timeline: Timeline, top: float) -> list[str]:
    peak = max((rate for _, rate in timeline.rate), default=1.0)
    axes = _Axes(top, (0, timeline.duration), (0, peak * 1.1 or 1.0))
    parts = axes.frame("Committed steps per second", "seconds since start", "steps/s")
    parts += axes.marks(timeline.faults, COLOURS["fault"])
    if timeline.rate:
        parts.append(axes.line(timeline.rate, COLOURS["rate"]))
    else:
        parts.append(_text(LEFT + PLOT / 2, top + PANEL / 2, "no progress recorded (the run committed no step, or "
                           "ended within 5 s)", 11, "middle"))
    return parts


def _recovery_panel(timeline: Timeline, top: float) -> tuple[list[str], float]:
    shown = timeline.recoveries[-MAX_RECOVERIES:]
    height = max(len(shown), 1) * ROW + 8
    longest = max((sum(span.phases.values()) for span in shown), default=0.0) * 1000
    axes = _Axes(top, (0, longest / BAR_SHARE or 1.0), (0, 1), height)  # room for the labels right of the bars
    parts = [_text(LEFT, top - 10, f"Recoveries in place, by phase (the last {len(shown)})"
                   if len(timeline.recoveries) > len(shown) else "Recoveries in place, by phase", 13, weight="bold")]
    for tick in nice_ticks(axes.x0, axes.x1, 8):
        x = axes.x(tick)
        parts.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{top}' y2='{top + height}' stroke='{COLOURS['grid']}'/>")
        parts.append(_text(x, top + height + 14, _number(tick), 10, "middle"))
    parts.append(_text(LEFT + PLOT, top + height + 28, "milliseconds", 10, "end"))
    if not shown:
        parts.append(_text(LEFT + 6, top + ROW - 4, "none", 11))
    for i, span in enumerate(shown):
        y = top + 4 + i * ROW
        parts.append(_text(LEFT - 6, y + ROW - 7, f"+{span.start:.1f} s", 10, "end"))
        x = axes.x(0)
        for phase in RECOVERY_PHASES:
            width = axes.x(span.phases.get(phase, 0.0) * 1000) - axes.x(0)
            parts.append(f"<rect x='{x:.1f}' y='{y:.1f}' width='{width:.1f}' height='{ROW - 5}' "
                         f"fill='{PHASE_COLOURS[phase]}'><title>{phase}: {span.phases.get(phase, 0.0) * 1000:.1f} ms"
                         f"</title></rect>")
            x += width
        total = sum(span.phases.values()) * 1000
        parts.append(_text(x + 4, y + ROW - 7, f"{total:.0f} ms  {span.label}", 10))
    x = LEFT + PLOT
    for phase in reversed(RECOVERY_PHASES):
        x -= 8 + 6.2 * len(phase)
        parts.append(f"<rect x='{x:.1f}' y='{top - 19}' width='10' height='10' fill='{PHASE_COLOURS[phase]}'/>")
        parts.append(_text(x + 13, top - 10, phase, 10))
        x -= 14
    return parts, height + 36


def _loss_panel(timeline: Timeline, top: float) -> list[str]:
    steps = [step for step, _ in timeline.losses]
    values = [loss for _, loss in timeline.losses]
    low, high = min(values), max(values)
    margin = (high - low) * 0.05 or abs(high) * 0.05 or 1.0
    axes = _Axes(top, (min(steps), max(steps)), (low - margin, high + margin))
    parts = axes.frame("Loss, as the workers printed it", "step", "loss")
    parts.append(axes.line([(float(s), v) for s, v in timeline.losses], COLOURS["loss"]))
    return parts


def render_svg(timeline: Timeline) -> str:
    """The whole picture: header, world size with faults and recoveries, step rate, recovery phases, loss."""
    parts = _header(timeline)
    top = 90.0
    parts += _world_panel(timeline, top)
    top += PANEL + GAP + 10
    parts += _rate_panel(timeline, top)
    top += PANEL + GAP + 10
    recovery, used = _recovery_panel(timeline, top)
    parts += recovery
    top += used + 30
    if timeline.losses:
        parts += _loss_panel(timeline, top)
        top += PANEL + GAP
    height = int(top + 10)
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
            f"viewBox='0 0 {WIDTH} {height}'>\n<rect width='100%' height='100%' fill='white'/>\n"
            + "\n".join(parts) + "\n</svg>\n")
