"""Hand-written SVG charts, standard library only: lines with error bars on log-log axes."""

import math
from xml.sax.saxutils import escape

W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 360, 64, 64, 40, 48  # canvas and margins, px
COLORS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb")
# Marker outlines relative to the point (circle, square, triangle, diamond, inverted triangle):
# hollow and of a different shape per series, so points of coinciding lines all stay visible.
SHAPES = ("m-4,0a4,4 0 1 0 8,0a4,4 0 1 0 -8,0z", "m-3.5,-3.5h7v7h-7z", "m0,-5l4.5,8h-9z")
SHAPES += ("m0,-5l5,5l-5,5l-5,-5z", "m0,5l4.5,-8h-9z")


def _ticks(lo, hi):
    """Log-axis tick values covering [lo, hi] (both > 0): 1, 2, 5 per decade, or powers of ten
    alone when that would exceed 7 ticks."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    ticks = [m * 10.0**e for e in decades for m in (1, 2, 5)]
    first = max(i for i, t in enumerate(ticks) if t <= lo * (1 + 1e-9))
    last = max(first + 1, min(i for i, t in enumerate(ticks) if t >= hi * (1 - 1e-9)))
    ticks = ticks[first : last + 1]
    return ticks if len(ticks) <= 7 else [10.0**e for e in decades]


def _scale(ticks, start, end):
    """The log value -> pixel map placing ticks[0] at pixel start and ticks[-1] at pixel end."""
    lo, hi = math.log10(ticks[0]), math.log10(ticks[-1])
    return lambda v: start + (end - start) * (math.log10(v) - lo) / ((hi - lo) or 1)


def _text(x, y, label, anchor="middle", attrs="") -> str:
    return f'<text x="{x}" y="{y}" text-anchor="{anchor}"{attrs}>{label}</text>'


def _rule(x1, y1, x2, y2) -> str:
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#000"/>'


def _y_axis(ticks, label):
    """The left axis; its SVG and value -> pixel map."""
    y = _scale(ticks, H - BOTTOM, TOP)
    turn = f' transform="translate({LEFT - 48},{H / 2}) rotate(-90)"'
    parts = [_rule(LEFT, TOP, LEFT, H - BOTTOM), _text(0, 0, escape(label), attrs=turn)]
    parts += [_text(LEFT - 6, f"{y(t) + 4:.1f}", f"{t:g}", "end") for t in ticks]
    return parts, y


def _x_axis(xs, label):
    """The bottom axis over the values xs; its SVG and value -> pixel map."""
    ticks = _ticks(min(xs), max(xs))
    x = _scale(ticks, LEFT, W - RIGHT)
    parts = [_rule(LEFT, H - BOTTOM, W - RIGHT, H - BOTTOM)]
    parts += [_text(f"{x(t):.1f}", H - BOTTOM + 16, f"{t:g}") for t in ticks]
    return parts + [_text(W / 2, H - 8, escape(label))], x


def _svg(title, parts, width=W) -> str:
    size = f'width="{width:.0f}" height="{H}"'
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" {size} font-family="sans-serif" font-size="11">'
    title = _text(W / 2, TOP - 16, escape(title), attrs=' font-size="15"')
    return "\n".join([svg, f'<rect {size} fill="#fff"/>', *parts, title, "</svg>\n"])


def xy_chart(series, title, xlabel, ylabel) -> str:
    """Lines, series mapping a name to (xs, ys, half_widths or None): a marker on every point and,
    where its half width is a number (not None or nan), an error bar y ± half width. Both axes are
    log, so xs and ys must be > 0; a bar's end at or below 0 is cut at the axis bottom."""
    all_xs = [float(x) for xs, _, _ in series.values() for x in xs]
    if not all_xs or not all(map(math.isfinite, all_xs)) or min(all_xs) <= 0:
        raise ValueError(
            f"xy_chart: x values must be present and finite and > 0 (log axis): {all_xs}"
        )
    checked = []  # (name, xs, ys, half widths with nan for "no bar")
    for name, (xs, ys, hws) in series.items():
        xs, ys = list(xs), [float(v) for v in ys]
        hws = [math.nan] * len(ys) if hws is None else [float(h) for h in hws]
        if not len(xs) == len(ys) == len(hws) or not all(map(math.isfinite, ys)):
            raise ValueError(
                f"xy_chart: series {name!r} needs equal-length xs, ys, half widths and finite ys, "
                f"got {xs}, {ys}, {hws}"
            )
        if any(h < 0 for h in hws) or min(ys) <= 0:
            raise ValueError(
                f"xy_chart: series {name!r} has a negative half width or a y <= 0 (log axis): "
                f"ys {ys}, half widths {hws}"
            )
        checked.append((str(name), xs, ys, hws))
    # the axis spans every y and every bar end that can be drawn (nan ends drop out)
    ends = [e for _, _, ys, hws in checked for y, h in zip(ys, hws) for e in (y - h, y, y + h)]
    ends = [e for e in ends if math.isfinite(e) and e > 0]
    ticks = _ticks(min(ends), max(ends))
    parts, y = _y_axis(ticks, ylabel)
    axis, x = _x_axis(all_xs, xlabel)
    parts += axis
    bars, marks = [], []
    for k, (name, xs, ys, hws) in enumerate(checked):
        color, shape, key_y = COLORS[k % len(COLORS)], SHAPES[k % len(SHAPES)], TOP + 14 * k + 6
        pts = [(x(a), y(b)) for a, b in zip(xs, ys)]
        parts.append(
            f'<polyline points="{" ".join(f"{px:.1f},{py:.1f}" for px, py in pts)}" fill="none" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        for (px, py), a, b, h in zip(pts, xs, ys, hws):
            tip = f"{escape(name)}: {a:g}, {b:.4g}" + (f" ± {h:.2g}" if math.isfinite(h) else "")
            marks.append(
                f'<path class="marker" d="M{px:.1f},{py:.1f}{shape}" fill="#fff" '
                f'stroke="{color}" stroke-width="1.5"><title>{tip}</title></path>'
            )
            if math.isfinite(h):
                lo, hi = y(b - h if b - h > 0 else ticks[0]), y(b + h)
                bars.append(
                    f'<path class="errbar" d="M{px:.1f},{lo:.1f}V{hi:.1f}M{px - 3:.1f},{lo:.1f}h6'
                    f'M{px - 3:.1f},{hi:.1f}h6" stroke="{color}"/>'
                )
        parts += [
            f'<path class="key" d="M{W - RIGHT + 16},{key_y - 4}{shape}" fill="#fff" '
            f'stroke="{color}" stroke-width="1.5"/>',
            f'<text x="{W - RIGHT + 26}" y="{key_y}" fill="{color}">{escape(name)}</text>',
        ]
    # bars and markers last, over every line, so no later line hides an earlier series' points;
    # the legend gets its own column right of the plot (about 7 px a character), never over data
    width = W - RIGHT + 34 + 7 * max(len(name) for name, *_ in checked)
    return _svg(title, parts + bars + marks, max(W, width))
