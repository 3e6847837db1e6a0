"""Golden et al. 2024 ("Is Flash Attention Stable?") reproduced: the largest deviation of an
attention output from a float64 reference in bf16, by sequence length and key-tile size.

The paper (arXiv:2405.02803) compares, in an isolated forward pass, FlashAttention's output
and standard ("baseline") attention's with a float64 one. Its abstract reports that at bf16
FlashAttention deviates roughly ten times (an order of magnitude) more than baseline
attention. Its figures on sequence length and block size were not available to us (only
the abstract was), so the page quotes no number for them.

Ours, per sequence length N (B = 1, H = 1, D = 64, i.i.d. N(0, 1) inputs rounded to bf16, one
problem per seed): max |O - O_ref| over every output element, O_ref fa_verify's certified
float64 reference, for
- the reference rounded to bf16: the least deviation any kernel can have (the floor);
- standard attention: our naive16 kernel (S and P stored in bf16 as eager PyTorch does, P·V
  accumulated in fp32);
- our fa2 kernel at key tiles of 16, 32, 64 and 128 (`FA2_KEY_TILES`): FA2's precision, running
  max, sum and output accumulator in fp32, P rounded to bf16 before P·V;
- the numpy tiled model with the same tiles but its running sum and accumulator stored in bf16
  after every key tile: what tiling costs when the running state is bf16 (the cost that grows
  with the number of tiles N / key tile).
The kernels run on the CUDA-on-CPU runner: at these sizes (up to 2048 keys, a few tenths of a
second per run) it is fast enough that the kernel itself is measured, not a model of it. With
these inputs |O| shrinks as N grows (each output averages more values of v), and so does every
absolute deviation; the plot and the growth figures divide by max |O_ref| to compare across N.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fa_verify.backends.cuda_kernels import CpuKernelBackend, cpu_runner_availability
from fa_verify.backends.numpy_tiled import tiled_attention
from fa_verify.dtypes import round_to
from fa_verify.kernels.catalogue import FA2, FA2_KEY_TILES, NAIVE16
from fa_verify.oracle import reference
from fa_verify.precision import PrecisionModel
from fa_verify.report.measurements import code_fingerprint, deviation, measure_problems, seeds_text
from fa_verify.report.plots import _styled, _svg
from fa_verify.strategies import Shape, make_problem

PAPER = ("A. Golden, S. Hsia, F. Sun, B. Acun, B. Hosmer, Y. Lee, Z. DeVito, J. Johnson, G.-Y. Wei, "
         "D. Brooks, C.-J. Wu: Is Flash Attention Stable? arXiv:2405.02803 (2024)")
#: The paper's figure we could check (its abstract): FlashAttention's deviation over baseline
#: attention's in bf16, in an isolated forward pass ("roughly an order of magnitude").
PAPER_FLASH_OVER_BASELINE = 10.0

ROUNDED = "reference rounded to bf16"
STANDARD = "standard attention (naive16)"
#: Python modules and kernel sources whose text keys the cached measurements.
CODE = (("fa_verify.report.golden", "fa_verify.oracle", "fa_verify.backends.numpy_tiled",
         "fa_verify.backends.cuda_kernels", "fa_verify.cuda_cpu", "fa_verify.strategies",
         "fa_verify.dtypes"),
        ("fa_common.cuh", "fa2.cu", "fa2_key_tiles.cu", "naive.cu"))


def fa2_name(key_tile: int) -> str:
    return f"fa2 kernel, key tile {key_tile}"


def bf16_state_name(key_tile: int) -> str:
    return f"bf16 running state, key tile {key_tile}"


@dataclass(frozen=True)
class GoldenSetup:
    seq_lengths: tuple = (128, 256, 512, 1024, 2048)
    key_tiles: tuple = tuple(FA2_KEY_TILES)
    seeds: tuple = (0, 1)
    heads: int = 1
    head_dim: int = 64
    distribution: str = "normal"
    dtype: str = "bf16"

    def shape(self, n: int) -> Shape:
        return Shape(batch=1, heads=self.heads, kv_heads=self.heads, nq=n, nk=n, head_dim=self.head_dim)

    def describe(self) -> str:
        return (f"B=1 H={self.heads} D={self.head_dim}, Nq = Nk = N, non-causal, {self.dtype}, "
                f"{self.distribution} inputs (q, k, v i.i.d. N(0, 1) rounded to {self.dtype}), "
                f"{seeds_text(self.seeds)}")


def measure(setup: GoldenSetup, cache, progress=None) -> dict:
    """Every (N, seed) problem's deviations, through `cache`; plain JSON for published.json."""
    return measure_problems(cache, "Golden et al. 2024", setup, code_fingerprint(*CODE), "n",
                            setup.seq_lengths, setup.seeds,
                            lambda n, seed: _measure_problem(setup, n, seed), progress,
                            {"cpu_runner": cpu_runner_availability().available})


def _measure_problem(setup: GoldenSetup, n: int, seed: int) -> dict:
    problem = make_problem(setup.distribution, setup.shape(n), setup.dtype, seed)
    ref = reference(problem)
    outputs = {ROUNDED: round_to(ref.out, setup.dtype)}
    runner = cpu_runner_availability()
    unavailable = None if runner.available else runner.reason
    if runner.available:
        outputs[STANDARD] = CpuKernelBackend(NAIVE16).run(problem)[0]
        for tile in setup.key_tiles:
            outputs[fa2_name(tile)] = CpuKernelBackend(FA2_KEY_TILES[tile]).run(problem)[0]
    bf16_state = PrecisionModel(input=setup.dtype, p_rounding=setup.dtype, pv_accumulation=setup.dtype)
    for tile in setup.key_tiles:  # one query tile of all rows: rows are independent, and it is fast
        outputs[bf16_state_name(tile)] = tiled_attention(problem, bf16_state, block_q=n, block_k=tile)[0]
    return {"out_max": float(np.abs(ref.out).max()), "unavailable": unavailable,
            "deviation": {name: deviation(out, ref.out) for name, out in outputs.items()}}


