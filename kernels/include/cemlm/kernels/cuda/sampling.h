// On-device token sampling (the host Sampler's rules, engine/sampler.h): penalties, greedy argmax
// (lowest id on ties), temperature, top-k, top-p, min-p and one draw per row from a uniform the
// caller takes from the request's own RNG (so a seed gives the same tokens alone or batched).
// Only N (token, logprob) pairs come back to the host, never the [N, V] logits.
// CUDA: kernels/cuda/sampling.cu; tests: tests/gpu/sampling_test.cc.
#pragma once
#include <cstdint>

#include "cemlm/kernels/tensor.h"

namespace cemlm::cuda {

// One row's request, on the host. Same meaning and defaults as SamplingParams.
struct SampleRowSpec {
  float temperature = 1.0f;  // 0: greedy (pass 0 where SamplingParams samples greedily)
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  double uniform = 0.0;             // Rng::uniform() of the request, in [0, 1); unused when greedy
  const int32_t* tokens = nullptr;  // host: prompt then generated tokens (for the penalties)
  int n_tokens = 0;
  int n_prompt = 0;
};

struct SampledToken {
  int32_t token = -1;    // -1 when the row's logits are not all finite
  float logprob = 0.0f;  // log_softmax(raw logits)[token]
};

int64_t sample_rows_scratch_floats(const SampleRowSpec* rows, int n_rows, int vocab);
// The most any call with at most n_rows rows of at most `history` tokens each can need (every
// row penalised and cut): what an owner reserves once. n_rows · vocab must fit an int.
int64_t sample_rows_max_scratch_floats(int n_rows, int vocab, int history);
// logits [N, V] on the device; rows and out are host arrays of N. Synchronizes ctx.cuda_stream.
void sample_rows(const ExecCtx&, const Tensor& logits, const SampleRowSpec* rows, int n_rows,
                 SampledToken* out);

}  // namespace cemlm::cuda
