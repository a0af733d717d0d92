// Optional API keys (--api-key-file): every Inference RPC must then send the metadata
// `authorization: Bearer KEY`; health checks and reflection stay open. A key may carry the highest
// request priority its callers may ask for.
#pragma once
#include <grpcpp/server_context.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace cemlm::server {

class ApiKeys {
 public:
  ApiKeys() = default;  // no keys: every request is allowed
  // One key per line, optionally followed by ` max_priority=N` (an int32); blank lines and lines
  // starting with '#' are skipped. A key given twice, or "max_priority" anywhere else, is refused.
  static absl::StatusOr<ApiKeys> load(const std::string& path);

  bool enabled() const { return !keys_.empty(); }
  // UNAUTHENTICATED when keys are on and the call does not carry one of them. When OK and
  // `max_priority` is given, it is set to the key's max_priority= (left as it is when its line
  // has none, or keys are off).
  grpc::Status check(const grpc::ServerContextBase& context,
                     std::optional<int>* max_priority = nullptr) const {
    return check(context.client_metadata(), max_priority);
  }
  // The same, on a call's metadata (a ServerContext's, or what an AuthMetadataProcessor gets).
  using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;
  grpc::Status check(const Metadata& metadata, std::optional<int>* max_priority = nullptr) const;

 private:
  struct Key {
    std::string key;
    std::optional<int> max_priority;
    int line = 0;  // in the file, for errors
  };
  // The key's entry, found comparing every key in constant time; null when none matches.
  const Key* find(absl::string_view key) const;
  std::vector<Key> keys_;
};

}  // namespace cemlm::server
