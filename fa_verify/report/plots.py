"""Figures as inline SVG: error-vs-N curves and error histograms, plus cell sparklines.

Both figures are small multiples (a panel per backend family, a panel per backend), take
the report's data classes (`curves`, `distributions`) and nothing of a sweep, and colour each
backend alike in every figure (`backend_colours`).

matplotlib is used through `Figure` objects (no pyplot global state, no display needed) and
writes SVG with text as <text> (small, selectable) and a fixed hash salt and no date, so the
same data gives the same bytes. Sparklines are too small for matplotlib to be worth its
output size: they are bar geometry that the template draws.
"""

from __future__ import annotations

import functools
import io

import numpy as np

from fa_verify.report.families import FAMILIES, family_of
from fa_verify.report.histogram import EDGES

#: x ranges (decades) the cell sparklines show, per error view; counts beyond go to the edge bars.
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


def _grid(rows: int, cols: int, width: float, height: float, legend_rows: int = 0):
    """A figure of rows x cols panels sharing both axes, room below for a legend; never
    narrower than its title and legend need (a lone panel is widened)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(width * cols, 6.5), height * rows + 0.22 * legend_rows),
                 layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)


def backend_colours(backends) -> dict:
    """One colour per backend, by family then name, the same in every figure of a report."""
    import matplotlib

    names = sorted(set(backends), key=lambda b: (FAMILIES.index(family_of(b)), b))
    palette = list(matplotlib.colormaps["tab10"].colors) + list(matplotlib.colormaps["Dark2"].colors)
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


@_styled
def curve_svg(curve, colours: dict) -> str:
    """Max normalised error vs length (`curve.axis`), log-log: a panel per backend family (columns) and causal
    mode (rows); the exactly rounded floor, and per backend the largest element of its error-model
    bound as a dash-dot line in its colour (lines, not shaded bands: several overlapping
    translucent bands cannot be told apart). Backends whose curves coincide share one legend
    entry that says so; a bound cut at the top or that stops is noted in its panel, with why."""
    from matplotlib.legend_handler import HandlerTuple

    modes = sorted({s.causal for s in curve.series})
    groups = list(curve.groups.items())
    together = {name: group for group in curve.coinciding for name in group}
    entries = sum(map(len, curve.groups.values())) - sum(len(g) - 1 for g in curve.coinciding) + 3
    bounds = len({tuple(s.bound) for s in curve.series if s.bound})
    columns = min(4, len(groups) + 1)  # a legend no wider than the panels
    fig, axes = _grid(len(modes), len(groups), 3.6, 2.9, -(-(entries + bounds) // columns) + 1)
    # the errors set the y range; a bound far above them (up to ~1 where a model's scores are
    # in 16 bits) would squeeze them into a sliver, so such bounds are cut and their top written
    errors = [e for s in curve.series for _, e in s.points]
    top, clipped, handles, bound_handles = HEADROOM * max(errors), False, {}, {}
    symbol = curve.axis.rsplit(" ", 1)[-1]  # "N", or "Nk" for decode
    for row, causal in enumerate(modes):
        mode = [s for s in curve.series if s.causal == causal]
        for col, (family, backends) in enumerate(groups):
            ax = axes[row][col]
            shown = [s for b in backends for s in mode if s.label == b]
            cut, drawn = _bounds(ax, shown, colours, top, symbol)
            clipped |= cut
            bound_handles.update(drawn)
            for i, s in enumerate(shown):
                n, err = zip(*s.points)
                # alternate filled and larger hollow markers: identical curves stay visible
                handles[s.label], = ax.plot(n, np.maximum(err, 1e-17), color=colours[s.label],
                                            lw=1.2 if i % 2 == 0 else 0.8,
                                            marker=_MARKERS[i % len(_MARKERS)],
                                            ms=3.5 if i % 2 == 0 else 5.5,
                                            mfc=colours[s.label] if i % 2 == 0 else "none")
            for s in mode:
                if s.kind != "backend":
                    n, err = zip(*s.points)
                    handles[_COMPARISON_LABELS[s.kind]], = ax.plot(
                        n, err, **(_FLOOR if s.kind == "floor" else _COMPARISON))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{family} · {'causal' if causal else 'full'}")
            ax.grid(True, which="major", alpha=0.3)
            if row == len(modes) - 1:
                ax.set_xlabel(curve.axis)
            if col == 0:
                ax.set_ylabel("max normalised error")
    if clipped:
        axes[0][0].set_ylim(max(min(errors), 1e-17) / 1.5, top)  # the panels share it
    legend = {}
    for label, handle in handles.items():
        group = together.get(label)
        if group is None:
            legend[label] = handle
        elif label == group[0]:  # one entry, every marker of the group side by side
            legend[f"{', '.join(group)} (coincide)"] = tuple(handles[b] for b in group if b in handles)
    legend.update(bound_handles)
    quantity = curve.axis.rsplit(" ", 1)[0]  # "sequence length N" -> "sequence length"
    # the variant's parameters on a line of their own: a lone panel is narrower than both
    what = curve.dtype if curve.tensor == "out" else f"{curve.dtype} {curve.tensor}"
    fig.suptitle(f"{what}: error against {quantity} ({curve.shape_family})"
                 + (f"\n{curve.variant}" if curve.variant else ""))
    fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=columns,
               fontsize=7, frameon=False, handlelength=3.2,
               handler_map={tuple: HandlerTuple(ndivide=None, pad=0.1)})
    return _svg(fig)


def _bounds(ax, series, colours: dict, top: float, symbol: str) -> tuple[bool, dict]:
    """Draw each distinct bound of `series` once, for the backends that share it (one precision
    model), as a dash-dot line in the first one's colour with a tick at each length (a bound at
    one length is a tick); note in the panel the bounds cut above `top` and those that stop.
    (whether any was cut, {legend label: handle})."""
    from matplotlib.lines import Line2D

    shared = {}
    for s in series:
        if s.bound:
            shared.setdefault(tuple(s.bound), []).append(s)
    handles, notes, cut = {}, [], False
    for bound, members in shared.items():
        labels = [s.label for s in members]
        colour = colours[labels[0]]
        n, largest = zip(*bound)
        ax.plot(n, largest, color=colour, lw=1.0, ls="-.", marker="_", ms=9, mew=1.2)
        # the legend's line without the ticks, which would hide its dash-dot
        handles[f"bound of {' = '.join(labels)}"] = Line2D([], [], color=colour, lw=1.0, ls="-.")
        said = []
        if max(largest) > top:
            said.append(f"bound up to {max(largest):.2g} ↑")
            cut = True
        ends = members[0].bound_ends
        if ends is not None:  # error_model: no first-order bound once a relative error reaches 1/4
            said.append(f"no finite bound past {symbol} = {ends}: its model's error reaches 1/4")
        if said:  # a line each, to fit a panel's width
            notes.append((colour, [f"{', '.join(labels)}:"] + said))
    line = 0
    for colour, lines in notes:
        ax.text(0.02, 0.97 - 0.055 * line, "\n".join(lines), transform=ax.transAxes, color=colour,
                fontsize=6.5, va="top", linespacing=1.1, in_layout=False)
        line += len(lines) + 0.3
    return cut, handles


_MARKERS = "osD^vP"
#: the y axis reaches this many times the largest error drawn (bounds beyond are cut)
HEADROOM = 30.0
_FLOOR = {"color": "black", "ls": "--", "lw": 1.3}
_COMPARISON = {"color": "0.55", "ls": ":", "lw": 1.4}
_COMPARISON_LABELS = {"floor": "exactly rounded reference (floor)",
                      "comparison": "naive same-precision attention"}


@_styled
def histograms_svg(dtype: str, panels: list, colours: dict) -> str:
    """Small multiples, a panel per backend: its normalised error histogram (share of
    elements per bin, log-log) over the exactly rounded reference's on the same problems
    (grey), titled with its share of exactly rounded elements. The x range is the bins that
    hold elements, so each dtype's errors fill the panels."""
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = _grid(rows, cols, 2.6, 1.9)
    shares = [{key: _shares(h) for key, h in p.histograms.items() if h} for p in panels]
    present = [s[s > 0] for panel in shares for s in panel.values()]
    lowest = min((s.min() for s in present if s.size), default=1.0) / 2  # the log axis' bottom
    for i, ax in enumerate(axes.flat):
        if i >= len(panels):
            ax.set_axis_off()
            continue
        panel, share = panels[i], shares[i]
        if "rounded" in share:
            ax.stairs(np.maximum(share["rounded"], lowest), EDGES, baseline=lowest, fill=True,
                      color="0.6", alpha=0.45, lw=0)
        if "backend" in share:
            ax.stairs(np.maximum(share["backend"], lowest), EDGES, baseline=lowest,
                      color=colours[panel.backend], lw=1.2)
        exact = ("exactly rounded: not recorded" if panel.exactly_rounded is None
                 else f"{100 * panel.exactly_rounded:.1f}% exactly rounded")
        name = panel.backend if panel.tensor == "out" else f"{panel.backend}: {panel.tensor}"
        ax.set_title(f"{name}\n{exact}", fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
        if i + cols >= len(panels):  # no panel below it
            ax.set_xlabel("error / row scale")
        if i % cols == 0:
            ax.set_ylabel("share of elements")
    ax = axes.flat[0]
    ax.set_xscale("log")
    ax.set_yscale("log")
    used = np.any([s > 0 for panel in shares for s in panel.values()], axis=0)
    if np.any(used):
        ax.set_xlim(EDGES[np.argmax(used)], EDGES[len(used) - np.argmax(used[::-1])])
    ax.set_ylim(bottom=lowest)
    fig.suptitle(f"{dtype}: normalised error per backend; grey: the exactly rounded reference")
    return _svg(fig)


def _shares(h: dict) -> np.ndarray:
    """A histogram's bin counts as shares of all its elements (zeros and beyond-range included)."""
    total = h["zero"] + h["under"] + sum(h["bins"]) + h["over"]
    return np.asarray(h["bins"], dtype=float) / max(total, 1)


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