# --- what the page shows -------------------------------------------------------------------------

@dataclass
class GoldenRow:
    n: int
    #: max |O_ref| (the largest over the seeds): the outputs' scale, which falls as N grows here
    out_max: float
    #: implementation name -> max |O - O_ref| (the largest over the seeds): the paper's measure
    max_dev: dict
    #: implementation name -> max |O - O_ref| / max |O_ref| (the largest over the seeds):
    #: comparable across N, whose outputs shrink with these inputs
    rel_dev: dict

    def ratio(self, name: str, over: str = STANDARD) -> float | None:
        a, b = self.max_dev.get(name), self.max_dev.get(over)
        return a / b if a is not None and b else None


@dataclass
class Golden:
    setup: GoldenSetup
    rows: list
    #: names in the order the table and the plot list them
    names: list
    key_tiles: tuple
    #: why the kernels did not run (no CUDA-on-CPU runner), else None
    unavailable: str | None
    paper: str = PAPER
    paper_ratio: float = PAPER_FLASH_OVER_BASELINE
    # names for the template
    standard = STANDARD
    rounded = ROUNDED
    fa2_name = staticmethod(fa2_name)
    bf16_state_name = staticmethod(bf16_state_name)

    @property
    def own_tile(self) -> int:
        """The fa2 family's own key tile at D = 64 where measured (the ratios quote it), else the smallest."""
        own = FA2.config(64).block_n
        return own if own in self.key_tiles else min(self.key_tiles)

    @property
    def largest(self) -> GoldenRow:
        return self.rows[-1]

    def ratio_range(self, name: str) -> tuple[float, float] | None:
        """The smallest and largest deviation of `name` over standard attention's, over N."""
        ratios = [r for r in (row.ratio(name) for row in self.rows) if r is not None]
        return (min(ratios), max(ratios)) if ratios else None

    def growth(self, name: str) -> float | None:
        """Relative deviation (over max |O_ref|) at the largest N over that at the smallest."""
        first, last = self.rows[0].rel_dev.get(name), self.largest.rel_dev.get(name)
        return last / first if first and last is not None else None

    def tile_effect(self, name_of) -> float | None:
        """At the largest N: the deviation with the smallest key tile over that with the largest."""
        small, large = (self.largest.max_dev.get(name_of(t)) for t in (min(self.key_tiles), max(self.key_tiles)))
        return small / large if small is not None and large else None

    def figure(self) -> str:
        return golden_svg(self)


def summarise(data: dict) -> Golden:
    """The page's view of `measure`'s JSON."""
    setup = GoldenSetup(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["setup"].items()})
    rows = []
    for n in setup.seq_lengths:
        mine = [p for p in data["problems"] if p["n"] == n]
        names = dict.fromkeys(name for p in mine for name in p["deviation"])

        def largest(name, scale):
            return max(p["deviation"][name]["max"] / scale(p) for p in mine if name in p["deviation"])

        rows.append(GoldenRow(n, max(p["out_max"] for p in mine),
                              {name: largest(name, lambda p: 1.0) for name in names},
                              {name: largest(name, lambda p: p["out_max"]) for name in names}))
    order = ([ROUNDED, STANDARD] + [fa2_name(t) for t in setup.key_tiles]
             + [bf16_state_name(t) for t in setup.key_tiles])
    present = {name for row in rows for name in row.max_dev}
    unavailable = next((p["unavailable"] for p in data["problems"] if p["unavailable"]), None)
    return Golden(setup, rows, [name for name in order if name in present], setup.key_tiles, unavailable)


@_styled
def golden_svg(golden: Golden) -> str:
    """Two log-log panels of max |O - O_ref| / max |O_ref| vs N: the fa2 kernel (fp32 state) at
    each key tile, and the bf16-state model at each; standard attention and the rounded floor in both."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.4, 3.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    n = [row.n for row in golden.rows]
    tiles = sorted(golden.key_tiles)
    panels = (("fa2 kernel (running state fp32)", fa2_name, "tab:blue"),
              (f"tiled model, running state {golden.setup.dtype}", bf16_state_name, "tab:red"))
    for ax, (title, name_of, colour) in zip(axes, panels):
        _line(ax, golden, STANDARD, "standard attention", color="black", marker="s", ms=3, lw=1.3)
        _line(ax, golden, ROUNDED, "rounded reference (floor)", color="0.5", ls="--", lw=1.3)
        for i, tile in enumerate(tiles):
            _line(ax, golden, name_of(tile), f"key tile {tile}", color=colour, marker="o", ms=3,
                  lw=1.0, alpha=0.35 + 0.65 * i / max(1, len(tiles) - 1))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("sequence length N")
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    axes[0].set_ylabel(f"max |O − O_ref| / max |O_ref|, {golden.setup.dtype}")
    return _svg(fig)


def _line(ax, golden: Golden, name: str, label: str, **style) -> None:
    points = [(row.n, row.rel_dev[name]) for row in golden.rows if name in row.rel_dev]
    if points:
        x, y = zip(*points)
        ax.plot(x, np.maximum(y, 1e-17), label=label, **style)  # 0 would vanish from a log axis
