"""Hand-written SVG charts (no plotting dependency): per-layer allocation with per-head DoF, and lines by layer."""

import math
from xml.sax.saxutils import escape

W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 360, 64, 64, 40, 48  # canvas and margins, px
COLORS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb")


def _ticks(top, log):
    """Axis maximum and tick values: 1-2-5 steps from 0, or powers of ten on a log axis."""
    if log:
        return [
            10.0**e
            for e in range(math.floor(math.log10(top[0])), math.ceil(math.log10(top[1])) + 1)
        ]
    step = 10 ** math.floor(math.log10(top / 5)) if top > 0 else 1
    step *= next(m for m in (1, 2, 5, 10) if top / (step * m) <= 6)
    return [step * i for i in range(math.ceil(top / step - 1e-9) + 1)]


def _axis(ticks, log, x, label, anchor):
    """A vertical axis at x; returns its SVG and the value -> pixel map."""
    lo, hi = (math.log10(ticks[0]), math.log10(ticks[-1])) if log else (ticks[0], ticks[-1])
    span = (hi - lo) or 1

    def y(v):
        return TOP + (H - TOP - BOTTOM) * (1 - ((math.log10(v) if log else v) - lo) / span)

    side = -6 if anchor == "end" else 6
    parts = [f'<line x1="{x}" y1="{TOP}" x2="{x}" y2="{H - BOTTOM}" stroke="#000"/>']
    parts += [
        f'<text x="{x + side}" y="{y(t) + 4:.1f}" text-anchor="{anchor}">{t:g}</text>'
        for t in ticks
    ]
    lx = x + (-48 if anchor == "end" else 48)
    parts.append(
        f'<text transform="translate({lx},{H / 2}) rotate(-90)" text-anchor="middle">{escape(label)}</text>'
    )
    return parts, y


def _write(path, title, n_layers, parts):
    xs = [LEFT + (W - LEFT - RIGHT) * (i + 0.5) / n_layers for i in range(n_layers)]
    parts += [
        f'<text x="{x:.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{i}</text>'
        for i, x in enumerate(xs)
    ]
    parts += [
        f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="#000"/>',
        f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle">layer</text>',
        f'<text x="{W / 2}" y="{TOP - 16}" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
            f'font-size="11">\n<rect width="{W}" height="{H}" fill="#fff"/>\n'
            + "\n".join(parts)
            + "\n</svg>\n"
        )


def allocation_chart(dims, per_head_dof, path, title):
    """Bars: feature dims per layer (left axis); dots: every head's DoF (right axis)."""
    n = len(dims)
    if len(per_head_dof) != n:
        raise ValueError(
            f"allocation_chart: {n} layer dims but per_head_dof has {len(per_head_dof)} layers"
        )
    left, y_dim = _axis(_ticks(max(dims), False), False, LEFT, "feature dim M (bars)", "end")
    right, y_dof = _axis(
        _ticks(max(max(h) for h in per_head_dof), False),
        False,
        W - RIGHT,
        "DoF per head (dots)",
        "start",
    )
    slot = (W - LEFT - RIGHT) / n
    parts = left + right
    for i, (m, heads) in enumerate(zip(dims, per_head_dof)):
        x0 = LEFT + slot * i
        parts.append(
            f'<rect x="{x0 + slot * 0.15:.1f}" y="{y_dim(m):.1f}" width="{slot * 0.7:.1f}" '
            f'height="{H - BOTTOM - y_dim(m):.1f}" fill="#bcd0e8"><title>M = {m}</title></rect>'
        )
        parts += [
            f'<circle cx="{x0 + slot * (0.25 + 0.5 * j / max(len(heads) - 1, 1)):.1f}" cy="{y_dof(v):.1f}" '
            f'r="3.5" fill="#cc3311"><title>head {j}: {v:.1f}</title></circle>'
            for j, v in enumerate(heads)
        ]
    _write(path, title, n, parts)


def line_chart(series, path, title, ylabel, log_y=False):
    """One line per named series over layers 0..L-1; log_y needs positive values."""
    values = [v for vs in series.values() for v in vs]
    if log_y and min(values) <= 0:
        raise ValueError(f"line_chart: log_y needs positive values, got minimum {min(values)}")
    n = max(len(vs) for vs in series.values())
    parts, y = _axis(
        _ticks((min(values), max(values)) if log_y else max(values), log_y),
        log_y,
        LEFT,
        ylabel,
        "end",
    )
    for k, (name, vs) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        pts = " ".join(
            f"{LEFT + (W - LEFT - RIGHT) * (i + 0.5) / n:.1f},{y(v):.1f}" for i, v in enumerate(vs)
        )
        parts += [
            f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>',
            f'<text x="{LEFT + 8}" y="{TOP + 14 * k + 10}" fill="{color}">{escape(name)}</text>',
        ]
    _write(path, title, n, parts)
