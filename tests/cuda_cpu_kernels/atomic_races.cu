// atomic_races.cu: a plain access racing an atomic one, for the race detector (racecheck builds).
// An atomic orders nothing against a plain load or store of the same address: only atomics on
// both sides are free of a race (compute-sanitizer's racecheck reports the others too).

// Block 0's first thread stores to out[0]; every other block's first thread atomically adds to
// it: a plain write racing atomics between blocks (the store may land before or after them).
extern "C" __global__ void store_races_atomic_add(float* out) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) out[0] = 100.0f;
    else atomicAdd(out, 1.0f);
}

// The same with the plain store last in block order: the atomic comes first this time.
extern "C" __global__ void atomic_add_races_store(float* out) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x + 1 == gridDim.x) out[0] = 100.0f;
    else atomicAdd(out, 1.0f);
}

// Block 0's first thread reads out[0] plainly while the other blocks add to it atomically:
// what it sees depends on the order of the blocks.
extern "C" __global__ void load_races_atomic_add(float* out, float* seen) {
    if (threadIdx.x != 0) return;
    if (blockIdx.x == 0) seen[0] = out[0];
    else atomicAdd(out, 1.0f);
}

// In one block: thread 0 stores, the other threads add atomically, `synced` says whether a
// __syncthreads separates the store from the adds (then there is no race).
extern "C" __global__ void block_store_then_atomic_add(float* out, int synced) {
    if (threadIdx.x == 0) out[0] = 100.0f;
    if (synced) __syncthreads();
    if (threadIdx.x != 0) atomicAdd(out, 1.0f);
}
