"""The FP8 judging table (`fa_verify mutants --fp8`): the FP8 gates others use
(fa_verify.judge.fp8_rules), each threshold checked against an independent recomputation on
outputs that straddle it; the campaign over seeds on two mutants; a mutant of mutants.toml whose
kernel runs FP8 problems joining the table with no new code; and (slow) the table of
docs/results.md regenerated and compared.

Three seeds of the table rerun with -m slow; the whole 20-seed table (18 min on 2 cores, over
CI's 600 s a test) is a campaign:
    PYTHONPATH=. python3 -m pytest -n 0 -m campaign tests/test_fp8_table.py
"""

import dataclasses
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fa_verify.backends.numpy_fp8 import NumpyFP8Backend
from fa_verify.cli.main import main
from fa_verify.judge import fp8_rules
from fa_verify.judge.fp8_mutants import EMULATED_MUTANTS, MutantFP8Backend
from fa_verify.judge.fp8_rules import (
    FP8_RULES,
    FlashAttentionFP8Rule,
    FlashInferMSERule,
    TorchaoSQNRRule,
    TransformerEngineRule,
    fp8_cases,
)
from fa_verify.judge.over_seeds import fp8_mutants, run_over_seeds, table_between_markers
from fa_verify.judge.rule_table import RULE_NAMES
from fa_verify.oracle.fp8 import reference_fp8
from fa_verify.properties import Selection

DOCS = Path(__file__).resolve().parent.parent / "docs" / "results.md"


def _cases(kv_cache: bool):
    return [c for c in fp8_cases(3) if (c.problem.k_descale.size == 1) == kv_cache]


def _true_inputs(p):
    """q, k, v times their descales, in float64, k and v repeated to q's heads (independently of
    FP8Problem.descale)."""
    G = p.heads // p.kv_heads

    def per_kv(d):
        d = np.asarray(d, np.float64)
        return np.broadcast_to(d.reshape(-1, 1) if d.size == 1 else d, (p.batch, p.kv_heads))

    q = p.q.astype(np.float64) * np.repeat(per_kv(p.q_descale), G, axis=1)[..., None, None]
    k = np.repeat(p.k.astype(np.float64) * per_kv(p.k_descale)[..., None, None], G, axis=1)
    v = np.repeat(p.v.astype(np.float64) * per_kv(p.v_descale)[..., None, None], G, axis=1)
    return q, k, v


