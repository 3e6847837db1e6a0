// cuda_fp8.h for the CUDA-on-CPU runner: not emulated. The runner stops the build here so that a
// kernel never runs on the CPU with a construct whose GPU semantics it does not reproduce.
#error "fa_verify CUDA-on-CPU: <cuda_fp8.h> is not supported by the CPU runner"
