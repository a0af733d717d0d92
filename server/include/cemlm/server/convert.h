// Protos <-> engine structs. Checks what only the server can (prompt presence, UTF-8, the
// tokenizer); everything about values the engine validates itself, with messages that name the
// same fields as the proto (sampling.top_p, recursion_depth, prompt_ids ...).
#pragma once
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cemlm/engine/engine.h"
#include "cemlm/v1/inference.pb.h"

namespace cemlm::server {

// The model's BOS id (config.json first, then the tokenizer); -1 when it has none.
int bos_id(const Engine& engine);

// Whether a text input can be tokenized at all: UTF-8, a model with a tokenizer, and at most
// max_text_bytes long. The error names `field`, and `ids_field` as the way around where it is
// not empty. Cheap (no tokenizing), so that such a text is refused before it waits for anything.
absl::Status check_text(const Engine& engine, absl::string_view text, absl::string_view field,
                        absl::string_view ids_field);
// Ids of a UTF-8 text through the model's tokenizer, with BOS prepended when `add_bos` and the
// model has one. `field` names the text in errors ("prompt_text"), `ids_field` the request's id
// list the errors suggest instead ("prompt_ids"; empty where there is none). check_text() first.
absl::StatusOr<std::vector<int>> encode_text(const Engine& engine, absl::string_view text,
                                             absl::string_view field, absl::string_view ids_field,
                                             bool add_bos);
// The most bytes of a text input (and ids of a Detokenize call) the server takes: more than the
// model's context could hold, with a margin for what normalisation removes.
int64_t max_text_bytes(const Engine& engine);

inline constexpr size_t kMaxRequestIdBytes = 256;  // GenerateRequest.request_id

// The checks of a request that do not need its prompt's ids (to_engine runs them first): a
// request with a text that fails them is refused before it waits for a text slot and is
// tokenized.
absl::Status check_before_tokenizing(const v1::GenerateRequest& req, const Engine& engine);
absl::Status check_before_tokenizing(const v1::ScoreRequest& req, const Engine& engine);

absl::StatusOr<GenerateRequest> to_engine(const v1::GenerateRequest& req, const Engine& engine);
absl::StatusOr<ScoreRequest> to_engine(const v1::ScoreRequest& req, const Engine& engine);

// Appends the tokens of `event` to `out` (several events can merge into one message while the
// previous message is still being written). Logprobs only when the request asked for them.
void append_event(const StreamEvent& event, bool logprobs, v1::GenerateResponse* out);
// Finish reason, usage and engine timing of the final event.
void set_final(const StreamEvent& event, const std::string& request_id, v1::GenerateResponse* out);

v1::ScoreResponse to_proto(const ScoreResult& r);
v1::ModelInfo model_info(const Engine& engine, const std::string& model_name);

// A request's fields that this server does not know, in it and its messages, take at most
// kMaxUnknownFieldBytes of memory (unpacked varints take 16 bytes each): protobuf keeps them, and
// every call held them to its end (a 4 MB field on a three-token prompt, 200 calls: 533 MB, outside
// --grpc-memory). A newer client's few new fields pass; INVALID_ARGUMENT otherwise.
inline constexpr int64_t kMaxUnknownFieldBytes = 64 << 10;
absl::Status check_unknown_fields(const google::protobuf::Message& request);

// Every id in [0, vocab_size); the error names field[i].
absl::Status check_ids(const google::protobuf::RepeatedField<int32_t>& ids, int vocab_size,
                       absl::string_view field);

}  // namespace cemlm::server