def _fp8_p_baseline(p):
    q, k, v = _true_inputs(p)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    if p.causal:
        nq, nk = s.shape[-2:]
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = (w / w.sum(-1, keepdims=True)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (w @ v).astype(ml_dtypes.bfloat16)


def _bf16(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(ml_dtypes.bfloat16)


def _straddling(stat, threshold, ref, seed):
    """Outputs ref + t noise whose statistic `stat(out)` (monotone in t) runs finely across
    `threshold`: t0 where it equals the threshold (bisection), t from 0.95 t0 to 1.05 t0."""
    noise = np.random.default_rng(seed).standard_normal(ref.shape)
    lo, hi = 1e-9, 1e3
    rising = stat(ref + hi * noise) > stat(ref + lo * noise)
    for _ in range(200):
        mid = np.sqrt(lo * hi)
        lo, hi = (mid, hi) if (stat(ref + mid * noise) < threshold) == rising else (lo, mid)
    return [ref + t * noise for t in lo * np.linspace(0.95, 1.05, 41)]


def _ref(case):
    return reference_fp8(case.problem).out


@pytest.mark.parametrize("rule, stat, threshold, passes", [
    (TransformerEngineRule(), lambda out, ref: np.sqrt(np.mean((out - ref) ** 2)) / (ref.max() - ref.min()), 0.11,
     lambda v: v < 0.11),
    (FlashInferMSERule(), lambda out, ref: np.mean((out - ref) ** 2), 1.0, lambda v: v < 1.0),
    (TorchaoSQNRRule(), lambda out, ref: 20 * np.log10(np.linalg.norm(ref) / np.linalg.norm(out - ref)), 25.0,
     lambda v: v > 25.0),
], ids=["transformer-engine", "flashinfer-mse", "torchao-sqnr"])
def test_each_error_gate_fails_exactly_past_its_threshold(rule, stat, threshold, passes):
    case = _cases(False)[0]
    ref = _ref(case)
    verdicts = []
    for out in _straddling(lambda o: stat(o, ref), threshold, ref, 0):
        value = stat(out, ref)
        assert (rule.judge(out, case) is None) == passes(value), value
        verdicts.append(passes(value))
    assert True in verdicts and False in verdicts
    assert rule.judge(ref, case) is None  # an exact output passes (SQNR infinite)


@pytest.mark.parametrize("kv_cache, mult", [(False, 2.0), (True, 4.0)], ids=["2x", "4x-kvcache"])
def test_the_flash_attention_gate_is_mult_times_an_fp8_p_baselines_error_plus_its_atol(kv_cache, mult):
    case = _cases(kv_cache)[0]
    p = case.problem
    ref = _bf16(reference_fp8(p).out)
    ref64 = ref.astype(np.float64)

    def diff(x):  # max |x - ref|, the difference rounded to bf16 as a bf16 tensor subtraction is
        return float(np.abs(_bf16(np.asarray(x).astype(np.float64) - ref64).astype(np.float64)).max())

    err_pt = diff(_fp8_p_baseline(p))
    atol = 2 * diff(_bf16(_bf16(ref64 + 0.3).astype(np.float64) - 0.3))
    allowed = mult * err_pt + atol
    rng = np.random.default_rng(2)
    verdicts = []
    for ratio in np.linspace(0.8, 1.2, 41):
        # one element moved by about ratio x allowed
        out = ref64.copy()
        i = tuple(rng.integers(0, n) for n in out.shape)
        out[i] += ratio * allowed
        out = _bf16(out)
        err = diff(out)
        assert (FlashAttentionFP8Rule().judge(out, case) is None) == (err <= allowed), (ratio, err, allowed)
        verdicts.append(err <= allowed)
    assert True in verdicts and False in verdicts


def test_the_fp8_cases_draw_descales_from_their_range_never_one_and_distinct():
    lo, hi = fp8_rules.DESCALE_RANGE
    assert (lo, hi) == (0.25, 2.0)
    values = []
    for seed in range(10):
        for case in fp8_cases(seed):
            d = [getattr(case.problem, n) for n in ("q_descale", "k_descale", "v_descale")]
            values += [x.ravel() for x in d]
            assert len({float(v) for x in d for v in x.ravel()}) == sum(x.size for x in d)  # all distinct
    values = np.concatenate(values)
    assert (values >= lo).all() and (values < hi).all() and (values != 1).all()
    assert values.min() < lo + 0.05 and values.max() > hi - 0.05  # the whole range is drawn
    assert all((np.asarray(getattr(c.problem, n)) == 1).all() for c in fp8_cases(0, unit=True)
               for n in ("q_descale", "k_descale", "v_descale"))


def test_the_fp8_cases_cover_gqa_causal_mha_and_a_kv_cache():
    problems = [c.problem for c in fp8_cases(0)]
    assert any(p.kv_heads < p.heads for p in problems) and any(p.kv_heads == p.heads and p.batch > 1
                                                               for p in problems)
    assert any(p.causal and p.nq != p.nk for p in problems)
    assert [p.k_descale.size == 1 and p.v_descale.size == 1 and p.nq == 1 for p in problems].count(True) == 1
    assert all(p.dtype == "e4m3" and p.output_dtype == "bf16" for p in problems)


def test_the_fp8_gates_are_rules_of_the_side_by_side():
    assert [r.name for r in FP8_RULES] == ["flash-attention-fp8", "transformer-engine", "torchao-sqnr",
                                           "flashinfer-mse", "unit-descales"]
    assert set(RULE_NAMES) >= {r.name for r in FP8_RULES} and all(r.kind == "fp8" for r in FP8_RULES)


def test_the_campaign_over_seeds_on_two_mutants():
    mutants = [m for m in EMULATED_MUTANTS if m.name in ("k_descale_dropped", "lse_without_compensation")]
    table = run_over_seeds(mutants, FP8_RULES, range(1), Selection(max_examples=2, shrink=False))
    honest = table.row("numpy-fa3-fp8")
    assert honest.control and honest.suite == [] and all(v == [] for v in honest.rules.values())
    dropped, lse = table.row("k_descale_dropped"), table.row("lse_without_compensation")
    assert dropped.suite == lse.suite == [0] and table.passed
    # the output-only gates cannot see an LSE bug; unit descales cannot see a dropped descale
    assert all(lse.rules[r] == [] for r in ("flash-attention-fp8", "transformer-engine", "torchao-sqnr",
                                            "flashinfer-mse"))
    assert lse.rules["unit-descales"] == [0] and dropped.rules["unit-descales"] == []
    assert dropped.rules["flash-attention-fp8"] == [0]
    md = table.markdown().splitlines()
    assert md[2].startswith("| `numpy-fa3-fp8` (correct) | - | 0 / 1 false positives | 0 / 1 |")
    # killed on its first drawn example of fp8_agreement, after the dense properties that run first passed
    assert re.match(r"\| `k_descale_dropped` \| descale dropped \| 1 / 1 \((\d+), \1\) \| 1 / 1 \|", md[3]), md[3]


def test_a_mutant_of_mutants_toml_whose_kernel_runs_fp8_joins_the_table(monkeypatch):
    from fa_verify.judge import mutants as judge_mutants
    from fa_verify.kernels.mutants import load_mutants

    some = load_mutants()[0]
    real = judge_mutants.unmutated_backend
    monkeypatch.setattr(judge_mutants, "unmutated_backend",
                        lambda m: NumpyFP8Backend() if m.name == some.name else real(m))
    names = [m.name for m in fp8_mutants()]
    cuda = [m.name for m in load_mutants() if m.family == "fa3_fp8" or m.name == some.name]  # our FP8 kernel's
    assert names == [m.name for m in EMULATED_MUTANTS] + cuda and len(cuda) == 9


def test_markdown_into_without_fp8_is_a_usage_error(tmp_path, capsys):
    assert main(["mutants", "--markdown-into", str(tmp_path / "x.md")]) == 2
    assert main(["mutants", "--fp8", "--mutant", "no-such-mutant"]) == 2


def test_mutant_fp8_backend_names_the_known_mutants():
    with pytest.raises(Exception, match="k_descale_dropped"):
        MutantFP8Backend("nope")


def _cells(markdown):
    """target -> its cells (the bug class left out), each "no case" or (seeds failed, seeds run)."""
    table = {}
    for line in markdown.splitlines()[2:]:
        name, _, *cells = [c.strip() for c in line.strip("|").split("|")]
        table[name] = [c if c == "no case" else tuple(map(int, re.match(r"(\d+) / (\d+)", c).groups()))
                       for c in cells]
    return table


def _subset_agrees(subset, full):
    """A run over n of the full table's N seeds can have failed a target on j seeds only if the
    N-seed count k allows it: k - (N - n) <= j <= min(n, k)."""
    if subset == "no case" or full == "no case":
        return subset == full
    (j, n), (k, N) = subset, full
    return max(0, k - (N - n)) <= j <= min(n, k)


@pytest.mark.slow
def test_three_seeds_of_the_fp8_judging_table_agree_with_the_docs():
    """Seeds 0-2 of `fa_verify mutants --fp8 --seeds 20` rerun (about 3 min on 2 cores): every
    count of docs/results.md's table allows what they give, so a cell of 20 / 20 or 0 / 20 must
    come out 3 / 3 or 0 / 3, and the suite kills every mutant on each of them."""
    from fa_verify.profiles import DEFAULT_PROFILE

    selection = dataclasses.replace(Selection.from_profile(DEFAULT_PROFILE), shrink=False)
    table = run_over_seeds(fp8_mutants(), FP8_RULES, range(3), selection)
    ours, docs = _cells(table.markdown()), _cells(table_between_markers(DOCS))
    assert list(ours) == list(docs)
    disagreeing = [(name, i) for name in ours for i, (a, b) in enumerate(zip(ours[name], docs[name]))
                   if not _subset_agrees(a, b)]
    assert disagreeing == [] and table.passed


def test_the_subset_rule_of_the_table_check():
    assert _subset_agrees((3, 3), (20, 20)) and not _subset_agrees((2, 3), (20, 20))
    assert _subset_agrees((0, 3), (0, 20)) and not _subset_agrees((1, 3), (0, 20))
    assert _subset_agrees((0, 3), (17, 20)) and not _subset_agrees((0, 3), (18, 20))
    assert _subset_agrees((1, 3), (1, 20)) and not _subset_agrees((2, 3), (1, 20))
    assert _subset_agrees("no case", "no case") and not _subset_agrees((0, 3), "no case")
    docs = _cells(table_between_markers(DOCS))
    assert docs["`numpy-fa3-fp8` (correct)"][0] == (0, 20) and docs["`k_descale_dropped`"][0] == (20, 20)


@pytest.mark.campaign
@pytest.mark.timeout(7200)
def test_the_fp8_judging_table_of_the_docs_regenerates():
    """`fa_verify mutants --fp8 --seeds 20`'s table, as docs/results.md holds it (18 min on 2
    cores; a campaign, `python3 -m pytest -m campaign`): every count of seeds exactly; the examples
    to a kill (the bracketed median and largest) are left out of the comparison, as one CUDA
    mutant's median came out 6.5 in one run and 7.5 in another (cause not yet found; the kills and
    false positives were the same)."""
    from fa_verify.profiles import DEFAULT_PROFILE

    selection = dataclasses.replace(Selection.from_profile(DEFAULT_PROFILE), shrink=False)
    table = run_over_seeds(fp8_mutants(), FP8_RULES, range(20), selection)
    assert _cells(table.markdown()) == _cells(table_between_markers(DOCS))
    assert table.passed
