"""index.html and summary.md: the report's data through the jinja2 templates in report/templates.

Autoescape is on for HTML, so every string from records (backend names, error messages,
reproducer commands) is escaped; the only values marked safe are the figures, SVG that
matplotlib wrote from numbers. CSS and figures are inlined: the page needs no network and no
files beside it.
"""

from __future__ import annotations

import math

import jinja2
from markupsafe import Markup

from fa_verify.report.plots import (
    HEADROOM,
    VIEW_RANGES,
    backend_colours,
    curve_svg,
    histograms_svg,
    sparkline,
)
from fa_verify.report.ulp import NOT_TINY_EXPONENT


def fmt(x) -> str:
    """A number as the page shows it: 3 significant digits; '—' for a missing value."""
    if x is None:
        return "—"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:.3g}"


def fmt_times(x) -> str:
    """A "× rounded" figure: 3 significant digits, trailing zeros kept (1.00 is not 1.004)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return fmt(x)
    return f"{x:#.3g}".rstrip(".")


def rawnum(x) -> str:
    """The exact value behind a shown number (data-v attribute), for tests and scrapers."""
    return "" if x is None else repr(float(x))


def md(text) -> str:
    """Text safe in a Markdown table cell or line: no cell breaks, no HTML, no newlines."""
    text = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("`", "'")
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _view_range(view: str) -> str:
    low, high = VIEW_RANGES[view]
    return f"1e{low:g} … 1e{high:g}"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("fa_verify.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters.update(fmt=fmt, fmt_times=fmt_times, rawnum=rawnum, md=md)
    env.globals.update(sparkline=sparkline, view_range=_view_range,
                       not_tiny=f"2^{NOT_TINY_EXPONENT}", curve_headroom=f"{HEADROOM:g}")
    return env


def figures(data) -> dict:
    """The SVG figures of the page: error-vs-N curves and histograms, per dtype, of all
    records and of each feature group (`data.features`, in its order)."""
    colours = backend_colours(s.name for s in data.sections)

    def drawn(curves, distributions) -> dict:
        return {"curves": [(c, Markup(curve_svg(c, colours))) for c in curves],
                "histograms": [(d, Markup(histograms_svg(d.dtype, d.panels, colours)))
                               for d in distributions]}

    return {**drawn(data.curves, data.distributions),
            "features": [drawn(g.curves, g.distributions) for g in data.features]}


def render_html(data, published=None) -> str:
    """index.html of `data`; `published`: the reproduced published results (`published.view`)."""
    # each backend's section on the page, linked from every overview table
    backend_index = {s.name: i for i, s in enumerate(data.sections, 1)}
    return environment().get_template("index.html").render(data=data, figures=figures(data),
                                                           published=published,
                                                           backend_index=backend_index)


def render_markdown(data) -> str:
    return environment().get_template("summary.md").render(data=data)
