// syntax_error.cu: does not compile; the compiler's message must reach the caller.
extern "C" __global__ void broken(float* out) {
    out[threadIdx.x] = undefined_variable_xyz + 1.0f
}
