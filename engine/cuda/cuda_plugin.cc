// Entry point of libcemlm_cuda.so, the CUDA runner plugin that make_model_runner dlopens for
// --device cuda*: cuBLAS and the CUDA runtime are loaded only when a GPU is asked for.
#include "cemlm/engine/cuda_runner.h"

extern "C" __attribute__((visibility("default"))) cemlm::CudaRunnerFactory cemlm_cuda_runner_factory() {
  return &cemlm::make_cuda_model_runner;
}
