// cuda_runtime.h for the CUDA-on-CPU runner: device code only needs the shim, which is already
// force-included. Host API calls (cudaMalloc, cudaMemcpyToSymbol, ...) have no meaning inside a
// kernel source that the runner builds and are not provided.
#pragma once
#include "fa_cuda_cpu.h"
