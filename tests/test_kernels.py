"""Our CUDA kernels: the catalogue, and every kernel x dtype x causal mode against the oracle.

The kernels run through the CUDA-on-CPU runner (no GPU needed) and, where PyCUDA and a CUDA
driver are present, through PyCUDA: on a GPU, or in CI on the fake driver
(tests/test_pycuda_fake_driver.py runs this file's PyCUDA tests there, without the large shapes). Each output is judged by the error model of the kernel's declared
precision (fa_verify.verdict), against the certified float64 reference.
"""

from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest

from fa_verify.backends import get_backend
from fa_verify.backends.cuda_kernels import (
    CpuKernelBackend,
    PyCudaKernelBackend,
    cpu_runner_availability,
    run_on_cpu,
)
from fa_verify.errors import (AttentionMismatch, BackendOutputError, InvalidArgumentError, KernelRaceError,
                              KernelRunError, KernelSanitizerError)
from fa_verify.kernels import FAMILIES, KERNELS_DIR_ENV, get_family, kernels_dir
from fa_verify.kernels.mutants import load_mutants
from fa_verify.kernels.pycuda_runner import PYCUDA_MISSING, device_properties, pycuda_availability
from fa_verify.oracle import reference
from fa_verify.precision import PrecisionModel
from fa_verify.problem import NO_WINDOW, AttentionProblem
from fa_verify.verdict import assert_attention_close, check_attention

CPU = cpu_runner_availability()
needs_cpu_runner = pytest.mark.skipif(not CPU.available, reason=CPU.reason)
PYCUDA = pycuda_availability()
needs_pycuda = pytest.mark.skipif(not PYCUDA.available, reason=f"needs PyCUDA and a CUDA driver ({PYCUDA.reason})")
#: Larger shapes, for a real GPU only: on the fake driver the CPU runner would take minutes.
LARGE_SHAPES = [(2, 8, 2, 257, 300, 128), (1, 2, 2, 100, 1000, 256)]

CAUSAL_MODES = {"non-causal": dict(causal=False),
                "bottom-right": dict(causal=True, causal_alignment="bottom-right"),
                "top-left": dict(causal=True, causal_alignment="top-left")}

#: (B, H, Hkv, Nq, Nk, D[, D_v]): N not a multiple of any tile, Nq != Nk both ways, GQA and MQA,
#: D = 96, a single query and key, D_v != D. Small, because the CPU runner runs every CUDA thread.
SHAPES = [
    (1, 2, 1, 70, 33, 64),    # MQA, Nq > Nk (bottom-right: rows 0..36 fully masked), 2 query tiles
    (1, 3, 1, 33, 130, 96),   # MQA, Nq < Nk, D = 96, 5 key tiles of 32 (4 full + 2 keys)
    (2, 2, 2, 1, 1, 32),      # one query, one key, two batches
    (1, 4, 2, 64, 64, 16),    # GQA (2 query heads per kv head), exactly one query tile
    (1, 2, 2, 129, 130, 128), # tile multiples + 1 and + 2, D = 128
    (1, 1, 1, 17, 40, 256),   # D = 256 (its own tile configuration)
    (1, 2, 1, 40, 33, 192, 128),  # D = 192, D_v = 128 (FlashAttention-3's; fa2 instantiates it)
]


