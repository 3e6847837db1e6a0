// cooperative_groups.h for the CUDA-on-CPU runner: the thread block and its static tiles of at
// most one warp (tiled_partition<N>, N a power of two up to 32), on the runner's barriers and
// shuffles. A tile's collective operations take the mask of the tile's lanes, as CUDA's do, so
// the tiles of one warp meet separately. Not emulated (a build error names them): grid and
// multi-grid groups, coalesced_threads, dynamic tiled_partition(parent, n), cluster groups.
#pragma once

#include "fa_cuda_cpu.h"

namespace cooperative_groups {

namespace details {
inline unsigned int block_rank() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
inline unsigned int block_threads() { return blockDim.x * blockDim.y * blockDim.z; }
}  // namespace details

class thread_block {
  public:
    void sync() const { __syncthreads(); }
    unsigned long long thread_rank() const { return details::block_rank(); }
    unsigned long long size() const { return details::block_threads(); }
    unsigned long long num_threads() const { return size(); }
    dim3 group_index() const { return dim3(blockIdx); }
    dim3 thread_index() const { return dim3(threadIdx); }
    dim3 group_dim() const { return blockDim; }
    dim3 dim_threads() const { return blockDim; }
};

inline thread_block this_thread_block() { return thread_block(); }
inline void sync(const thread_block& g) { g.sync(); }

template <unsigned int Size, class Parent = void>
class thread_block_tile {
    static_assert(Size >= 1 && Size <= 32 && (Size & (Size - 1)) == 0,
                  "fa_verify CUDA-on-CPU: tiled_partition<N> with N a power of two up to 32 only");

  public:
    static constexpr unsigned int num_threads() { return Size; }
    static constexpr unsigned int size() { return Size; }
    // The lanes of this thread's tile within its warp.
    unsigned int mask() const {
        const unsigned int lane = details::block_rank() % 32;
        return (Size == 32 ? 0xffffffffu : ((1u << Size) - 1u)) << (lane / Size * Size);
    }
    void sync() const { __syncwarp(mask()); }
    unsigned int thread_rank() const { return details::block_rank() % Size; }
    unsigned int meta_group_rank() const { return details::block_rank() / Size; }
    unsigned int meta_group_size() const { return (details::block_threads() + Size - 1) / Size; }

    template <class T> T shfl(T var, int src_rank) const { return __shfl_sync(mask(), var, src_rank, Size); }
    template <class T> T shfl_xor(T var, int lane_mask) const { return __shfl_xor_sync(mask(), var, lane_mask, Size); }
    template <class T> T shfl_down(T var, unsigned int delta) const { return __shfl_down_sync(mask(), var, delta, Size); }
    template <class T> T shfl_up(T var, unsigned int delta) const { return __shfl_up_sync(mask(), var, delta, Size); }
    unsigned int ballot(int predicate) const {
        return (__ballot_sync(mask(), predicate) >> (details::block_rank() % 32 / Size * Size)) &
               (Size == 32 ? 0xffffffffu : (1u << Size) - 1u);
    }
    int any(int predicate) const { return ballot(predicate) != 0; }
    int all(int predicate) const { return ballot(predicate) == (Size == 32 ? 0xffffffffu : (1u << Size) - 1u); }
};

// The parent only names the group the tile is cut from; every tile here behaves alike.
template <unsigned int Size, class Parent>
inline thread_block_tile<Size> tiled_partition(const Parent&) {
    return thread_block_tile<Size>();
}
template <unsigned int Size, class Parent>
inline void sync(const thread_block_tile<Size, Parent>& g) { g.sync(); }

// ---- cg::reduce and its operators (<cooperative_groups/reduce.h>) ------------------------------------

template <class T> struct plus { T operator()(T a, T b) const { return a + b; } };
template <class T> struct less { T operator()(T a, T b) const { return b < a ? b : a; } };
template <class T> struct greater { T operator()(T a, T b) const { return a < b ? b : a; } };
template <class T> struct bit_and { T operator()(T a, T b) const { return a & b; } };
template <class T> struct bit_or { T operator()(T a, T b) const { return a | b; } };
template <class T> struct bit_xor { T operator()(T a, T b) const { return a ^ b; } };

// A butterfly over the tile (xor Size/2, ..., 1): every lane combines the same pairs, so all
// lanes get the same value even for floating-point sums (whose order CUDA leaves unspecified).
template <class T, class Tile, class Op>
inline T reduce(const Tile& tile, T value, Op op) {
    for (unsigned int offset = Tile::size() / 2; offset > 0; offset /= 2) value = op(value, tile.shfl_xor(value, static_cast<int>(offset)));
    return value;
}

}  // namespace cooperative_groups
