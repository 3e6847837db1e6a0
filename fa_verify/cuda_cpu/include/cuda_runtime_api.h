// cuda_runtime_api.h for the CUDA-on-CPU runner: as cuda_runtime.h, the host API is not provided
// (kernel files include it for their launchers, which the runner sets aside).
#pragma once
#include "fa_cuda_cpu.h"