def _alibi_recipe(heads):
    """ALiBi's slopes 2^(-8 h / H), h = 1 .. H, as float32 [H]."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


#: The variants, for families that implement them: name -> options for a shape (B, H, ...).
#: Windows cross tile edges and the diagonal; the softcap binds (scores ~ N(0, 1)); sinks lie
#: above and below the row max.
VARIANT_MODES = {
    "window": lambda shape: dict(window_size=(9, 4)),
    "causal-window-top-left": lambda shape: dict(causal=True, causal_alignment="top-left", window_size=(20, -1)),
    "softcap": lambda shape: dict(softcap=0.5),
    "alibi": lambda shape: dict(alibi_slopes=_alibi_recipe(shape[1])),
    "alibi-per-batch": lambda shape: dict(alibi_slopes=np.linspace(0.05, 0.6, shape[0] * shape[1], dtype=np.float32)
                                          .reshape(shape[0], shape[1])),
    "sinks": lambda shape: dict(sinks=np.linspace(-1.0, 2.5, shape[1], dtype=np.float32)),
    "all": lambda shape: dict(causal=True, window_size=(24, -1), softcap=2.0, alibi_slopes=_alibi_recipe(shape[1]),
                              sinks=np.full(shape[1], 1.5, np.float32)),
}
#: Shapes for the variants: Nq > Nk and Nq < Nk (the offset Nk - Nq both ways), MQA and GQA.
VARIANT_SHAPES = [SHAPES[0], SHAPES[1], (2, 4, 2, 40, 75, 32)]


def make_problem(shape, dtype, seed=0, **causal) -> AttentionProblem:
    B, H, Hkv, Nq, Nk, D, *Dv = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Nq, D))
    k = rng.standard_normal((B, Hkv, Nk, D))
    v = rng.standard_normal((B, Hkv, Nk, *(Dv or [D])))
    return AttentionProblem.from_float(q, k, v, dtype, **causal)


#: The families of dense problems, which the oracle grid below runs (fa3_fp8's FP8 problems:
#: tests/test_fp8_kernel.py).
DENSE = {name: family for name, family in FAMILIES.items() if family.kind == "dense"}


def kernel_cases():
    for family in DENSE.values():
        for dtype in family.dtypes:
            for mode in CAUSAL_MODES:
                yield pytest.param(family.name, dtype, mode, id=f"{family.name}-{dtype}-{mode}")


# --- the catalogue ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_catalogue_matches_the_instantiations_in_the_source(name):
    """Each `FA_FOR_EACH_*DTYPE(<NAME>_ENTRY, D, ...)` line of the .cu is the catalogue's config for D,
    each `FA_FOR_EACH_*DTYPE(<NAME>_ENTRY_V, D, D_v, ...)` line its config for (D, D_v)."""
    family = get_family(name)
    source = family.source_path.read_text()
    macro = f"{name.upper()}_ENTRY"
    found = {}
    for dtypes_macro, paired, args in re.findall(rf"^(FA_FOR_EACH_\w*DTYPE)\({macro}(_V)?, ([^)]*)\)", source, re.M):
        values = [int(a) for a in args.split(",")]
        dims = 2 if paired else 1
        found[tuple(values[:dims]) if paired else values[0]] = (dtypes_macro, tuple(values[dims:]))
    assert set(found) == set(family.configs)
    for d, (dtypes_macro, values) in found.items():
        cfg = family.configs[d]
        expected = ((cfg.block_m, cfg.threads) if cfg.block_n is None   # naive: rows per block
                    else (cfg.block_m, cfg.block_n, cfg.threads))
        assert values == expected, f"{name} D={d}: source {values}, catalogue {expected}"
        assert dtypes_macro == {("fp16", "bf16"): "FA_FOR_EACH_HALF_DTYPE",
                                ("e4m3", "e5m2"): "FA_FOR_EACH_FP8_DTYPE"}.get(family.dtypes, "FA_FOR_EACH_DTYPE")
    assert re.search(rf"\b{name}_##DT##_d##D\b", source), "entries are named <family>_<dtype>_d<D>"
    assert all(family.config(d).threads % 32 == 0 for d in family.head_dims)


def test_a_d_v_pair_has_its_own_entry_and_shared_memory():
    fa2 = get_family("fa2")
    p = make_problem((1, 2, 1, 40, 33, 192, 128), "bf16")
    launch = fa2.launch(p)
    assert launch.entry == "fa2_bf16_d192v128" and launch.grid == (2, 2, 1)
    assert launch.shared_bytes == fa2.shared_bytes(192, "bf16", 128) == fa2.resources(launch.entry)[1]
    assert fa2.head_dims_v == (128,) and fa2.head_dim_pairs == ((192, 128),)
    assert "D=192 with D_v=128" in fa2.supports(make_problem((1, 1, 1, 4, 4, 192), "bf16"))
    assert "no entry for D=64 with D_v=128" in fa2.supports(make_problem((1, 1, 1, 4, 4, 64, 128), "bf16"))


def test_launch_geometry():
    fa2, naive = get_family("fa2"), get_family("naive")
    p = make_problem((2, 4, 2, 70, 33, 64), "fp16", causal=True, causal_alignment="bottom-right")
    launch = fa2.launch(p)
    assert launch.entry == "fa2_fp16_d64"
    assert launch.grid == (2, 4, 2) and launch.block == (128, 1, 1)
    assert launch.scalars == (2, 4, 2, 70, 33, pytest.approx(1 / 8), 1, 33 - 70)
    assert launch.shared_bytes == fa2.shared_bytes(64, "fp16") <= 48 * 1024
    top_left = fa2.launch(p.replace(causal_alignment="top-left"))
    assert top_left.scalars[-2:] == (1, 0)
    assert fa2.launch(p.replace(causal=False)).scalars[-2:] == (0, 33 - 70)  # the window and ALiBi use it
    assert launch.trailing_args == (-1, -1, 0.0, None, 0, None)
    assert len(launch.signature) == 13 + 6 and launch.scratch_elements == 0
    variants = fa2.launch(p.replace(window_size=(3, 1), softcap=2.5, alibi_slopes=np.ones((2, 4), np.float32),
                                    sinks=np.arange(4, dtype=np.float32)))
    assert variants.trailing_args == (3, 1, 2.5, (1.0,) * 8, 4, (0.0, 1.0, 2.0, 3.0))
    assert fa2.launch(p.replace(window_size=(2**40, 5))).trailing_args[:2] == (70 + 33, 5)  # fits an int
    assert "naive does not implement window" in naive.supports(p.replace(window_size=(3, 1)))
    n = naive.launch(p)
    assert n.signature[-1] == "ptr" and len(n.signature) == 14 and n.trailing_args == ()
    assert n.scratch_elements == 2 * 4 * 70 * 33 and n.grid == (5, 4, 2) and n.shared_bytes == 0
    assert n.scratch_dtype == "fp32" and get_family("naive16").launch(p).scratch_dtype == "fp16"
    assert launch.scratch_dtype is None


def test_supports_and_precision():
    wmma, fa2 = get_family("wmma"), get_family("fa2")
    assert "no fp32 entry" in wmma.supports(make_problem((1, 1, 1, 4, 4, 64), "fp32"))
    assert "no entry for D=40" in fa2.supports(make_problem((1, 1, 1, 4, 4, 40), "fp16"))
    assert "allows 1000" in fa2.supports(make_problem((1, 1, 1, 4, 4, 128), "fp16"), shared_limit=1000)
    with pytest.raises(InvalidArgumentError, match="no entry for D=40"):
        fa2.launch(make_problem((1, 1, 1, 4, 4, 40), "fp16"))
    assert fa2.precision("bf16") == PrecisionModel.flash("bf16")
    assert get_family("naive16").precision("fp16").score_accumulation == "fp16"
    assert get_family("naive").precision("bf16") == PrecisionModel.fp32_accumulate("bf16")
    with pytest.raises(InvalidArgumentError, match="kernel families: fa2, wmma, mma_ptx, naive, naive16"):
        get_family("fa3")


def test_kernels_dir_override(monkeypatch, tmp_path):
    assert (kernels_dir() / "fa_common.cuh").is_file()
    monkeypatch.setenv(KERNELS_DIR_ENV, str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="no fa_common.cuh"):
        kernels_dir()
    (tmp_path / "fa_common.cuh").write_text("")
    assert kernels_dir() == tmp_path.resolve()
    assert get_family("fa2").source_path == tmp_path.resolve() / "fa2.cu"


def test_backends_are_registered():
    for family in FAMILIES.values():
        cpu, gpu = get_backend(f"{family.label}-cpu"), get_backend(f"{family.label}-pycuda")
        assert isinstance(cpu, CpuKernelBackend) and isinstance(gpu, PyCudaKernelBackend)
        assert cpu.dtypes == gpu.dtypes == family.dtypes
        assert cpu.precision("fp16") == family.precision("fp16")
    if not PYCUDA.available:
        reason = get_backend("fa2-pycuda").availability().reason
        assert reason == PYCUDA_MISSING or "driver" in reason or "nvcc" in reason or "device" in reason


# --- every kernel x dtype x causal mode through the CPU runner ------------------------------------------


@needs_cpu_runner
@pytest.mark.parametrize("family_name, dtype, mode", list(kernel_cases()))
def test_kernel_matches_oracle_on_cpu(family_name, dtype, mode):
    backend = CpuKernelBackend(family_name)
    ran = 0
    for shape in SHAPES:
        problem = make_problem(shape, dtype, seed=zlib.crc32(f"{family_name}-{dtype}-{mode}".encode()),
                               **CAUSAL_MODES[mode])
        if backend.supports(problem) is not None:
            continue
        out, lse = backend.run(problem)
        assert_attention_close(out, problem, lse=lse, precision=backend.precision(dtype))
        ran += 1
    assert ran, f"{family_name} supports none of the grid's shapes"


def variant_cases():
    for family in FAMILIES.values():
        if family.features:
            for dtype in family.dtypes:
                for mode in VARIANT_MODES:
                    yield pytest.param(family.name, dtype, mode, id=f"{family.name}-{dtype}-{mode}")


@needs_cpu_runner
@pytest.mark.parametrize("family_name, dtype, mode", list(variant_cases()))
def test_kernel_variants_match_oracle_on_cpu(family_name, dtype, mode):
    backend = CpuKernelBackend(family_name)
    assert set(backend.features) == {"window", "softcap", "alibi", "sinks"}
    for shape in VARIANT_SHAPES:
        problem = make_problem(shape, dtype, seed=zlib.crc32(f"{family_name}-{dtype}-{mode}".encode()),
                               **VARIANT_MODES[mode](shape))
        out, lse = backend.run(problem)
        assert_attention_close(out, problem, lse=lse, precision=backend.precision(dtype))


@needs_cpu_runner
def test_windowed_rows_without_keys_and_sinks():
    """Rows whose window holds no key: o = 0 and lse = -inf, or lse = the head's sink."""
    backend = CpuKernelBackend("fa2")
    p = make_problem((1, 2, 1, 40, 20, 32), "fp32", window_size=(2, 0))  # rows 0..19 end before key 0
    out, lse = backend.run(p)
    assert np.all(out[0, :, :18] == 0) and np.all(lse[0, :, :18] == -np.inf) and np.isfinite(lse[0, :, 20:]).all()
    sinks = np.array([0.75, -3.0], np.float32)
    out, lse = backend.run(p.replace(sinks=sinks))
    assert np.all(out[0, :, :18] == 0) and np.array_equal(lse[0, :, :18], np.repeat(sinks[:, None], 18, axis=1))
    dense, wide = backend.run(p.replace(window_size=NO_WINDOW)), backend.run(p.replace(window_size=(2**40, 2**40)))
    assert all(np.array_equal(x, y) for x, y in zip(dense, wide))


