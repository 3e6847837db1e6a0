// basics.cu: small kernels that exercise the CPU runner's scheduling and memory model.
#include <cstdint>
#include <cstdio>

// A grid of blocks with the usual bounds check.
extern "C" __global__ void vector_add(const float* a, const float* b, float* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

// Tree reduction in static __shared__ memory: one partial sum per block.
extern "C" __global__ void block_sum(const float* x, float* partial, int n) {
    __shared__ float buf[256];
    const unsigned int t = threadIdx.x;
    const int i = blockIdx.x * blockDim.x + t;
    buf[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) buf[t] += buf[t + s];
        __syncthreads();
    }
    if (t == 0) partial[blockIdx.x] = buf[0];
}

// extern __shared__: each block reverses its slice through dynamic shared memory, written by one
// thread and read by another (needs the barrier and per-block storage).
extern "C" __global__ void block_reverse(const int* in, int* out) {
    extern __shared__ __align__(16) unsigned char smem[];
    int* tile = reinterpret_cast<int*>(smem);
    const int base = blockIdx.x * blockDim.x;
    tile[threadIdx.x] = in[base + threadIdx.x];
    __syncthreads();
    out[base + threadIdx.x] = tile[blockDim.x - 1 - threadIdx.x];
}

// Warp intrinsics: butterfly sum, down-shift sum, broadcast, ballot, up-shift with width 8.
extern "C" __global__ void warp_ops(const float* x, float* sum_xor, float* sum_down, float* bcast,
                                    unsigned int* ballot, float* up8) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float v = x[i];
    float s = v;
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    sum_xor[i] = s;
    float d = v;
    for (int offset = 16; offset > 0; offset /= 2) d += __shfl_down_sync(0xffffffffu, d, offset);
    sum_down[i] = d;  // lane 0 holds the warp's sum
    bcast[i] = __shfl_sync(0xffffffffu, v, 5);
    ballot[i] = __ballot_sync(0xffffffffu, v > 0.0f);
    up8[i] = __shfl_up_sync(0xffffffffu, v, 1, 8);
}

// Threads past n leave before the barrier; the rest must not wait for them.
extern "C" __global__ void early_exit(const float* x, float* y, int n) {
    __shared__ float tile[128];
    const int t = threadIdx.x;
    if (t >= n) return;
    tile[t] = x[t] * 2.0f;
    __syncthreads();
    y[t] = tile[n - 1 - t];
    __syncthreads();
    y[t] += 1.0f;
}

// __syncthreads_count / _or / _and over a 2-D block.
extern "C" __global__ void barrier_reductions(const int* flags, int* out) {
    const int t = threadIdx.y * blockDim.x + threadIdx.x;
    const int f = flags[t];
    const int count = __syncthreads_count(f);
    const int any = __syncthreads_or(f);
    const int all = __syncthreads_and(f);
    if (t == 0) {
        out[0] = count;
        out[1] = any;
        out[2] = all;
    }
}

// Writes the builtin variables of every thread of a 3-D launch.
extern "C" __global__ void indices(int* out) {
    const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
    int* o = out + 4 * (block * blockDim.x * blockDim.y * blockDim.z + thread);
    o[0] = block;
    o[1] = thread;
    o[2] = blockDim.x * 100 + blockDim.y * 10 + blockDim.z;
    o[3] = gridDim.x * 100 + gridDim.y * 10 + gridDim.z;
}

// Each thread copies its right neighbour's value, without a barrier between the write and the
// read: a race whose outcome depends on the order in which the threads run.
extern "C" __global__ void racy_shift(int* out) {
    __shared__ int tile[64];
    const int t = threadIdx.x;
    tile[t] = t;
    out[t] = tile[(t + 1) % blockDim.x];
}

// Shared memory is garbage (NaN here) until the block writes it.
extern "C" __global__ void read_unwritten_shared(float* out) {
    __shared__ float tile[32];
    extern __shared__ float dyn[];
    out[threadIdx.x] = tile[threadIdx.x];
    out[32 + threadIdx.x] = dyn[threadIdx.x];
}

extern "C" __global__ void atomics(int* counter, float* total, unsigned int* maximum) {
    atomicAdd(counter, 1);
    atomicAdd(total, 0.5f);
    atomicMax(maximum, threadIdx.x + blockIdx.x * blockDim.x);
}

// Device printf reaches the caller.
extern "C" __global__ void hello(int value) {
    if (threadIdx.x == 0 && blockIdx.x == 0) printf("hello from the CPU runner: %d\n", value);
}

// Many barriers and shuffles, little arithmetic: what a launch costs in fiber switches. Every
// round each thread adds its right neighbour's (shared memory) and its xor-partner's (shuffle)
// value; the result is checked against numpy.
extern "C" __global__ void sync_stress(const float* x, float* out, int rounds) {
    __shared__ float tile[1024];
    const int t = threadIdx.x, n = blockDim.x;
    float v = x[blockIdx.x * n + t];
    for (int r = 0; r < rounds; ++r) {
        tile[t] = v;
        __syncthreads();
        v = 0.5f * (v + tile[(t + 1) % n]);
        __syncthreads();
        v = 0.5f * (v + __shfl_xor_sync(0xffffffffu, v, 1 + r % 31));
    }
    out[blockIdx.x * n + t] = v;
}
