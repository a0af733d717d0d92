// gRPC client helpers shared by the server tests: a whole Generate stream collected, requests
// built from ids, and the per-call API key and deadline.
#pragma once
#include <grpc/support/time.h>
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cemlm/v1/inference.grpc.pb.h"

namespace cemlm::testing_server {

struct Stream {
  std::vector<v1::GenerateResponse> messages;
  grpc::Status status;
  std::vector<int> ids() const {
    std::vector<int> out;
    for (const auto& m : messages)
      out.insert(out.end(), m.token_ids().begin(), m.token_ids().end());
    return out;
  }
  std::string text() const {
    std::string out;
    for (const auto& m : messages) out += m.text();
    return out;
  }
};

struct CallOptions {
  std::string api_key;                       // sent as `scheme key` when not empty
  std::chrono::milliseconds timeout{30000};  // the call's deadline
  std::string scheme = "Bearer";
};

inline void prepare(grpc::ClientContext* context, const CallOptions& o) {
  if (!o.api_key.empty()) context->AddMetadata("authorization", o.scheme + " " + o.api_key);
  // As a timespec: a system_clock time point cannot hold the centuries a test may ask for.
  context->set_deadline(gpr_time_add(gpr_now(GPR_CLOCK_REALTIME),
                                     gpr_time_from_millis(o.timeout.count(), GPR_TIMESPAN)));
}

// A channel whose streams announce a 1 KiB window that does not grow (no BDP probes), so that
// what a test does not read stays on the server. gRPC sends that window in a setting after the
// connection's first (the default 64 KiB), and under load a server sent a whole stream before it
// took effect: a first call here makes sure it has.
inline std::shared_ptr<grpc::Channel> small_window_channel(const std::string& addr) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto channel = grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
  grpc::ClientContext context;
  v1::ModelInfo info;
  const grpc::Status st =
      v1::Inference::NewStub(channel)->GetModelInfo(&context, v1::GetModelInfoRequest(), &info);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return channel;
}

// A request for `max_new` tokens after the given prompt ids (EOS ignored, so exactly max_new).
inline v1::GenerateRequest ids_request(const std::vector<int>& ids, int max_new, int T = 0) {
  v1::GenerateRequest req;
  req.mutable_prompt_ids()->Add(ids.begin(), ids.end());
  req.set_recursion_depth(T);
  req.mutable_sampling()->set_max_new_tokens(max_new);
  req.mutable_sampling()->set_ignore_eos(true);
  return req;
}

inline Stream generate(const std::shared_ptr<grpc::Channel>& channel,
                       const v1::GenerateRequest& req, const CallOptions& o = {}) {
  grpc::ClientContext context;
  prepare(&context, o);
  auto reader = v1::Inference::NewStub(channel)->Generate(&context, req);
  Stream s;
  for (v1::GenerateResponse m; reader->Read(&m);) s.messages.push_back(m);
  s.status = reader->Finish();
  return s;
}

inline grpc::Status score(const std::shared_ptr<grpc::Channel>& channel,
                          const v1::ScoreRequest& req, v1::ScoreResponse* resp,
                          const CallOptions& o = {}) {
  grpc::ClientContext context;
  prepare(&context, o);
  return v1::Inference::NewStub(channel)->Score(&context, req, resp);
}

}  // namespace cemlm::testing_server