@needs_cpu_runner
def test_causal_alignments_differ_and_rows_fully_masked():
    """Bottom-right with Nq > Nk masks whole rows (0, -inf); top-left does not: the offset is used."""
    backend = CpuKernelBackend("fa2")
    p = make_problem((1, 1, 1, 40, 20, 32), "fp32", causal=True, causal_alignment="bottom-right")
    out, lse = backend.run(p)
    assert np.all(out[0, 0, :20] == 0) and np.all(lse[0, 0, :20] == -np.inf)
    assert np.all(np.isfinite(lse[0, 0, 20:]))
    out_tl, lse_tl = backend.run(p.replace(causal_alignment="top-left"))
    assert np.all(np.isfinite(lse_tl)) and not np.array_equal(out, out_tl)
    check = check_attention(out_tl, p.replace(causal_alignment="top-left"), lse=lse_tl,
                            precision=backend.precision("fp32"))
    assert check.passed, check.message()


@needs_cpu_runner
def test_outputs_start_as_nan_so_unwritten_elements_are_reported():
    """run_on_cpu fills outputs with a sentinel NaN: a kernel that skips elements is reported."""

    class WritesNothing:
        def launch(self, *args, **options):
            pass

    family = get_family("fa2")
    for dtype in ("fp32", "fp16", "bf16"):
        p = make_problem((1, 1, 1, 5, 7, 16), dtype)
        with pytest.raises(BackendOutputError, match=r"o: 80 / 80 elements never written \(first at \[0, 0, 0, 0\]"):
            run_on_cpu(family, p, module=WritesNothing())
    o, lse = run_on_cpu(family, p)
    assert np.isfinite(o.view(p.q.dtype).astype(np.float32)).all() and np.isfinite(lse).all()


