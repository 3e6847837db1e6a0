// unsupported_asm.cu: an inline PTX instruction the CPU runner does not emulate: refused at build time.
extern "C" __global__ void lane_id(int* out) {
    unsigned int lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    out[threadIdx.x] = lane;
}
