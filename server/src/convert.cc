// Proto <-> engine conversion (see convert.h): request fields into GenerateRequest/ScoreRequest,
// engine events and results back into response messages.
#include "cemlm/server/convert.h"

#include "absl/strings/str_cat.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/tokenizer.h"
#include "cemlm/engine/utf8.h"

namespace cemlm::server {
namespace {

absl::Status invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

absl::Status check_not_both(const std::string& text,
                            const google::protobuf::RepeatedField<int32_t>& ids,
                            absl::string_view text_field, absl::string_view ids_field) {
  if (!text.empty() && !ids.empty())
    return invalid(absl::StrCat("set only one of ", text_field, " and ", ids_field));
  return absl::OkStatus();
}

// Exactly one of a text and an id list; the ids of either. Text starts with the model's BOS
// unless the request's add_bos is set to false. `empty_hint` ends the error for neither.
template <typename Request>
absl::StatusOr<std::vector<int>> prompt_of(const Engine& engine, const Request& req,
                                           const std::string& text,
                                           const google::protobuf::RepeatedField<int32_t>& ids,
                                           absl::string_view text_field,
                                           absl::string_view ids_field,
                                           absl::string_view empty_hint) {
  CEMLM_RETURN_IF_ERROR(check_not_both(text, ids, text_field, ids_field));
  if (text.empty() && ids.empty())
    return invalid(absl::StrCat(text_field, " or ", ids_field,
                                " is required (the input is empty; an empty text cannot be told "
                                "from none",
                                empty_hint, ")"));
  if (!ids.empty()) {
    if (req.has_add_bos())
      return invalid(absl::StrCat("add_bos applies to ", text_field, " only: ", ids_field,
                                  " are used as given, so leave add_bos unset (and put the BOS "
                                  "id, ModelInfo.bos_id, first if you want one)"));
    return std::vector<int>(ids.begin(), ids.end());
  }
  return encode_text(engine, text, text_field, ids_field, !req.has_add_bos() || req.add_bos());
}

// How the engine's errors name a prompt given as text: they count its tokens, the model's BOS
// included, which a client counting Tokenize's ids without it would otherwise miss by one.
template <typename Request>
std::string text_label(const Request& req, const Engine& engine, absl::string_view text_field) {
  const bool bos = (!req.has_add_bos() || req.add_bos()) && bos_id(engine) >= 0;
  return absl::StrCat(text_field, bos ? " (as tokens, BOS included)" : " (as tokens)");
}

SamplingParams to_engine(const v1::SamplingParams& p) {
  SamplingParams s;
  if (p.has_temperature()) s.temperature = p.temperature();
  if (p.has_top_k()) s.top_k = p.top_k();
  if (p.has_top_p()) s.top_p = p.top_p();
  if (p.has_min_p()) s.min_p = p.min_p();
  if (p.has_repetition_penalty()) s.repetition_penalty = p.repetition_penalty();
  if (p.has_presence_penalty()) s.presence_penalty = p.presence_penalty();
  if (p.has_frequency_penalty()) s.frequency_penalty = p.frequency_penalty();
  if (p.has_seed()) s.seed = p.seed();
  if (p.has_max_new_tokens()) s.max_new_tokens = p.max_new_tokens();
  s.stop.assign(p.stop().begin(), p.stop().end());
  s.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  s.ignore_eos = p.ignore_eos();
  s.top_logprobs = p.top_logprobs();
  s.min_new_tokens = p.min_new_tokens();
  s.logit_bias.assign(p.logit_bias().begin(), p.logit_bias().end());
  std::sort(s.logit_bias.begin(), s.logit_bias.end());  // a map's order is unspecified
  return s;
}

v1::FinishReason to_proto(FinishReason r) {
  return r == FinishReason::kLength ? v1::FINISH_REASON_LENGTH : v1::FINISH_REASON_STOP;
}

// Where the request has an id list, that is the way around a text this model cannot encode.
std::string use_ids_instead(absl::string_view ids_field) {
  return ids_field.empty() ? std::string() : absl::StrCat("; send ", ids_field, " instead");
}

}  // namespace

int bos_id(const Engine& engine) {
  return resolve_bos_id(engine.config().bos_id, engine.tokenizer());
}

int64_t max_text_bytes(const Engine& engine) {
  // The margin covers what normalisation removes (runs of spaces, combining marks).
  const Tokenizer* tok = engine.tokenizer();
  return int64_t(4) * engine.config().max_seq_len * (tok ? tok->max_piece_bytes() : 1);
}

absl::Status check_text(const Engine& engine, absl::string_view text, absl::string_view field,
                        absl::string_view ids_field) {
  if (size_t valid = utf8_valid_prefix(std::string_view(text.data(), text.size()));
      valid != text.size())
    return invalid(absl::StrCat(field, " is not valid UTF-8 (bad byte at offset ", valid, ")"));
  if (!engine.tokenizer())
    return invalid(
        absl::StrCat(field, ": this model has no tokenizer", use_ids_instead(ids_field)));
  // A text far longer than the context is refused before it is tokenized: encoding megabytes
  // takes seconds of a handler thread, for an answer known from its length.
  const int64_t most = max_text_bytes(engine);
  if (int64_t(text.size()) > most)
    return invalid(absl::StrCat(field, " is ", text.size(),
                                " bytes, more than the model's max_seq_len = ",
                                engine.config().max_seq_len, " tokens can hold (over ", most,
                                " bytes cannot fit); shorten it"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> encode_text(const Engine& engine, absl::string_view text,
                                             absl::string_view field, absl::string_view ids_field,
                                             bool add_bos) {
  CEMLM_RETURN_IF_ERROR(check_text(engine, text, field, ids_field));
  std::string error;
  std::optional<std::vector<int>> ids =
      encode_input(*engine.tokenizer(), std::string_view(text.data(), text.size()),
                   add_bos ? bos_id(engine) : -1, &error);
  if (!ids) return invalid(absl::StrCat(field, ": ", error, use_ids_instead(ids_field)));
  return *std::move(ids);
}

absl::Status check_before_tokenizing(const v1::GenerateRequest& req, const Engine& engine) {
  CEMLM_RETURN_IF_ERROR(
      check_not_both(req.prompt_text(), req.prompt_ids(), "prompt_text", "prompt_ids"));
  CEMLM_RETURN_IF_ERROR(
      check_recursion_depth(engine.config(), req.recursion_depth(), "recursion_depth"));
  SamplingParams sampling = to_engine(req.sampling());
  // Unset, max_new_tokens is capped to the room the prompt leaves (known once it is tokenized),
  // and a min_new_tokens above that refused then, with a message that says so.
  if (!req.sampling().has_max_new_tokens())
    sampling.max_new_tokens = std::max(sampling.max_new_tokens, sampling.min_new_tokens);
  CEMLM_RETURN_IF_ERROR(
      validate_sampling(sampling, engine.config().vocab_size,
                        resolve_eos_id(engine.config().eos_id, engine.tokenizer())));
  // The alternatives come beside each token's logprob: asked for alone they were dropped.
  if (req.sampling().top_logprobs() > 0 && !req.logprobs())
    return invalid(absl::StrCat("sampling.top_logprobs = ", req.sampling().top_logprobs(),
                                " needs logprobs: true (the alternatives come with each token's "
                                "logprob); set it, or leave top_logprobs at 0"));
  if (req.request_id().size() > kMaxRequestIdBytes)
    return invalid(absl::StrCat("request_id is ", req.request_id().size(), " bytes; at most ",
                                kMaxRequestIdBytes));
  return check_cache_salt(req.cache_salt());
}

absl::Status check_before_tokenizing(const v1::ScoreRequest& req, const Engine& engine) {
  CEMLM_RETURN_IF_ERROR(check_not_both(req.text(), req.ids(), "text", "ids"));
  return check_recursion_depth(engine.config(), req.recursion_depth(), "recursion_depth");
}

absl::StatusOr<GenerateRequest> to_engine(const v1::GenerateRequest& req, const Engine& engine) {
  CEMLM_RETURN_IF_ERROR(check_before_tokenizing(req, engine));
  GenerateRequest out;
  const int bos = bos_id(engine);
  CEMLM_ASSIGN_OR_RETURN(
      out.prompt_ids,
      prompt_of(
          engine, req, req.prompt_text(), req.prompt_ids(), "prompt_text", "prompt_ids",
          bos < 0 ? std::string()
                  : absl::StrCat(": to start from the BOS alone, send prompt_ids = [", bos, "]")));
  if (!req.prompt_text().empty()) out.prompt_field = text_label(req, engine, "prompt_text");
  out.recursion_depth = req.recursion_depth();
  out.sampling = to_engine(req.sampling());
  out.priority = req.priority();
  if (!req.sampling().has_max_new_tokens())
    CEMLM_RETURN_IF_ERROR(cap_unset_max_new_tokens(
        engine.config().max_seq_len, int(out.prompt_ids.size()), out.prompt_field, &out.sampling));
  out.client_request_id = req.request_id();
  out.cache_salt = req.cache_salt();
  return out;
}

absl::StatusOr<ScoreRequest> to_engine(const v1::ScoreRequest& req, const Engine& engine) {
  CEMLM_RETURN_IF_ERROR(check_before_tokenizing(req, engine));
  ScoreRequest out;
  CEMLM_ASSIGN_OR_RETURN(out.ids, prompt_of(engine, req, req.text(), req.ids(), "text", "ids",
                                            ": a Score needs at least 2 tokens"));
  if (!req.text().empty()) out.ids_field = text_label(req, engine, "text");
  out.recursion_depth = req.recursion_depth();
  out.priority = req.priority();
  return out;
}

void append_event(const StreamEvent& event, bool logprobs, v1::GenerateResponse* out) {
  out->mutable_text()->append(event.text);
  out->mutable_token_ids()->Add(event.token_ids.begin(), event.token_ids.end());
  if (!logprobs) return;
  out->mutable_logprobs()->Add(event.logprobs.begin(), event.logprobs.end());
  for (const auto& alternatives : event.top_logprobs) {
    v1::TokenLogprobs* t = out->add_top_logprobs();
    for (const TopLogprob& a : alternatives) {
      v1::TopLogprob* p = t->add_top();
      p->set_token_id(a.token_id);
      p->set_logprob(a.logprob);
    }
  }
}

void set_final(const StreamEvent& event, const std::string& request_id, v1::GenerateResponse* out) {
  out->set_finish_reason(to_proto(event.finish_reason));
  out->set_request_id(request_id);
  out->set_seed(event.seed);
  v1::Usage* u = out->mutable_usage();
  u->set_prompt_tokens(event.usage.prompt_tokens);
  u->set_generated_tokens(event.usage.generated_tokens);
  u->set_recursion_steps(event.usage.recursion_steps);
  u->set_cached_prompt_tokens(event.usage.cached_prompt_tokens);
  const RequestTimings& t = event.timings;
  v1::EngineTiming* timing = out->mutable_timing();
  timing->set_queue_seconds(queue_seconds(t));
  timing->set_first_token_seconds(seconds_between(t.submitted, t.first_token));
  timing->set_e2e_seconds(seconds_between(t.submitted, t.finished));
}

v1::ScoreResponse to_proto(const ScoreResult& r) {
  v1::ScoreResponse out;
  out.mutable_token_ids()->Add(r.ids.begin(), r.ids.end());
  // The engine's logprobs[0] is a NaN placeholder (the first token has no prefix).
  if (r.logprobs.size() > 1) out.mutable_logprobs()->Add(r.logprobs.begin() + 1, r.logprobs.end());
  out.set_nll(r.nll);
  out.set_perplexity(r.perplexity);
  out.set_recursion_depth(r.recursion_depth);
  return out;
}

v1::ModelInfo model_info(const Engine& engine, const std::string& model_name) {
  const ModelInfo info = engine.info();
  const ModelConfig& c = info.config;
  v1::ModelInfo out;
  out.set_model_name(model_name);
  out.set_architecture("cemlm");
  out.set_variant(info.variant);
  out.set_vocab_size(c.vocab_size);
  out.set_max_context(c.max_seq_len);
  out.set_default_recursion_depth(c.recursion_default);
  out.set_max_recursion_depth(c.recursion_max);
  out.set_parameters(info.parameters);
  out.set_kv_bytes_per_token(info.kv_bytes_per_token);
  out.set_device(info.device);
  out.set_d_model(c.d_model);
  out.set_n_layers(c.n_layers);
  out.set_bos_id(bos_id(engine));
  out.set_eos_id(resolve_eos_id(c.eos_id, engine.tokenizer()));
  out.set_has_tokenizer(engine.tokenizer() != nullptr);
  out.set_kv_cache_dtype(info.kv_cache_dtype);
  out.set_kv_cache_capacity_tokens(info.kv_cache_capacity_tokens);
  return out;
}

namespace {

// The bytes of unknown fields in `m` and the messages it holds (maps aside: their entries keep
// none, and reflection over a map copies it).
int64_t unknown_field_bytes(const google::protobuf::Message& m) {
  const google::protobuf::Reflection* r = m.GetReflection();
  int64_t bytes = int64_t(r->GetUnknownFields(m).SpaceUsedExcludingSelfLong());
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    if (f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE || f->is_map())
      continue;
    if (!f->is_repeated()) {
      bytes += unknown_field_bytes(r->GetMessage(m, f));
      continue;
    }
    for (int i = 0; i < r->FieldSize(m, f); ++i)
      bytes += unknown_field_bytes(r->GetRepeatedMessage(m, f, i));
  }
  return bytes;
}

}  // namespace

absl::Status check_unknown_fields(const google::protobuf::Message& request) {
  if (const int64_t bytes = unknown_field_bytes(request); bytes > kMaxUnknownFieldBytes)
    return invalid(absl::StrCat(
        "the request holds fields that this server's ", request.GetDescriptor()->full_name(),
        " does not have (in it or the messages in it), taking ", bytes,
        " bytes of memory (at most ", kMaxUnknownFieldBytes,
        "): send only the fields of this server's cemlm/v1/inference.proto"));
  return absl::OkStatus();
}

absl::Status check_ids(const google::protobuf::RepeatedField<int32_t>& ids, int vocab_size,
                       absl::string_view field) {
  for (int i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab_size)
      return invalid(
          absl::StrCat(field, "[", i, "] = ", ids[i], " is not a token id in [0, ", vocab_size, ")"));
  return absl::OkStatus();
}

}  // namespace cemlm::server
