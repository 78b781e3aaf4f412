"""The hand-written SVG charts: valid XML, one mark per value, error bars, log-axis checks."""

import math
import re
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dofmini.study.plots import BOTTOM, LEFT, RIGHT, TOP, H, W, xy_chart

SVG = "{http://www.w3.org/2000/svg}"


def parsed(svg: str):
    return ET.fromstring(svg)


def marks(root, kind):
    return root.findall(f".//{SVG}path[@class='{kind}']")


def anchor(mark):
    """A marker's centre (x, y), or an error bar's x and its two ends (x, y_low_end, y_high_end)."""
    return tuple(
        map(float, re.match(r"M([\d.]+),([\d.]+)(?:V([\d.]+))?", mark.get("d")).groups("0"))
    )


def test_xy_chart_draws_a_marker_per_point_and_a_bar_per_interval():
    svg = xy_chart(
        {
            "Fix <teacher-sized>": (
                [16, 32, 64, 128],
                [0.5, 0.3, 0.2, 0.12],
                [0.05, 0.04, 0, 0.01],
            ),
            "DoF": ([16, 32, 64, 128], [0.4, 0.25, 0.2, 0.1], [0.06, math.nan, 0.02, 0.01]),
            "Oracle": ([16, 32, 64], [0.3, 0.2, 0.15], None),
        },
        "mean-layer error & budget",
        "budget M",
        "KL",
    )
    root = parsed(svg)
    assert root.tag == SVG + "svg"
    assert len(root.findall(SVG + "polyline")) == 3
    assert len(marks(root, "marker")) == 4 + 4 + 3
    assert len(marks(root, "errbar")) == 4 + 3  # nan means no bar; None means none at all
    assert len(marks(root, "key")) == 3
    # each series has its own marker shape, so coinciding points stay distinguishable
    shapes = {re.sub(r"^M[\d.]+,[\d.]+", "", m.get("d")) for m in marks(root, "marker")}
    assert len(shapes) == 3


def test_log_axes_reject_non_positive_values_by_name():
    with pytest.raises(
        ValueError, match=r"xy_chart: x values must be present and finite and > 0 \(log axis\)"
    ):
        xy_chart({"a": ([0, 1], [1, 2], None)}, "t", "x", "y")
    with pytest.raises(ValueError, match=r"xy_chart: series 'a' .* a y <= 0 \(log axis\)"):
        xy_chart({"a": ([1, 2], [0, 2], None)}, "t", "x", "y")
    with pytest.raises(ValueError, match="series 'a' has a negative half width"):
        xy_chart({"a": ([1, 2], [1, 2], [0.1, -0.1])}, "t", "x", "y")
    with pytest.raises(ValueError, match="series 'a' needs equal-length"):
        xy_chart({"a": ([1, 2, 3], [1, 2], None)}, "t", "x", "y")


def test_a_bar_reaching_below_zero_on_a_log_axis_stops_at_the_axis():
    svg = xy_chart({"a": ([1, 2], [0.1, 1.0], [0.5, 0.1])}, "t", "x", "y")
    _, low_end, high_end = anchor(marks(parsed(svg), "errbar")[0])
    assert low_end == pytest.approx(H - BOTTOM, abs=0.1) and high_end < low_end


positive = st.floats(1e-3, 1e3)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(positive, positive, st.floats(0, 1e3)), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    ),
)
def test_every_point_and_bar_lies_inside_the_plot(lines):
    series = {f"s{k}": tuple(map(list, zip(*points))) for k, points in enumerate(lines)}
    root = parsed(xy_chart(series, "t", "x", "y"))
    assert len(marks(root, "marker")) == sum(map(len, lines))
    assert len(marks(root, "errbar")) == sum(map(len, lines))
    for x, *ys in map(anchor, marks(root, "marker")):
        assert LEFT - 0.1 <= x <= W - RIGHT + 0.1 and TOP - 0.1 <= ys[0] <= H - BOTTOM + 0.1
    for x, *ys in map(anchor, marks(root, "errbar")):
        assert LEFT - 0.1 <= x <= W - RIGHT + 0.1
        assert all(TOP - 0.1 <= y <= H - BOTTOM + 0.1 for y in ys)
