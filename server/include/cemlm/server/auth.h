// Optional API keys (--api-key-file): every Inference RPC must then send the metadata
// `authorization: Bearer KEY`; health checks and reflection stay open.
#pragma once
#include <grpcpp/server_context.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace cemlm::server {

class ApiKeys {
 public:
  ApiKeys() = default;  // no keys: every request is allowed
  // One key per line; blank lines and lines starting with '#' are skipped.
  static absl::StatusOr<ApiKeys> load(const std::string& path);

  bool enabled() const { return !keys_.empty(); }
  // UNAUTHENTICATED when keys are on and the call does not carry one of them.
  grpc::Status check(const grpc::ServerContextBase& context) const;

 private:
  bool known(absl::string_view key) const;
  std::vector<std::string> keys_;
};

}  // namespace cemlm::server
