"""Reproducers (`fa_verify.properties.reproduce`): the script a failure leaves behind replays it
from any folder, with the environment it failed under, and says when it no longer fails."""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fa_verify.backends import CallableBackend, get_backend
from fa_verify.cli.main import main
from fa_verify.properties import Selection, search_property
from fa_verify.properties.reproduce import (
    NotReproducible,
    Target,
    callable_options,
    load_problem,
    relevant_environment,
    save_problem,
)
from fa_verify.strategies import make_problem

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import attention_variants as variants  # noqa: E402
import user_kernels  # noqa: E402

#: A user's module: wrong (it drops the last key) until a file FIXED lies beside it, or while
#: TRITON_INTERPRET=1 for `interpreted`; `run` is `attention` as a run(problem) function.
KERNEL = '''
import os
from user_kernels_copy import _attention

HERE = os.path.dirname(os.path.abspath(__file__))


def attention(q, k, v, *, causal, scale):
    fixed = os.path.exists(os.path.join(HERE, "FIXED"))
    return _attention(q, k, v, causal, scale, drop_last_key=not fixed)


def interpreted(q, k, v, *, causal, scale):
    return _attention(q, k, v, causal, scale, drop_last_key=os.environ.get("TRITON_INTERPRET") == "1")


def run(problem):
    return attention(problem.q, problem.k, problem.v, causal=problem.causal, scale=problem.scale_value)
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder holding the user's module, the current folder while the check runs."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(FIXTURES / "user_kernels.py", folder / "user_kernels_copy.py")
    (folder / "my_kernels.py").write_text(KERNEL)
    monkeypatch.chdir(folder)
    yield folder
    for name in ("my_kernels", "user_kernels_copy"):  # the next test's copy is another module
        sys.modules.pop(name, None)


def _check(capsys, *args):
    code = main(["check", *args, "--property", "oracle_agreement", "--dtype", "bf16", "--max-examples", "20",
                 "--repro-dir", "repro", "--json"])
    return code, json.loads(capsys.readouterr().out)


def _replay(script, cwd, **env):
    """Run a reproducer in `cwd` without this test process's PYTHONPATH (the script carries its own)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=cwd,
                          env={**environ, **env}, timeout=120)


def _rule(text: str) -> str:
    return re.search(r"failed rule '(\w+)'", text).group(1)


def test_check_writes_a_reproducer_that_fails_from_any_folder_and_passes_once_fixed(capsys, project, tmp_path):
    code, document = _check(capsys, "my_kernels:attention")
    [prop] = document["targets"][0]["properties"]
    assert code == 1 and prop["status"] == "failed"
    files = prop["reproducer_files"]
    script = Path(files["script"])
    assert script.parent == project / "repro" and Path(files["inputs"]) == script.with_suffix(".npz")
    assert re.fullmatch(r"repro_oracle_agreement_[0-9a-f]{10}\.py", script.name)
    assert prop["reproducer"] == f"python3 repro/{script.name}"  # short: relative to where check ran

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rerun = _replay(script, elsewhere)
    assert rerun.returncode == 1, rerun.stderr
    assert "property 'oracle_agreement' failed" in rerun.stdout and _rule(rerun.stdout) == _rule(prop["failure"])

    (project / "FIXED").touch()
    rerun = _replay(script, elsewhere)
    assert rerun.returncode == 0 and "property 'oracle_agreement' passed" in rerun.stdout, rerun.stdout + rerun.stderr


def test_the_environment_the_check_ran_under_is_set_again(capsys, project, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, document = _check(capsys, "my_kernels:interpreted")
    script = document["targets"][0]["properties"][0]["reproducer_files"]["script"]
    assert code == 1 and "'TRITON_INTERPRET': '1'" in Path(script).read_text()
    rerun = _replay(script, tmp_path)  # run without TRITON_INTERPRET: the script sets it again
    assert rerun.returncode == 1 and "property 'oracle_agreement' failed" in rerun.stdout, rerun.stderr


def test_relevant_environment_is_the_documented_list_with_pythonpath_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    environ = {"TRITON_INTERPRET": "1", "OPENBLAS_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0",
               "PYTHONPATH": os.pathsep.join(["src", "/abs"]), "HOME": "/root", "LANG": "C"}
    assert relevant_environment(environ) == {
        "CUDA_VISIBLE_DEVICES": "0", "OPENBLAS_NUM_THREADS": "1", "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), "/abs"])}


def test_a_bf16_example_round_trips_bit_exactly(tmp_path):
    problem = make_problem("tiny", (2, 4, 2, 5, 7, 16), "bf16", 3, causal=True, causal_alignment="top-left",
                           scale=0.3)
    save_problem(problem, tmp_path / "p.npz")
    again = load_problem(tmp_path / "p.npz")
    for name in ("q", "k", "v"):
        x, y = getattr(problem, name), getattr(again, name)
        assert y.dtype == x.dtype and np.array_equal(y.view(np.uint16), x.view(np.uint16))
    assert (again.dtype, again.causal, again.causal_alignment, again.scale, again.tags) == \
        ("bf16", True, "top-left", 0.3, problem.tags)


@pytest.mark.parametrize("prop, target", [
    ("merge_law", CallableBackend(variants.wrong_lse, name="attention_variants:wrong_lse")),
    ("key_permutation", CallableBackend(user_kernels.drops_last_key, name="user_kernels:drops_last_key")),
])
def test_a_derived_example_replays_from_the_base_problem_and_the_seed(prop, target, tmp_path):
    """The merge law's chunks and the permutation are drawn again from the property's seed."""
    outcome = search_property(target, prop, Selection(max_examples=20), repro_dir=tmp_path)
    assert outcome.status == "failed" and outcome.failure is not None
    rerun = _replay(outcome.reproducer_files["script"], tmp_path)
    assert rerun.returncode == 1, rerun.stderr
    assert outcome.failure.detail.splitlines()[0] in rerun.stdout  # the same chunks/permutation, same numbers


def test_a_run_function_of_the_pytest_plugin_replays_too(project, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(project)
    import my_kernels

    outcome = search_property(my_kernels.run, "oracle_agreement", Selection(max_examples=20, dtypes=("fp16",)),
                              repro_dir=tmp_path / "repro")
    assert outcome.status == "failed" and "as_backend(" in Path(outcome.reproducer_files["script"]).read_text()
    assert _replay(outcome.reproducer_files["script"], tmp_path).returncode == 1
    (project / "FIXED").touch()
    assert _replay(outcome.reproducer_files["script"], tmp_path).returncode == 0


def test_targets_are_rebuilt_by_name_or_said_why_not():
    assert Target.of(get_backend("numpy-tiled"), "fp16").expression() == "get_backend('numpy-tiled')"
    bshd = Target.of(CallableBackend(user_kernels.float64_then_round, layout="bshd", precision="same-precision"),
                     "fp16")
    assert (bshd.reference, bshd.folder) == ("user_kernels:float64_then_round", str(FIXTURES))
    assert bshd.options["layout"] == "bshd" and bshd.options["precision"] == "score=fp16,p=fp16,pv=fp16,out=fp16"
    with pytest.raises(NotReproducible, match="not importable by name"):
        Target.of(CallableBackend(lambda q, k, v, *, causal, scale: q), "fp16")


def test_every_option_of_the_callable_protocol_is_carried():
    """A new CallableBackend option changes what is run or judged: its reproducer must pass it."""
    # isolate, timeout and memory_limit say how a call is run, not what it computes or how it is
    # judged; the reproducer is a process of its own and runs the target in it.
    how_it_runs = {"isolate", "timeout", "memory_limit"}
    parameters = set(inspect.signature(CallableBackend).parameters) - {"fn", "name", "dtypes"} - how_it_runs
    assert set(callable_options(CallableBackend(user_kernels.float64_then_round), "fp32")) == parameters
    import ragged_kernels

    from fa_verify.backends.ragged_callable import RaggedCallableBackend

    ragged = Target.of(RaggedCallableBackend(ragged_kernels.paged_attention, "paged", page_sizes=(16,)), "fp16")
    parameters = set(inspect.signature(RaggedCallableBackend).parameters) - {"fn", "name"} - how_it_runs
    assert ragged.kind == "ragged" and set(ragged.options) == parameters and ragged.options["page_sizes"] == [16]
    assert Target.of(get_backend("numpy-ragged-paged"), "fp16").kind == "builtin"


def test_repro_dir_naming_a_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["check", "numpy-tiled", "--repro-dir", str(tmp_path / "taken")])
    assert exit_.value.code == 2 and "--repro-dir" in capsys.readouterr().err


#: A user's paged kernel: it reads the last key of each page from the next page until a file
#: FIXED lies beside it.
RAGGED_KERNEL = '''
import os
from ragged_kernels_copy import paged_attention

