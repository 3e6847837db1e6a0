"""No data race on shared or global memory (CUDA kernels on the CPU runner; not applicable to
other targets)."""

from fa_verify.properties import check_races


def test_races(fa_backend, fa_search):
    fa_search(fa_backend, check_races)
