"""torch's CPU scaled-dot-product-attention kernels, called through their aten ops.

The aten ops are called directly, not `F.scaled_dot_product_attention`, so the kernel that ran
is the one named, and the flash kernel's LSE is returned. What they do (torch 2.13, measured
against float64 on an AVX512 CPU; tests/test_backends.py pins the observable parts):

- "math" (`_scaled_dot_product_attention_math`): upcasts fp16/bf16 to fp32 and rounds the
  output once (99.8 % of outputs equal the correctly rounded exact value): fp32_accumulate.
  It computes in fp16/bf16 instead (≈ same-precision error) when the global flag
  `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)` is set, CPU included, so the
  backend clears that flag for its call. Its second result is the attention matrix, not the
  LSE, so no LSE is returned.
- "flash-cpu" (`_scaled_dot_product_flash_attention_for_cpu`): online softmax in fp32; for
  fp16/bf16 it stores P in the input dtype before P·V while the row sum uses fp32 P: the
  FA2 model, PrecisionModel.flash. For fp16/bf16 inputs its softmax exponentials have a
  relative error up to ~1.1e-4 (2^-13; fp32 inputs: a few fp32 ulps), which a precision model
  cannot express: it stays under fp16/bf16's P rounding, but the LSE error reaches ~1e-4.

Fully masked rows (bottom-right causal with Nq > Nk): both kernels return out = 0; the flash
kernel returns LSE = 0 (it replaces the row max by 0 and the row sum by 1), not fa_verify's
-inf. We pass that through unchanged so the harness reports torch's convention instead of
hiding it; declining such problems would also hide that their out is right.

`is_causal` is top-left aligned in both kernels; bottom-right problems with Nq != Nk get an
explicit additive mask instead (the flash op requires a mask of the query's dtype).
"""

from __future__ import annotations

import numpy as np

from fa_verify.backends.base import Backend, Deviation
from fa_verify.backends.torch_arrays import import_torch, to_numpy, to_torch, torch_availability
from fa_verify.errors import InvalidArgumentError
from fa_verify.limits import ANY_HEAD_DIM_V, Limits
from fa_verify.precision import PrecisionModel
from fa_verify.problem import AttentionProblem

KERNELS = ("math", "flash-cpu")

_NOTES = {
    "math": "no LSE (the op returns the attention matrix instead)",
    "flash-cpu": "fp16/bf16: exp relative error up to ~1e-4 (LSE error up to ~1e-4); "
                 "fully masked rows: LSE 0 (torch's convention), not -inf",
}


#: The flash kernel replaces a fully masked row's max by 0 and its sum by 1 (output 0, right).
MASKED_ROW_LSE_ZERO = Deviation(
    name="masked-row-lse-zero", differs="fully masked rows: LSE 0 instead of -inf (output 0)",
    rule="masked_rows", property="fully_masked_rows", masked_row_lse=0.0)

_DEVIATIONS = {"math": (), "flash-cpu": (MASKED_ROW_LSE_ZERO,)}


class TorchSdpaBackend(Backend):
    """One of torch's CPU SDPA kernels: kernel="math" or "flash-cpu"."""

    def __init__(self, kernel: str = "math"):
        if kernel not in KERNELS:
            raise InvalidArgumentError(f"kernel={kernel!r}; use one of {KERNELS}")
        self.kernel = kernel
        self.name = f"torch-sdpa-{kernel}"
        self.notes = _NOTES[kernel]
        self.deviations = _DEVIATIONS[kernel]
        if kernel == "math":  # torch's flash kernel wants one head size for q, k and v
            self.limits = Limits(head_dims_v=ANY_HEAD_DIM_V)

    def precision(self, dtype) -> PrecisionModel:
        if self.kernel == "flash-cpu":
            return PrecisionModel.flash(dtype)
        return PrecisionModel.fp32_accumulate(dtype)

    def availability(self):
        return torch_availability()

    def _run(self, problem: AttentionProblem):
        torch = import_torch()
        q, k, v = (to_torch(x) for x in (problem.q, problem.k, problem.v))
        if problem.group_size > 1:  # neither op takes GQA directly; head h reads kv head h // G
            k, v = (x.repeat_interleave(problem.group_size, dim=1) for x in (k, v))
        is_causal, mask = problem.causal, None
        if problem.causal and problem.causal_alignment == "bottom-right" and problem.nq != problem.nk:
            is_causal = False
            mask = to_torch(np.where(problem.mask, 0.0, -np.inf).astype(problem.q.dtype))
        scale = problem.scale_value
        with torch.no_grad():
            if self.kernel == "flash-cpu":
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
                return to_numpy(out), to_numpy(lse)
            flags = torch.backends.cuda
            reduced = flags.fp16_bf16_reduction_math_sdp_allowed()
            flags.allow_fp16_bf16_reduction_math_sdp(False)  # the fp32 computation we declare
            try:
                out, _attention = torch.ops.aten._scaled_dot_product_attention_math(
                    q, k, v, mask, 0.0, is_causal, scale=scale)
            finally:
                flags.allow_fp16_bf16_reduction_math_sdp(reduced)
            return to_numpy(out), None
