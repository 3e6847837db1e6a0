// unsupported_intrinsic.cu: an intrinsic the shim does not provide.
extern "C" __global__ void uses_match(int* out) {
    out[threadIdx.x] = __match_any_sync(0xffffffffu, out[threadIdx.x]);
}
