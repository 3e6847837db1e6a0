// faults.cu: kernels that fail on purpose, one way each.

// Off by one: thread n writes one element past the end of `out`.
extern "C" __global__ void write_past_end(float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = 1.0f;
}

// Reads one element past a static __shared__ array.
extern "C" __global__ void read_past_shared(float* out) {
    __shared__ float tile[32];
    tile[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = tile[threadIdx.x + 1];
}

// Reads past the dynamic shared memory the launch asked for.
extern "C" __global__ void read_past_dynamic_shared(float* out, int n) {
    extern __shared__ float dyn[];
    dyn[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = dyn[threadIdx.x + n];
}

// Writes through whatever pointer it is given (a null one in the test).
extern "C" __global__ void write_through(float* p) { p[threadIdx.x] = 1.0f; }

// Spins forever on a flag nobody sets.
extern "C" __global__ void spin_forever(const int* flag) {
    while (*(volatile const int*)flag == 0) {
    }
}

// Lane 0 waits at __syncthreads while the rest of its warp waits for it in a shuffle.
extern "C" __global__ void barrier_mismatch(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x == 0) __syncthreads();
    else v = __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

extern "C" __global__ void calls_trap(float* out) {
    if (threadIdx.x == 3) __trap();
    out[threadIdx.x] = 1.0f;
}
