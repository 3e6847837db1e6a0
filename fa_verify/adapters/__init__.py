"""Third-party attention functions as `fa_verify check MODULE:FUNC` targets.

Each module imports its package only when used, so fa_verify never requires it; install the
extra (`pip install 'fa_verify[jax]'`; torch's flex_attention comes with torch):

    python3 -m fa_verify check fa_verify.adapters.jax_attention:attention --layout bshd --causal-alignment top-left
    python3 -m fa_verify check fa_verify.adapters.flex_attention:attention --array torch
    python3 -m fa_verify check fa_verify.adapters.flex_attention:compiled_attention --array torch --shapes 4
"""
