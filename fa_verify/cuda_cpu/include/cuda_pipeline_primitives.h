// cuda_pipeline_primitives.h for the CUDA-on-CPU runner: not emulated, and declares nothing. Published kernels often
// include it without using it, so the include is accepted; a kernel that calls what it declares
// stops at that call ("not declared"), with a hint that the runner does not emulate it.
#pragma once
