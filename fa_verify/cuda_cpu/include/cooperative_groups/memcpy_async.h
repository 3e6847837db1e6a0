// cooperative_groups/memcpy_async.h for the CUDA-on-CPU runner: cg::memcpy_async and cg::wait are
// not emulated (use cp.async PTX, which is). The include alone is accepted; a call stops the build
// at its line.
#pragma once
#include "../cooperative_groups.h"
