"""A CI test file checking your own attention kernel with fa_verify — copy it into your tests.

    pip install fa-verify          # brings the pytest plugin (options --fa-*, fixtures fa_*)
    pytest test_my_attention.py                                  # ci profile: a minute or so
    pytest test_my_attention.py --fa-profile thorough --fa-results fa_results.jsonl
    fa_verify report --from fa_results.jsonl                     # optional: an HTML error report

Replace `my_attention` with a call into your kernel. It follows fa_verify's callable protocol:
q [B, H, Nq, D], k and v [B, Hkv, Nk, D] numpy arrays of one dtype (fp16, float16 numpy;
bf16, ml_dtypes.bfloat16; fp32), causal masking aligned bottom-right, returning out [B, H, Nq, D]
in the input dtype and, if your kernel has one, the LSE [B, H, Nq] in float32. For torch
tensors pass array="torch" below, for [B, N, H, D] tensors layout="bshd".
"""

import numpy as np
import pytest
from hypothesis import given, settings

from fa_verify import strategies as fst
from fa_verify.backends import CallableBackend
from fa_verify.properties import properties_for


def my_attention(q, k, v, *, causal, scale):
    """Stand-in kernel: plain attention in float32 (replace with yours)."""
    group = q.shape[1] // k.shape[1]
    q32 = q.astype(np.float32)
    k32, v32 = (np.repeat(x.astype(np.float32), group, axis=1) for x in (k, v))
    s = q32 @ k32.swapaxes(-1, -2) * np.float32(scale)
    nq, nk = s.shape[-2:]
    if causal:
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    out = (p @ v32) / np.where(l > 0, l, 1)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return out.astype(q.dtype), lse.astype(np.float32)


# "flash": judged as an FA2-style kernel (fp32 scores and accumulation, P rounded to the input
# dtype); "fp32-accumulate" is tighter, "input-scores" and "same-precision" looser.
KERNEL = CallableBackend(my_attention, name="my_attention", precision="flash")


@pytest.mark.parametrize("prop", [p.name for p in properties_for(KERNEL)])
def test_property(prop, fa_search):
    """Every property of fa_verify's suite, each a Hypothesis search that shrinks a failure to
    a minimal counterexample with a reproducer; properties your kernel cannot support (no LSE,
    say) are skipped as not applicable."""
    fa_search(KERNEL, prop)


@settings(max_examples=25, deadline=None)
@given(problem=fst.problems(dtypes=fst.dtypes(["fp16", "bf16"]),
                           causal=fst.causal_modes(alignments=["bottom-right"])))
def test_agrees_with_the_oracle(fa_oracle, problem):
    """Your own Hypothesis test: fa_verify's strategies and its certified oracle."""
    out, lse = KERNEL.run(problem)
    fa_oracle.assert_close(out, problem, lse=lse, precision="flash", name=KERNEL.name)
