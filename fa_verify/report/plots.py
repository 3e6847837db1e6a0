"""Figures as inline SVG: error-vs-N curves and error histograms, plus cell sparklines.

matplotlib is used through `Figure` objects (no pyplot global state, no display needed) and
writes SVG with text as <text> (small, selectable) and a fixed hash salt and no date, so the
same data gives the same bytes. Sparklines are too small for matplotlib to be worth its
output size: they are bar geometry that the template draws.
"""

from __future__ import annotations

import functools
import io

import numpy as np

from fa_verify.report.histogram import EDGES

#: x ranges (decades) the histograms show, per error view; counts beyond go to the edge bars.
VIEW_RANGES = {"ulp": (-2.0, 4.0), "normalised": (-10.0, 0.0)}
_SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "fa_verify", "font.size": 9}


def _svg(fig) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: it sits inside HTML


def _styled(fn):
    """Run a figure function under the report's rcParams (they apply when artists are made)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context(_SVG_RC):
            return fn(*args, **kwargs)
    return wrapper


def _figure(panels: int, width: float = 4.2, height: float = 3.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * panels, height), layout="constrained")
    return fig, fig.subplots(1, panels, squeeze=False)[0]


@_styled
def curve_svg(curve) -> str:
    """Max normalised error vs N, one panel per causal mode; comparisons dashed."""
    fig, axes = _figure(2)
    colours = _colours(sorted({s.label for s in curve.series if s.kind == "backend"}))
    for ax, causal in zip(axes, (False, True)):
        for s in (s for s in curve.series if s.causal == causal):
            n, err = zip(*s.points)
            err = np.maximum(err, 1e-17)  # an exact result would vanish from a log axis
            if s.kind == "comparison":
                ax.plot(n, err, "--", color="0.35" if "rounded" in s.label else "0.6", lw=1.4,
                        label=s.label)
            else:
                ax.plot(n, err, "o-", color=colours[s.label], lw=1.2, ms=3, label=s.label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("max normalised error")
        ax.set_title(f"{curve.dtype}, {'causal' if causal else 'full'}")
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7, frameon=False)
    return _svg(fig)


@_styled
def histogram_svg(title: str, histograms: dict, view: str) -> str:
    """Step histograms (share of elements per bin, log-log) of several named histograms."""
    fig, (ax,) = _figure(1, width=6.0, height=3.2)
    colours = _colours(sorted(histograms))
    centres = np.sqrt(EDGES[:-1] * EDGES[1:])
    for name in sorted(histograms):
        h = histograms[name]
        total = h["zero"] + h["under"] + sum(h["bins"]) + h["over"]
        share = np.asarray(h["bins"], dtype=float) / max(total, 1)
        ax.step(centres, np.where(share > 0, share, np.nan), where="mid", color=colours[name],
                lw=1.2, label=f"{name} ({100 * h['zero'] / max(total, 1):.0f}% exact)")
    low, high = VIEW_RANGES[view]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(10.0 ** low, 10.0 ** high)
    ax.set_xlabel("ULPs of the output dtype" if view == "ulp" else "error / row scale")
    ax.set_ylabel("share of elements")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=7, frameon=False)
    return _svg(fig)


def _colours(names) -> dict:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {name: cmap(i % 10) for i, name in enumerate(names)}


def sparkline(hist: dict | None, view: str, width: int = 96, height: int = 22) -> list:
    """Bars (x, y, w, h) of a histogram over VIEW_RANGES[view], heights on a log scale of the
    counts; the first bar is the exact zeros (drawn apart), edge bars absorb what lies beyond."""
    if not hist:
        return []
    low, high = VIEW_RANGES[view]
    decades = np.log10(EDGES)
    inside = (decades[:-1] >= low) & (decades[1:] <= high)
    counts = np.asarray(hist["bins"], dtype=float)
    shown = counts[inside].copy()
    first = int(np.argmax(inside))
    shown[0] += hist["under"] + counts[:first].sum()
    shown[-1] += hist["over"] + counts[first + inside.sum():].sum()
    values = np.concatenate([[hist["zero"]], shown])
    top = np.log1p(values.max()) or 1.0
    bar = width / (len(values) + 1)  # one bar's gap between the zero bar and the rest
    bars = []
    for i, v in enumerate(values):
        if v <= 0:
            continue
        h = max(1.0, height * np.log1p(v) / top)
        x = i * bar + (bar if i else 0.0)
        bars.append((round(x, 2), round(height - h, 2), round(bar * 0.9, 2), round(h, 2)))
    return bars
