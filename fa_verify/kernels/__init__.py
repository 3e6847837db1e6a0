"""Our CUDA attention kernels (the .cu sources live in kernels/ at the repository root).

`catalogue` describes each kernel family (entries, tile sizes, launch geometry, shared memory,
precision model); `nvcc` compiles them for real GPU targets without a GPU; `pycuda_runner`
launches them on a GPU. The backends in fa_verify.backends.cuda_kernels put them behind the
backend protocol for each runner.
"""

from fa_verify.kernels.catalogue import (
    FAMILIES,
    KERNELS_DIR_ENV,
    KernelFamily,
    Launch,
    TileConfig,
    get_family,
    kernels_dir,
)

__all__ = ["FAMILIES", "KERNELS_DIR_ENV", "KernelFamily", "Launch", "TileConfig", "get_family", "kernels_dir"]
