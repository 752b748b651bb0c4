"""Small inline SVG charts (no JavaScript, no external assets: the CSP allows neither)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date
from decimal import Decimal

from markupsafe import Markup, escape

from queues.dashboard import Minute, Series
from worker.output import amount

WIDTH = 720
HEIGHT = 140
PAD = 24


def throughput(minutes: Sequence[Minute]) -> Markup:
    """Stacked bars per minute: succeeded attempts (green) under failed ones (red)."""
    if not minutes:
        return Markup("")
    peak = max((m.succeeded + m.failed for m in minutes), default=0) or 1
    slot = (WIDTH - PAD) / len(minutes)
    bar = max(1.0, slot * 0.8)
    usable = HEIGHT - PAD
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        'role="img" aria-label="attempts per minute over the last hour: succeeded and failed">',
        f'<line x1="{PAD}" y1="{usable}" x2="{WIDTH}" y2="{usable}" class="axis"/>',
        f'<text x="2" y="12" class="tick">{peak}</text>',
        f'<text x="2" y="{usable}" class="tick">0</text>',
    ]
    for i, m in enumerate(minutes):
        x = PAD + i * slot
        ok_h = usable * m.succeeded / peak
        bad_h = usable * m.failed / peak
        label = escape(f"{m.minute:%H:%M} UTC: {m.succeeded} succeeded, {m.failed} failed")
        parts.append(f"<g><title>{label}</title>")
        if ok_h:
            parts.append(
                f'<rect class="ok" x="{x:.1f}" y="{usable - ok_h:.1f}" '
                f'width="{bar:.1f}" height="{ok_h:.1f}"/>'
            )
        if bad_h:
            parts.append(
                f'<rect class="bad" x="{x:.1f}" y="{usable - ok_h - bad_h:.1f}" '
                f'width="{bar:.1f}" height="{bad_h:.1f}"/>'
            )
        parts.append("</g>")
    first, last = minutes[0].minute, minutes[-1].minute
    parts.append(f'<text x="{PAD}" y="{HEIGHT - 6}" class="tick">{first:%H:%M}</text>')
    parts.append(
        f'<text x="{WIDTH - 2}" y="{HEIGHT - 6}" class="tick" text-anchor="end">'
        f"{last:%H:%M} UTC</text>"
    )
    parts.append("</svg>")
    return Markup("".join(parts))


def bar(done: int, total: int, width: int = 240) -> Markup:
    """A progress bar as SVG (done of total)."""
    share = 0.0 if total <= 0 else min(1.0, done / total)
    return Markup(
        f'<svg class="bar" viewBox="0 0 {width} 12" width="{width}" height="12" role="img" '
        f'aria-label="{done} of {total}"><rect class="track" x="0" y="0" width="{width}" '
        f'height="12" rx="3"/><rect class="fill" x="0" y="0" width="{width * share:.1f}" '
        'height="12" rx="3"/></svg>'
    )


def spend(days: Sequence[date], series: Sequence[Series], unit: str, what: str) -> Markup:
    """Stacked bars per UTC day, one colour per series (an org or a provider, biggest at
    the bottom), each part titled with its name and amount."""
    if not series or not days:
        return Markup("")
    peak = max(sum((s.by_day.get(d, Decimal(0)) for s in series), Decimal(0)) for d in days)
    peak = peak or Decimal(1)
    slot = (WIDTH - PAD) / len(days)
    bar_w = max(1.0, slot * 0.8)
    usable = HEIGHT - PAD
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{escape(unit)} spent per day, per {escape(what)}">',
        f'<line x1="{PAD}" y1="{usable}" x2="{WIDTH}" y2="{usable}" class="axis"/>',
        f'<text x="2" y="12" class="tick">{escape(amount(peak))}</text>',
        f'<text x="2" y="{usable}" class="tick">0</text>',
    ]
    for i, day in enumerate(days):
        x = PAD + i * slot
        top = float(usable)
        for n, s in enumerate(series):
            value = s.by_day.get(day)
            if not value:
                continue
            h = usable * float(value / peak)
            top -= h
            label = escape(f"{day:%Y-%m-%d}: {s.name} {amount(value)} {unit}")
            parts.append(
                f'<rect class="s{n}" x="{x:.1f}" y="{top:.1f}" width="{bar_w:.1f}" '
                f'height="{h:.1f}"><title>{label}</title></rect>'
            )
    parts.append(f'<text x="{PAD}" y="{HEIGHT - 6}" class="tick">{days[0]:%m-%d}</text>')
    parts.append(
        f'<text x="{WIDTH - 2}" y="{HEIGHT - 6}" class="tick" text-anchor="end">'
        f"{days[-1]:%m-%d} UTC</text>"
    )
    parts.append("</svg>")
    return Markup("".join(parts))
