// fa2_tanh_approx.cu: fa2.cu's kernel with softcap's tanh computed by the hardware
// tanh.approx.f32 (FA2_TANH_APPROX), as FlashAttention's softcap does: relative error up to
// 2^-10.987 (PTX ISA), far above tanhf's few ulp. It is correct only under a precision model that
// declares it (PrecisionModel.flash(dtype) with tanh="approx"; the catalogue's FA2_TANH_APPROX).
//
// Entries fa2_tanh_approx_<dtype>_d<D> at fa2's tile configurations for D = 32, 64 and 128.
// tanh.approx.f32 needs sm_75.

#define FA2_TANH_APPROX
#define FA2_TEMPLATE_ONLY
#include "fa2.cu"

#define FA2_TANH_APPROX_ENTRY(DT, T, D, BLOCK_M, BLOCK_N, THREADS)                                \
    extern "C" __global__ void __launch_bounds__(THREADS)                                          \
        fa2_tanh_approx_##DT##_d##D(FA_PARAMS(T), FA2_VARIANT_PARAMS) {                             \
        fa2_forward<T, D, BLOCK_M, BLOCK_N, THREADS>(FA_ARGS, FA2_VARIANT_ARGS);                   \
    }

// FA_CONFIG(D, BLOCK_M, BLOCK_N, THREADS), as fa2.cu's
FA_FOR_EACH_DTYPE(FA2_TANH_APPROX_ENTRY, 32, 64, 32, 128)
FA_FOR_EACH_DTYPE(FA2_TANH_APPROX_ENTRY, 64, 64, 32, 128)
FA_FOR_EACH_DTYPE(FA2_TANH_APPROX_ENTRY, 128, 64, 32, 128)
