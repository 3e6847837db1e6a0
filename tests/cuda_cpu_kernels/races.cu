// races.cu: kernels with and without data races, for the race detector (racecheck builds).
// The racy ones read or write memory that another thread writes with nothing ordering the two.

// Warp-synchronous reduction of 32 values in the pre-Volta style: the lanes of one warp trade
// partial sums through shared memory with no __syncwarp, trusting lockstep execution. Since
// Volta the lanes may run apart: a race.
extern "C" __global__ void warp_sum_unsynced(const float* x, float* out) {
    __shared__ float partial[32];
    const int t = threadIdx.x;
    partial[t] = x[t];
    if (t < 16) partial[t] += partial[t + 16];
    if (t < 8) partial[t] += partial[t + 8];
    if (t < 4) partial[t] += partial[t + 4];
    if (t < 2) partial[t] += partial[t + 2];
    if (t == 0) out[0] = partial[0] + partial[1];
}

// The same reduction with a __syncwarp after every step: no race.
extern "C" __global__ void warp_sum_synced(const float* x, float* out) {
    __shared__ float partial[32];
    const int t = threadIdx.x;
    partial[t] = x[t];
    __syncwarp();
    if (t < 16) partial[t] += partial[t + 16];
    __syncwarp();
    if (t < 8) partial[t] += partial[t + 8];
    __syncwarp();
    if (t < 4) partial[t] += partial[t + 4];
    __syncwarp();
    if (t < 2) partial[t] += partial[t + 2];
    __syncwarp();
    if (t == 0) out[0] = partial[0] + partial[1];
}

// A block reverses its values through dynamic shared memory; `synced` says whether the
// __syncthreads between the write and the other thread's read is there.
extern "C" __global__ void reverse_through_shared(const float* x, float* y, int synced) {
    extern __shared__ float tile[];
    const int t = threadIdx.x, n = blockDim.x;
    tile[t] = x[blockIdx.x * n + t];
    if (synced) __syncthreads();
    y[blockIdx.x * n + t] = tile[n - 1 - t];
}

// Every block's first thread stores its index to the same global address: a write/write race
// between blocks (which runs last is up to the GPU).
extern "C" __global__ void blocks_store_one_address(float* out) {
    if (threadIdx.x == 0) out[0] = static_cast<float>(blockIdx.x);
}

// The same with atomicAdd: no race.
extern "C" __global__ void blocks_add_one_address(float* out) {
    if (threadIdx.x == 0) atomicAdd(out, 1.0f);
}

// Each block writes its own element, then reads its neighbour's: a read/write race between
// blocks (no barrier orders blocks).
extern "C" __global__ void blocks_read_neighbour(float* data, float* out) {
    const int b = blockIdx.x, n = gridDim.x;
    if (threadIdx.x == 0) {
        data[b] = static_cast<float>(b);
        out[b] = data[(b + 1) % n];
    }
}
