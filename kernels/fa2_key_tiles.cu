// fa2_key_tiles.cu: fa2.cu's kernel, unchanged, at key-tile sizes (BLOCK_N) the fa2 family does
// not instantiate, for the report's reproduction of Golden et al. 2024 ("Is Flash Attention
// Stable?"): how the deviation from the exact output changes with the key tile. Fewer, larger
// key tiles mean fewer online-softmax rescalings of the accumulator and running sum.
//
// Entries fa2_k<BLOCK_N>_bf16_d64 (bf16, D = 64: the paper's dtype, the quick sweep's head
// dimension); key tile 32 is fa2's own fa2_bf16_d64. The catalogue (FA2_KEY_TILES in
// fa_verify/kernels/catalogue.py) lists the same configurations. BLOCK_N = 128 needs 114 KiB of
// shared memory per block: above the 48 KiB default (the PyCUDA runner opts in), within sm_80's
// and sm_90's limits but not sm_86/sm_89's 99 KiB.

#define FA2_TEMPLATE_ONLY
#include "fa2.cu"

#define FA2_KEY_TILE_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                   \
    extern "C" __global__ void __launch_bounds__(THREADS)                                          \
        fa2_k##BLOCK_N##_##DT##_d##D(FA_PARAMS(T), FA2_VARIANT_PARAMS) {                            \
        fa2_forward<T, D, BLOCK_M, BLOCK_N, THREADS>(FA_ARGS, FA2_VARIANT_ARGS);                   \
    }

// FA2_KEY_TILE_ENTRY(dtype, T, D, BLOCK_M, BLOCK_N, THREADS)
FA2_KEY_TILE_ENTRY(bf16, __nv_bfloat16, 64, 64, 16, 128)
FA2_KEY_TILE_ENTRY(bf16, __nv_bfloat16, 64, 64, 64, 128)
FA2_KEY_TILE_ENTRY(bf16, __nv_bfloat16, 64, 64, 128, 128)
