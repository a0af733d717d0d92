// API-key check (see auth.h). Keys are compared in time independent of where they differ, so the
// response time does not leak a key prefix.
#include "cemlm/server/auth.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace cemlm::server {
namespace {

constexpr absl::string_view kBearer = "Bearer ";

bool equal_constant_time(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::StatusOr<ApiKeys> ApiKeys::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError("--api-key-file: cannot read '" + path + "'");
  ApiKeys out;
  for (std::string line; std::getline(in, line);) {
    absl::string_view key = absl::StripAsciiWhitespace(line);
    if (!key.empty() && key[0] != '#') out.keys_.emplace_back(key);
  }
  if (out.keys_.empty())
    return absl::InvalidArgumentError("--api-key-file: '" + path +
                                      "' holds no key (write one key per line)");
  return out;
}

bool ApiKeys::known(absl::string_view key) const {
  bool found = false;
  for (const auto& k : keys_) found |= equal_constant_time(k, key);
  return found;
}

grpc::Status ApiKeys::check(const grpc::ServerContextBase& context) const {
  if (!enabled()) return grpc::Status::OK;
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end())
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing API key: send the metadata 'authorization: Bearer <key>'");
  absl::string_view value(it->second.data(), it->second.size());
  // The scheme is case-insensitive (RFC 7235 §2.1): "bearer KEY" is as good as "Bearer KEY".
  if (!absl::StartsWithIgnoreCase(value, kBearer) || !known(value.substr(kBearer.size())))
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "invalid API key in the 'authorization' metadata");
  return grpc::Status::OK;
}

}  // namespace cemlm::server
