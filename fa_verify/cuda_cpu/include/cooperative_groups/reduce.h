// cooperative_groups/reduce.h for the CUDA-on-CPU runner: cg::reduce lives in <cooperative_groups.h>.
#pragma once

#include "../cooperative_groups.h"