HERE = os.path.dirname(os.path.abspath(__file__))


def paged(q, k_cache, v_cache, *, cache_seqlens, block_table, causal, softmax_scale, return_softmax_lse=False):
    bug = None if os.path.exists(os.path.join(HERE, "FIXED")) else "page_boundary"
    return paged_attention(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
                           softmax_scale=softmax_scale, return_softmax_lse=return_softmax_lse, bug=bug)
'''


def test_a_ragged_failure_writes_a_reproducer_that_fails_from_any_folder_and_passes_once_fixed(
        capsys, project, tmp_path):
    shutil.copy(FIXTURES / "ragged_kernels.py", project / "ragged_kernels_copy.py")
    shutil.copy(FIXTURES / "feature_kernels.py", project / "feature_kernels.py")  # ragged_kernels' import
    (project / "my_paged.py").write_text(RAGGED_KERNEL)
    try:
        code = main(["check", "my_paged:paged", "--layout", "paged", "--property", "ragged_agreement",
                     "--dtype", "fp16", "--max-examples", "10", "--page-sizes", "4", "--repro-dir", "repro", "--json"])
    finally:
        for name in ("my_paged", "ragged_kernels_copy"):
            sys.modules.pop(name, None)
    [prop] = json.loads(capsys.readouterr().out)["targets"][0]["properties"]
    assert code == 1 and prop["status"] == "failed", prop
    script = Path(prop["reproducer_files"]["script"])
    assert re.fullmatch(r"repro_ragged_agreement_[0-9a-f]{10}\.py", script.name)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rerun = _replay(script, elsewhere)
    assert rerun.returncode == 1, rerun.stdout + rerun.stderr
    assert "property 'ragged_agreement' failed" in rerun.stdout
    (project / "FIXED").touch()
    rerun = _replay(script, elsewhere)
    assert rerun.returncode == 0 and "property 'ragged_agreement' passed" in rerun.stdout, rerun.stdout + rerun.stderr


def test_a_paged_example_round_trips_bit_exactly(tmp_path):
    from hypothesis import given, settings

    from fa_verify.strategies import ragged_problems

    @settings(max_examples=3, deadline=None, database=None)
    @given(problem=ragged_problems("paged", ("bf16",), features=("window", "softcap", "alibi", "sinks")))
    def round_trip(problem):
        save_problem(problem, tmp_path / "p.npz")
        loaded = load_problem(tmp_path / "p.npz")
        assert loaded.describe() == problem.describe() and loaded.num_splits == problem.num_splits
        assert np.array_equal(loaded.pages.block_table, problem.pages.block_table)
        for ours, theirs in zip(loaded.replace(cache_fill=0.0).inputs().values(),
                               problem.replace(cache_fill=0.0).inputs().values()):
            assert np.array_equal(np.asarray(ours).view(np.uint8), np.asarray(theirs).view(np.uint8))

    round_trip()