@needs_cpu_runner
@pytest.mark.parametrize("family_name", list(DENSE))
def test_sanitizer_run_is_clean(family_name):
    """AddressSanitizer (global and shared memory) sees no invalid access, all three causal modes."""
    backend = CpuKernelBackend(family_name, sanitize=True)
    assert backend.name.endswith("-cpu-asan")
    dtype = backend.dtypes[0]
    cases = [(shape, CAUSAL_MODES[mode]) for mode in CAUSAL_MODES for shape in (SHAPES[0], SHAPES[1], SHAPES[5])]
    if backend.features:  # the slopes' batch stride, the sinks, key tiles skipped by the window
        cases += [(shape, VARIANT_MODES[mode](shape)) for mode in ("alibi-per-batch", "all") for shape in VARIANT_SHAPES]
    for shape, options in cases:
        problem = make_problem(shape, dtype, seed=3, **options)
        out, lse = backend.run(problem)  # raises KernelSanitizerError on a report
        assert_attention_close(out, problem, lse=lse, precision=backend.precision(dtype))


@needs_cpu_runner
def test_build_command_for_the_cpu_runner(capsys):
    from fa_verify.cli.main import main

    assert main(["build", "--cpu", "--kernel", "fa2,wmma", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and [row["family"] for row in report["cpu"]] == ["fa2", "wmma"]


@needs_cpu_runner
@pytest.mark.parametrize("family_name", [f if f == "fa2" else pytest.param(f, marks=pytest.mark.slow)
                                         for f in FAMILIES])
def test_check_command_on_each_cpu_kernel_backend(family_name, capsys):
    """`fa_verify check <kernel>-cpu`: the fixed edge cases plus a few Hypothesis problems pass.
    fa2 in the default run (the command's path); the others marked slow, as the default run's
    properties/ suite searches every property on every kernel already.

    naive16 gets the profile's 20 examples: its scores are summed in fp16/bf16, so in bf16 its
    merge-law tolerance admits even a zero output on most examples (the null-model guard calls
    them uninformative), and 5 examples may hold no informative one."""
    from fa_verify.cli.main import main

    name = f"{get_family(family_name).label}-cpu"
    examples = [] if family_name == "naive16" else ["--max-examples", "5"]
    assert main(["check", name, *examples, "--json"]) == 0, capsys.readouterr().out
    assert '"passed": true' in capsys.readouterr().out


# --- mutants: broken kernels the tests above must catch -------------------------------------------------

MUTANTS = load_mutants()


def test_mutants_apply_to_the_current_sources(tmp_path):
    assert {m.caught_by for m in MUTANTS} == {"oracle", "sanitizer", "property", "race"}
    for mutant in MUTANTS:
        path = mutant.materialise(tmp_path / mutant.name)
        assert path.read_text() != mutant.kernel_family.source_path.read_text()
        assert (path.parent / "fa_common.cuh").is_file()


def oracle_grid(family):
    """(mode, shape, options): SHAPES x causal modes, and VARIANT_SHAPES x the variants the family implements."""
    for mode, options in CAUSAL_MODES.items():
        for shape in SHAPES:
            yield mode, shape, options
    for mode, options in VARIANT_MODES.items() if family.features else ():
        for shape in VARIANT_SHAPES:
            yield mode, shape, options(shape)


def oracle_failures(family, module, dtype="fp16"):
    """Run the oracle grid (oracle_grid) on `module`; the failures it finds."""
    failures = []
    dtype = dtype if dtype in family.dtypes else family.dtypes[0]
    for mode, shape, options in oracle_grid(family):
        problem = make_problem(shape, dtype, seed=5, **options)
        if family.supports(problem) is not None:
            continue
        try:
            o, lse = run_on_cpu(family, problem, module=module)
            out = o.view(problem.q.dtype).reshape(problem.out_shape)
            assert_attention_close(out, problem, lse=lse, precision=family.precision(dtype))
        except (AttentionMismatch, BackendOutputError, KernelRunError) as exc:
            failures.append(f"{mode} {shape}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return failures


def grid_mutants():
    """Mutants the fixed grid catches (tests/test_judge.py shows the property suite finds the
    others; the split-KV kernel's have their own grid, tests/test_split_kv.py): the first of each
    family and catcher (oracle grid, AddressSanitizer, race detector) in the default run, the
    others marked slow (~5 s each; `python3 -m pytest -m slow` and .ci/run run them)."""
    seen = set()
    for m in MUTANTS:
        if m.caught_by != "property" and m.family in FAMILIES:
            first = (m.family, m.caught_by) not in seen
            seen.add((m.family, m.caught_by))
            yield pytest.param(m, id=m.name, marks=[] if first else [pytest.mark.slow])


@needs_cpu_runner
@pytest.mark.parametrize("mutant", list(grid_mutants()))
def test_mutant_is_caught(mutant):
    from fa_verify.judge.mutants import mutant_module

    family = mutant.kernel_family
    sanitize, racecheck = mutant.caught_by == "sanitizer", mutant.caught_by == "race"
    module = mutant_module(mutant, sanitize=sanitize, racecheck=racecheck)
    if not (sanitize or racecheck):
        failures = oracle_failures(family, module)
        assert failures, f"mutant {mutant.name} ({mutant.description}) passed every oracle check"
        return
    problem = make_problem(SHAPES[0 if sanitize else 1], family.dtypes[0], seed=5)  # 2 blocks, or 5 key tiles
    with pytest.raises(KernelSanitizerError if sanitize else KernelRaceError,
                       match="AddressSanitizer|out of bounds|overflow" if sanitize else "data race"):
        run_on_cpu(family, problem, module=module)


# --- the PyCUDA worker's protocol, with a fake worker (no GPU needed) --------------------------------------

FAKE_WORKER = """
import os, signal, sys, time
import numpy as np
from fa_verify.kernels.pycuda_runner import _receive, _send
stdin, stdout = os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb")
_send(stdout, ("ready", "sm_90", "fake worker device", 232448, "fa_verify"))
while True:
    request = _receive(stdin)
    if request[0] == "compile":
        _send(stdout, ("ok",))
        continue
    family, launch, q, k, v = request
    what = int(q.flat[0])  # the test says what to do through q[0]
    if what == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == 2:
        time.sleep(60)
    if what == 3:
        _send(stdout, ("error", "LaunchError", "an illegal memory access was encountered", False))
        sys.exit(0)
    B, H, Hkv, Nq = launch.scalars[:4]
    _send(stdout, ("ok", np.zeros_like(q), np.full((B, H, Nq), float(launch.grid[0]), np.float32)))
"""


def test_pycuda_worker_reports_crashes_and_timeouts_and_restarts(tmp_path):
    import sys

    from fa_verify.errors import KernelCrashError, KernelTimeoutError
    from fa_verify.kernels.pycuda_runner import PyCudaWorker

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    worker = PyCudaWorker(timeout=3, command=[sys.executable, str(script)])
    family = get_family("fa2")
    p = make_problem((1, 2, 1, 70, 33, 64), "fp32")
    launch = family.launch(p)

    def run(code):
        q = p.q.copy()
        q.flat[0] = code
        return worker.run(family, launch, q, p.k, p.v)

    try:
        o, lse = run(0)
        assert o.shape == p.q.shape and lse[0, 0, 0] == 2 and worker.device_name == "fake worker device"
        with pytest.raises(KernelCrashError, match="kernel crashed: SIGSEGV"):
            run(1)
        assert run(0)[1].shape == (1, 2, 70)  # a fresh worker
        with pytest.raises(KernelRunError, match="illegal memory access"):
            run(3)
        with pytest.raises(KernelTimeoutError, match="timed out after 3 s"):
            run(2)
        run(0)
        assert worker.starts == 4
    finally:
        worker.close()


# --- the same through PyCUDA (a GPU, or the fake driver) ------------------------------------------------


@needs_pycuda
@pytest.mark.parametrize("family_name, dtype, mode", list(kernel_cases()))
def test_kernel_matches_oracle_through_pycuda(family_name, dtype, mode):
    backend = PyCudaKernelBackend(family_name)
    ran = 0
    large = [] if "fake driver" in device_properties()[1] else LARGE_SHAPES
    for shape in SHAPES + large:
        problem = make_problem(shape, dtype, seed=1, **CAUSAL_MODES[mode])
        if backend.supports(problem) is not None:
            continue
        out, lse = backend.run(problem)
        assert_attention_close(out, problem, lse=lse, precision=backend.precision(dtype),
                               reference=reference(problem))
        ran += 1
    assert ran, f"{family_name} supports none of the grid's shapes"


@needs_pycuda
@pytest.mark.parametrize("family_name, dtype, mode", list(variant_cases()))
def test_kernel_variants_match_oracle_through_pycuda(family_name, dtype, mode):
    backend = PyCudaKernelBackend(family_name)
    for shape in VARIANT_SHAPES:
        problem = make_problem(shape, dtype, seed=2, **VARIANT_MODES[mode](shape))
        out, lse = backend.run(problem)
        assert_attention_close(out, problem, lse=lse, precision=backend.precision(dtype))


@needs_pycuda
@needs_cpu_runner
@pytest.mark.parametrize("family_name", ["fa2", "naive"])
def test_pycuda_and_cpu_runner_agree_on_fp32(family_name):
    """Same source, same order of operations: fp32 results agree to a few ulps (expf may differ)."""
    p = make_problem((1, 2, 1, 70, 90, 64), "fp32", causal=True)
    gpu, gpu_lse = PyCudaKernelBackend(family_name).run(p)
    cpu, cpu_lse = CpuKernelBackend(family_name).run(p)
    np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gpu_lse, cpu_lse, rtol=1e-5, atol=1e-6)
