// coop_groups.cu: cooperative_groups' thread block and static tiles (64 threads per block).
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

namespace cg = cooperative_groups;

// out[4 * t + 0]: the block's sum of x (shared memory between two block.sync());
// out[4 * t + 1]: cg::reduce sum over the thread's warp tile; out[4 * t + 2]: max over its
// tile of 8; out[4 * t + 3]: the value shfl_down 1 within the tile of 8, plus 1000 x rank.
extern "C" __global__ void groups(const float* x, float* out, unsigned int* info) {
    cg::thread_block block = cg::this_thread_block();
    __shared__ float partial[64];
    const unsigned int t = block.thread_rank();
    partial[t] = x[t];
    block.sync();
    float total = 0.0f;
    for (unsigned int i = 0; i < block.size(); ++i) total += partial[i];
    cg::sync(block);
    cg::thread_block_tile<32> warp = cg::tiled_partition<32>(block);
    cg::thread_block_tile<8> eight = cg::tiled_partition<8>(block);
    out[4 * t + 0] = total;
    out[4 * t + 1] = cg::reduce(warp, x[t], cg::plus<float>());
    out[4 * t + 2] = cg::reduce(eight, x[t], cg::greater<float>());
    out[4 * t + 3] = eight.shfl_down(x[t], 1) + 1000.0f * eight.thread_rank();
    eight.sync();
    info[2 * t] = eight.meta_group_rank() | (warp.meta_group_rank() << 8) | (eight.meta_group_size() << 16);
    info[2 * t + 1] = eight.ballot(x[t] > 0.0f);
}
