"""Third-party attention functions as `fa_verify check MODULE:FUNC` targets.

Each module imports its package only when used, so fa_verify never requires it; install the
extra (`pip install 'fa_verify[jax]'`; torch's flex_attention comes with torch):

    python3 -m fa_verify check fa_verify.adapters.jax_attention:attention --layout bshd --causal-alignment top-left
    python3 -m fa_verify check fa_verify.adapters.flex_attention:attention --array torch
    python3 -m fa_verify check fa_verify.adapters.flex_attention:compiled_attention --array torch --shapes 4

Backward targets take the backward protocol, `bwd(q, k, v, out, lse, dout, *, causal, scale)
-> (dq, dk, dv)` (DESIGN.md, "The backward pass"): [B, H, N, D] inputs, a natural-log LSE,
gradients in the input dtype. Each recomputes the forward under its framework's autograd and
reads neither `out` nor `lse`; none takes the variants' keywords (window_size, softcap,
alibi_slopes, sinks) or dlse.

    python3 -m fa_verify check fa_verify.adapters.torch_sdpa_backward:math_backward --causal-alignment top-left
    python3 -m fa_verify check fa_verify.adapters.torch_sdpa_backward:flash_backward --causal-alignment top-left
    python3 -m fa_verify check fa_verify.adapters.jax_attention:backward --causal-alignment top-left --dtype fp32
    python3 -m fa_verify check fa_verify.adapters.flex_attention:backward --array torch

- torch SDPA (numpy arrays): the math backend (fp16/bf16 computed in fp32, rounded once) and
  the CPU flash kernel; fp16, bf16, fp32; GQA; top-left causal.
- JAX (numpy arrays, [B, H, N, D] unlike its forward's bshd): `jax.vjp` of the jit-compiled
  `jax.nn.dot_product_attention`; fp32 and bf16 (XLA's CPU backend refuses its fp16 vjp: "The
  precision 'F16_F16_F32' is not supported by dot_general on CPU"); GQA; top-left causal.
- flex_attention (CPU torch tensors, like its forward): autograd of the eager function with a
  bottom-right causal mask_mod; fp16, bf16, fp32; GQA. torch 2.13 refuses flex_attention's
  backward on the CPU, so it runs on a CUDA GPU and raises BackendUnavailableError without one.

Our own Triton backward kernel is no adapter; it lives beside its forward,
kernels/triton/fa_triton_bwd.py (`kernels.triton.fa_triton_bwd:backward --array torch`).
"""
