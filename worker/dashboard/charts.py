"""Small inline SVG charts (no JavaScript, no external assets: the CSP allows neither)."""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

from queues.dashboard import Minute

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
