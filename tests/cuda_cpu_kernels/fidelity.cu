// Kernels for the runner's fidelity to a GPU: shared memory of templates and inline functions,
// the dynamic shared-memory limits, reads past an argument's end.

// Only block 0 writes the tile; every other block reads shared memory it never wrote (garbage
// on a GPU, NaN on the runner: not what block 0 left there).
template <int N>
__global__ void stale_template_shared(float* out) {
    __shared__ float tile[N];
    if (blockIdx.x == 0) tile[threadIdx.x] = 1.0f;
    __syncthreads();
    out[blockIdx.x * N + threadIdx.x] = tile[threadIdx.x];
}

// Static shared memory declared in an inline __device__ function, two arrays in one declaration.
__device__ inline float* scratch(int which) {
    __shared__ float first[32], second[32];
    return which ? second : first;
}

extern "C" __global__ void inline_shared(float* out) {
    scratch(0)[threadIdx.x] = threadIdx.x;
    scratch(1)[threadIdx.x] = 2.0f * threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = scratch(0)[31 - threadIdx.x] + scratch(1)[threadIdx.x];
}

// Writes every byte of the dynamic shared memory the launch gives, then reads the last float.
extern "C" __global__ void use_dynamic_shared(float* out, int bytes) {
    extern __shared__ float dynamic[];
    const int n = bytes / 4;
    for (int i = threadIdx.x; i < n; i += blockDim.x) dynamic[i] = float(i);
    __syncthreads();
    if (threadIdx.x == 0) out[0] = dynamic[n - 1];
}

// Copies n + 1 elements of a buffer of n: the last read is past its end.
extern "C" __global__ void read_one_past(const float* in, float* out, int n) {
    const int i = threadIdx.x;
    if (i < n) out[i] = in[i + 1];
}

// Dynamic shared memory in a template kernel: block 0 writes it, the others only read it.
template <typename T>
__global__ void stale_template_dynamic(T* out) {
    extern __shared__ __align__(16) unsigned char raw[];
    T* tile = reinterpret_cast<T*>(raw);
    if (blockIdx.x == 0) tile[threadIdx.x] = T(1);
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = tile[threadIdx.x];
}
