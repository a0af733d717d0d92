// Optional API keys (--api-key-file): every Inference RPC must then send the metadata
// `authorization: Bearer KEY`; health checks and reflection stay open. A key may carry the highest
// request priority its callers may ask for.
#pragma once
#include <grpcpp/server_context.h>

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace cemlm::server {

class ApiKeys {
 public:
  ApiKeys() = default;  // no keys: every request is allowed
  // One key per line, optionally followed by ` max_priority=N` (an int32); blank lines and lines
  // starting with '#' are skipped. A key given twice, or "max_priority" anywhere else, is refused.
  // `text` is the file's (`path` names it in errors).
  static absl::StatusOr<ApiKeys> parse(std::string_view text, const std::string& path);
  // Keys loaded again (SIGHUP): each key `previous` held keeps its identity (Grant::key, which
  // scopes the prefix cache); a new key gets one no key of `previous` ever had.
  void keep_identities(const ApiKeys& previous);
  size_t size() const { return keys_.size(); }

  bool enabled() const { return !keys_.empty(); }
  // What a call's key grants it.
  struct Grant {
    std::optional<int> max_priority;  // its line's max_priority=, if any
    int key = -1;  // which key (its identity, never another key's); -1 when keys are off
  };
  // UNAUTHENTICATED when keys are on and the call does not carry one of them. When OK and
  // `grant` is given, it is set to what the call's key grants (nothing when keys are off).
  grpc::Status check(const grpc::ServerContextBase& context, Grant* grant = nullptr) const {
    return check(context.client_metadata(), grant);
  }
  // The same, on a call's metadata (a ServerContext's, or what an AuthMetadataProcessor gets).
  using Metadata = std::multimap<grpc::string_ref, grpc::string_ref>;
  grpc::Status check(const Metadata& metadata, Grant* grant = nullptr) const;

 private:
  struct Key {
    std::string key;
    std::optional<int> max_priority;
    int line = 0;  // in the file, for errors
    int id = 0;    // Grant::key
  };
  // The key's entry, found comparing every key in constant time; null when none matches.
  const Key* find(absl::string_view key) const;
  std::vector<Key> keys_;
  int next_id_ = 0;  // past every id given out, by this load and those it followed
};

}  // namespace cemlm::server
