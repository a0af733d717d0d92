// `cemlm client generate|score|tokenize|detokenize|info|health`: a command-line gRPC client of
// `cemlm serve`. Generate streams text to stdout as it arrives; --json prints one JSON object.
#include <google/protobuf/util/json_util.h>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cemlm/cli/commands.h"
#include "cemlm/engine/sampling.h"
#include "cemlm/engine/utf8.h"
#include "cemlm/v1/inference.grpc.pb.h"
#include "channel.h"
#include "generate_stream.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace cemlm::cli {
namespace {

using nlohmann::json;

void print_json(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions opts;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(m, &out, opts);
  std::printf("%s\n", out.c_str());
}

// --ids/--prompt-ids into a repeated field; false after printing the flag's usage error (ids
// that are not integers, or negative: no model has them; whether it has the rest is its to say).
bool set_ids(const std::string& text, const char* flag,
             google::protobuf::RepeatedField<int32_t>* out) {
  std::vector<int> ids;
  if (const std::string error = id_list_flag(std::string("--") + flag, text, &ids);
      !error.empty()) {
    usage_error(error);
    return false;
  }
  out->Add(ids.begin(), ids.end());
  return true;
}

struct GenerateFlags {
  std::string prompt, prompt_ids, request_id, cache_salt;
  int recursion = 0, max_new_tokens = 64, min_new_tokens = 0, top_k = 0, top_logprobs = 0,
      priority = 0;
  float temperature = 1, top_p = 1, min_p = 0, repetition_penalty = 1, presence_penalty = 0,
        frequency_penalty = 0;
  std::string seed;
  std::vector<int> stop_token_ids;
  std::vector<std::string> stop;
  std::vector<std::pair<int, float>> logit_bias;
  bool logprobs = false, ignore_eos = false, json = false, no_bos = false;
};

v1::GenerateRequest generate_request(const GenerateFlags& g, const Flags& flags) {
  v1::GenerateRequest req;
  req.set_prompt_text(g.prompt);
  if (g.no_bos) req.set_add_bos(false);
  req.set_recursion_depth(g.recursion);
  req.set_logprobs(g.logprobs || g.top_logprobs > 0);
  req.set_priority(g.priority);
  req.set_request_id(g.request_id);
  req.set_cache_salt(g.cache_salt);
  v1::SamplingParams* s = req.mutable_sampling();
  if (flags.given("max-new-tokens")) s->set_max_new_tokens(g.max_new_tokens);
  s->set_min_new_tokens(g.min_new_tokens);
  for (const auto& [id, bias] : g.logit_bias) (*s->mutable_logit_bias())[id] = bias;
  if (flags.given("temperature")) s->set_temperature(g.temperature);
  if (flags.given("top-k")) s->set_top_k(g.top_k);
  if (flags.given("top-p")) s->set_top_p(g.top_p);
  if (flags.given("min-p")) s->set_min_p(g.min_p);
  if (flags.given("repetition-penalty")) s->set_repetition_penalty(g.repetition_penalty);
  if (flags.given("presence-penalty")) s->set_presence_penalty(g.presence_penalty);
  if (flags.given("frequency-penalty")) s->set_frequency_penalty(g.frequency_penalty);
  s->mutable_stop_token_ids()->Add(g.stop_token_ids.begin(), g.stop_token_ids.end());
  if (uint64_t seed = 0; flags.given("seed") && parse_uint64(g.seed, &seed)) s->set_seed(seed);
  for (const auto& stop : g.stop) s->add_stop(stop);
  s->set_ignore_eos(g.ignore_eos);
  s->set_top_logprobs(g.top_logprobs);
  return req;
}

json final_json(const v1::GenerateResponse& last) {
  const v1::Usage& u = last.usage();
  const v1::EngineTiming& t = last.timing();
  return {{"finish_reason", last.finish_reason() == v1::FINISH_REASON_LENGTH ? "length" : "stop"},
          {"usage",
           {{"prompt_tokens", u.prompt_tokens()},
            {"generated_tokens", u.generated_tokens()},
            {"recursion_steps", u.recursion_steps()},
            {"cached_prompt_tokens", u.cached_prompt_tokens()}}},
          {"timing",
           {{"queue_seconds", t.queue_seconds()},
            {"first_token_seconds", t.first_token_seconds()},
            {"e2e_seconds", t.e2e_seconds()}}},
          {"request_id", last.request_id()},
          {"seed", last.seed()}};
}

int client_generate(int argc, char** argv) {
  ChannelFlags c;
  GenerateFlags g;
  Flags flags("cemlm client generate --addr HOST:PORT (--prompt STR | --prompt-ids 3,17) [options]",
              "Stream a generation to stdout as it arrives (--json: one JSON object at the end).");
  add_channel_flags(&flags, &c);
  flags.add("prompt", &g.prompt, "prompt text");
  flags.add("prompt-ids", &g.prompt_ids, "prompt as comma-separated token ids (used as given)");
  flags.add_bool("no-bos", &g.no_bos, "do not start --prompt with the model's BOS");
  flags.add("recursion", &g.recursion, "recursion depth T; 0 = the model's default");
  flags.add("max-new-tokens", &g.max_new_tokens,
            "tokens to generate at most; when not given, the server's default, capped to the room "
            "the prompt leaves in the context");
  flags.add("min-new-tokens", &g.min_new_tokens,
            "tokens to generate before end-of-sequence or stop token ids may be drawn");
  flags.add("temperature", &g.temperature, "0 = greedy");
  flags.add("top-k", &g.top_k, "0 = off");
  flags.add("top-p", &g.top_p, "1 = off");
  flags.add("min-p", &g.min_p, "0 = off");
  flags.add("repetition-penalty", &g.repetition_penalty,
            "on prompt and generated tokens, in [0.01, 100]; 1 = off");
  flags.add("presence-penalty", &g.presence_penalty,
            "subtracted from each generated token's logit, in [-2, 2]; 0 = off");
  flags.add("frequency-penalty", &g.frequency_penalty,
            "subtracted once per occurrence of a generated token, in [-2, 2]; 0 = off");
  flags.add("seed", &g.seed,
            "sampling seed in [0, 2^64): same seed, same output (random when not given)");
  flags.add_list("stop", &g.stop, "stop strings (at most 16, each at most 1024 bytes)");
  std::string stop_token_ids;
  flags.add("stop-token-ids", &stop_token_ids,
            "comma-separated token ids that end generation (not printed), like 2,7");
  flags.add_bool("ignore-eos", &g.ignore_eos, "keep generating after end-of-sequence");
  std::string logit_bias;
  flags.add("logit-bias", &logit_bias,
            "ID:BIAS pairs like 17:-100,42:2.5: BIAS in [-100, 100] added to token ID's logit "
            "before the temperature divides it (-100 bans it at temperatures up to a few)");
  flags.add_bool("logprobs", &g.logprobs, "report the logprob of each token (with --json)");
  flags.add("top-logprobs", &g.top_logprobs, "alternatives per token (with --json)");
  flags.add("priority", &g.priority, "larger runs first");
  flags.add("request-id", &g.request_id,
            "your id for this request (in the server's log; at most 256 bytes)");
  flags.add("cache-salt", &g.cache_salt,
            "reuse the server's cached prompt blocks only of requests with this salt (at most "
            "256 bytes; keep it secret to keep others from telling what your prompts held)");
  flags.add_bool("json", &g.json,
                 "print {\"ids\", \"text\", \"logprobs\", \"top_logprobs\", \"finish_reason\", ...}");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  if (uint64_t seed = 0; flags.given("seed") && !parse_uint64(g.seed, &seed)) {
    std::fprintf(stderr, "error: --seed: expected an integer in [0, 2^64), got '%s'\n",
                 g.seed.c_str());
    return 2;
  }
  if (flags.given("logit-bias"))
    if (const std::string error = logit_bias_flag(logit_bias, &g.logit_bias); !error.empty())
      return usage_error(error);
  if (flags.given("stop-token-ids"))
    if (const std::string error =
            id_list_flag("--stop-token-ids", stop_token_ids, &g.stop_token_ids);
        !error.empty())
      return usage_error(error);
  if (const std::string error = recursion_flag_error(g.recursion); !error.empty())
    return usage_error(error);
  // A proto string must be UTF-8: protobuf logged an error line of its own, and the server refused
  // the body as one that does not parse, naming no flag.
  if (size_t ok = utf8_valid_prefix(g.request_id); ok != g.request_id.size()) {
    std::fprintf(stderr, "error: --request-id is not valid UTF-8 (bad byte at offset %zu)\n", ok);
    return 2;
  }
  if (flags.given("prompt") == flags.given("prompt-ids")) {
    std::fprintf(stderr, "error: give exactly one of --prompt and --prompt-ids (see --help)\n");
    return 2;
  }
  // The server reads an empty prompt_text as no prompt at all: an empty --prompt is sent as the
  // model's BOS alone (what `cemlm generate --prompt ""` starts from), read from GetModelInfo.
  const bool from_bos = flags.given("prompt") && g.prompt.empty();
  if (from_bos && g.no_bos) {
    std::fprintf(stderr,
                 "error: --prompt is empty and --no-bos leaves out the BOS: nothing to generate "
                 "from; give a prompt\n");
    return 2;
  }
  if (g.no_bos && flags.given("prompt-ids")) {
    std::fprintf(stderr, "error: --no-bos applies to --prompt only: --prompt-ids are used as given\n");
    return 2;
  }
  if ((g.logprobs || g.top_logprobs > 0) && !g.json) {
    std::fprintf(stderr, "error: --%s needs --json: the streamed text has no place for them\n",
                 g.logprobs ? "logprobs" : "top-logprobs");
    return 2;
  }
  v1::GenerateRequest req = generate_request(g, flags);
  // Given empty, as malformed: it sent no prompt, and the server's answer named a missing flag.
  if (flags.given("prompt-ids") && !set_ids(g.prompt_ids, "prompt-ids", req.mutable_prompt_ids()))
    return 2;
  auto channel = make_channel(c);
  if (!channel) return 2;
  auto stub = v1::Inference::NewStub(channel);
  // Streamed, the tokens of a model without a tokenizer printed as nothing: an empty line, exit 0.
  if (!g.json || from_bos) {
    grpc::ClientContext info_context;
    prepare_context(c, &info_context);
    v1::ModelInfo info;
    if (auto st = stub->GetModelInfo(&info_context, {}, &info); !st.ok()) return report_error(st);
    if (from_bos) {
      if (info.bos_id() < 0) {
        std::fprintf(stderr,
                     "error: --prompt is empty and the server's model has no BOS: nothing to "
                     "generate from; give a prompt\n");
        return 2;
      }
      req.clear_prompt_text();
      req.add_prompt_ids(info.bos_id());
    }
    if (!g.json && !info.has_tokenizer()) {
      std::fprintf(stderr,
                   "error: the server's model has no tokenizer, so its tokens have no text to "
                   "stream; add --json to get the generated ids%s\n",
                   g.prompt_ids.empty()
                       ? " (and give the prompt as --prompt-ids: it has no text either)"
                       : "");
      return 2;
    }
  }
  grpc::ClientContext context;
  prepare_context(c, &context);
  auto reader = generate_raw(*channel, &context, req);
  v1::GenerateResponse msg, last;
  json ids = json::array(), logprobs = json::array(), tops = json::array();
  std::string text;
  bool unparsed = false, answered = false;
  for (grpc::ByteBuffer raw; reader->Read(&raw);) {
    if (!parse_response(raw, &msg)) {
      unparsed = true;
      context.TryCancel();
      break;
    }
    answered = true;
    if (!g.json) {
      std::fwrite(msg.text().data(), 1, msg.text().size(), stdout);
      std::fflush(stdout);
    }
    text += msg.text();
    for (int id : msg.token_ids()) ids.push_back(id);
    for (float lp : msg.logprobs()) logprobs.push_back(lp);
    for (const v1::TokenLogprobs& t : msg.top_logprobs()) {
      json alts = json::array();
      for (const v1::TopLogprob& a : t.top())
        alts.push_back({{"id", a.token_id()}, {"logprob", a.logprob()}});
      tops.push_back(alts);
    }
    last = msg;
  }
  grpc::Status status = reader->Finish();
  if (unparsed) status = unparsed_status();
  if (!g.json && (status.ok() || !text.empty())) std::printf("\n");  // ends the streamed line
  if (!status.ok()) return report_error(status, answered);
  // A drawn seed is reported (--json has it as "seed"), so that a sample can be made again.
  if (!g.json && !flags.given("seed") &&
      (!flags.given("temperature") || g.temperature >= kGreedyBelowTemperature))
    std::fprintf(stderr, "seed %llu (--seed %llu makes this sample again)\n",
                 (unsigned long long)last.seed(), (unsigned long long)last.seed());
  if (g.json) {
    json out = final_json(last);
    out["ids"] = ids;
    out["text"] = text;
    out["logprobs"] = logprobs;
    if (g.top_logprobs > 0) out["top_logprobs"] = tops;  // per token: [{"id", "logprob"}, ...]
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}

int client_score(int argc, char** argv) {
  ChannelFlags c;
  std::string text, ids;
  int recursion = 0, priority = 0;
  bool as_json = false, no_bos = false;
  Flags flags("cemlm client score --addr HOST:PORT (--text STR | --ids 3,17,42) [--recursion T]",
              "Log-probability of every token given its prefix, NLL and perplexity.");
  add_channel_flags(&flags, &c);
  flags.add("text", &text, "text to score");
  flags.add("ids", &ids, "token ids to score (used as given)");
  flags.add_bool("no-bos", &no_bos, "do not start --text with the model's BOS");
  flags.add("recursion", &recursion, "recursion depth T; 0 = the model's default");
  flags.add("priority", &priority,
            "larger first; a full cache preempts running requests of lower priority for it");
  flags.add_bool("json", &as_json,
                 "print JSON {\"tokens\", \"logprobs\", \"nll\", \"perplexity\", \"recursion\"}, "
                 "as `cemlm score` does");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  if (flags.given("text") == flags.given("ids")) {
    std::fprintf(stderr, "error: give exactly one of --text and --ids (see --help)\n");
    return 2;
  }
  if (flags.given("text") && text.empty()) {  // as the server reads it: no input at all
    std::fprintf(stderr, "error: --text is empty; give a text to score, or its ids as --ids\n");
    return 2;
  }
  if (no_bos && flags.given("ids")) {
    std::fprintf(stderr, "error: --no-bos applies to --text only: --ids are used as given\n");
    return 2;
  }
  v1::ScoreRequest req;
  req.set_text(text);
  if (no_bos) req.set_add_bos(false);
  if (const std::string error = recursion_flag_error(recursion); !error.empty())
    return usage_error(error);
  req.set_recursion_depth(recursion);
  req.set_priority(priority);
  if (flags.given("ids") && !set_ids(ids, "ids", req.mutable_ids())) return 2;
  auto channel = make_channel(c);
  if (!channel) return 2;
  grpc::ClientContext context;
  prepare_context(c, &context);
  v1::ScoreResponse resp;
  if (auto st = v1::Inference::NewStub(channel)->Score(&context, req, &resp); !st.ok())
    return report_error(st);
  if (as_json) {
    std::printf("%s\n", score_json({resp.token_ids().begin(), resp.token_ids().end()},
                                   {resp.logprobs().begin(), resp.logprobs().end()}, resp.nll(),
                                   resp.perplexity(), resp.recursion_depth())
                            .c_str());
  } else {
    std::printf("tokens %d  T %d  nll %.6f  perplexity %.4f\n", resp.token_ids_size(),
                resp.recursion_depth(), resp.nll(), resp.perplexity());
  }
  return 0;
}

int client_tokenize(int argc, char** argv) {
  ChannelFlags c;
  std::string text;
  bool add_bos = false, as_json = false;
  Flags flags(
      "cemlm client tokenize --addr HOST:PORT --text STR [--add-bos]",
      "Token ids of a text under the served model's tokenizer (and their pieces, with --json).");
  add_channel_flags(&flags, &c);
  flags.add("text", &text, "text to tokenize", true);
  flags.add_bool("add-bos", &add_bos, "prepend the beginning-of-sequence id");
  flags.add_bool("json", &as_json, "print ids and pieces as JSON");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  v1::TokenizeRequest req;
  req.set_text(text);
  req.set_add_bos(add_bos);
  auto channel = make_channel(c);
  if (!channel) return 2;
  grpc::ClientContext context;
  prepare_context(c, &context);
  v1::TokenizeResponse resp;
  if (auto st = v1::Inference::NewStub(channel)->Tokenize(&context, req, &resp); !st.ok())
    return report_error(st);
  if (as_json) {
    print_json(resp);
    return 0;
  }
  for (int i = 0; i < resp.ids_size(); ++i) std::printf(i ? ",%d" : "%d", resp.ids(i));
  std::printf("\n");
  return 0;
}

int client_detokenize(int argc, char** argv) {
  ChannelFlags c;
  std::string ids;
  Flags flags("cemlm client detokenize --addr HOST:PORT --ids 3,17,42",
              "Text of token ids under the served model's tokenizer.");
  add_channel_flags(&flags, &c);
  flags.add("ids", &ids, "token ids", true);
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  v1::DetokenizeRequest req;
  if (!set_ids(ids, "ids", req.mutable_ids())) return 2;
  auto channel = make_channel(c);
  if (!channel) return 2;
  grpc::ClientContext context;
  prepare_context(c, &context);
  v1::DetokenizeResponse resp;
  if (auto st = v1::Inference::NewStub(channel)->Detokenize(&context, req, &resp); !st.ok())
    return report_error(st);
  std::fwrite(resp.text().data(), 1, resp.text().size(), stdout);  // the text may hold NULs
  std::putchar('\n');
  return 0;
}

int client_info(int argc, char** argv) {
  ChannelFlags c;
  Flags flags("cemlm client info --addr HOST:PORT", "The served model's metadata, as JSON.");
  add_channel_flags(&flags, &c);
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  auto channel = make_channel(c);
  if (!channel) return 2;
  grpc::ClientContext context;
  prepare_context(c, &context);
  v1::ModelInfo resp;
  if (auto st = v1::Inference::NewStub(channel)->GetModelInfo(&context, {}, &resp); !st.ok())
    return report_error(st);
  print_json(resp);
  return 0;
}

int client_health(int argc, char** argv) {
  ChannelFlags c;
  // A probe that waits for good is none: a port that takes the connection and never answers
  // held it until it was killed (and probes in loops for ever).
  c.timeout = 5;
  std::string service;
  Flags flags("cemlm client health --addr HOST:PORT [--service NAME]",
              "grpc.health.v1 status: prints SERVING / NOT_SERVING; exit 0 only when SERVING.");
  add_channel_flags(&flags, &c);
  flags.add("service", &service, "service name; empty = the whole server");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  auto channel = make_channel(c);
  if (!channel) return 2;
  grpc::ClientContext context;
  prepare_context(c, &context);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (auto st = grpc::health::v1::Health::NewStub(channel)->Check(&context, req, &resp); !st.ok())
    return report_error(st);
  std::printf("%s\n",
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()).c_str());
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

struct Sub {
  const char* name;
  int (*run)(int, char**);
};
const Sub kSubs[] = {{"generate", client_generate}, {"score", client_score},
                     {"tokenize", client_tokenize}, {"detokenize", client_detokenize},
                     {"info", client_info},         {"health", client_health}};

}  // namespace

int cmd_client(int argc, char** argv) {
  if (argc >= 1)
    for (const Sub& s : kSubs)
      if (!std::strcmp(argv[0], s.name)) return s.run(argc - 1, argv + 1);
  const bool help = argc >= 1 && (!std::strcmp(argv[0], "--help") || !std::strcmp(argv[0], "-h") ||
                                  !std::strcmp(argv[0], "help"));
  if (argc >= 1 && !help) std::fprintf(stderr, "error: unknown client command '%s'\n", argv[0]);
  std::fprintf(help ? stdout : stderr,
               "usage: cemlm client <generate|score|tokenize|detokenize|info|health> "
               "--addr HOST:PORT [options]\n\nA gRPC client of `cemlm serve`. Run "
               "'cemlm client <command> --help' for the options of each.\n");
  return help ? 0 : 2;
}

}  // namespace cemlm::cli
