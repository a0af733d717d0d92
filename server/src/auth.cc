// API-key check (see auth.h). Keys are compared in time independent of where they differ and of
// the length of what was sent, so the response time leaks neither a key's prefix nor its length.
#include "cemlm/server/auth.h"

#include <algorithm>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace cemlm::server {
namespace {

constexpr absl::string_view kBearer = "Bearer ";

// Every byte of `key` is compared whatever the length of `given`: the time depends on the key's
// length, which a caller cannot vary, and on nothing else.
bool equal_constant_time(absl::string_view key, absl::string_view given) {
  size_t diff = key.size() ^ given.size();
  for (size_t i = 0; i < key.size(); ++i) {
    const unsigned char g = given.empty() ? 0 : static_cast<unsigned char>(given[i % given.size()]);
    diff |= static_cast<unsigned char>(key[i]) ^ g;
  }
  return diff == 0;
}

constexpr absl::string_view kUtf8Bom = "\xEF\xBB\xBF";
constexpr absl::string_view kMaxPriority = "max_priority=";

}  // namespace

absl::StatusOr<ApiKeys> ApiKeys::parse(std::string_view text, const std::string& path) {
  std::istringstream in{std::string(text)};
  ApiKeys out;
  // The line of each key so far: a file of many keys was checked for repeats pair by pair (80,000
  // keys took 10 s to load, and a reload held the signal loop, SIGTERM included, that long).
  std::unordered_map<std::string, int> line_of;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    // Editors on Windows start a UTF-8 file with a byte-order mark, which is not part of a key.
    if (++number == 1 && absl::StartsWith(line, kUtf8Bom)) line.erase(0, kUtf8Bom.size());
    absl::string_view key = absl::StripAsciiWhitespace(line);
    if (key.empty() || key[0] == '#') continue;
    const std::string where = absl::StrCat("--api-key-file: line ", number, " of '", path, "'");
    std::optional<int> max_priority;
    // "KEY max_priority=N": the last word, after whitespace (a key may hold spaces itself).
    if (const size_t space = key.find_last_of(" \t");
        space != absl::string_view::npos && absl::StartsWith(key.substr(space + 1), kMaxPriority)) {
      int value = 0;
      if (!absl::SimpleAtoi(key.substr(space + 1 + kMaxPriority.size()), &value))
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": '", key.substr(space + 1),
                         "' is not max_priority=N with N an integer in [-2^31, 2^31)"));
      max_priority = value;
      key = absl::StripTrailingAsciiWhitespace(key.substr(0, space));
    }
    // Anything else with the word is a cap written wrong ("max_priority = 5", a line of the cap
    // alone, a comment after it, MAX_PRIORITY=5, max-priority=5 as the flag is spelt): refused, as
    // it would have made a key that anyone could guess or that nobody meant.
    if (const std::string lower = absl::AsciiStrToLower(key);
        absl::StrContains(lower, "max_priority") || absl::StrContains(lower, "max-priority"))
      return absl::InvalidArgumentError(absl::StrCat(
          where,
          ": write a key's cap as its line's last word, 'KEY max_priority=N', after the "
          "key and with no spaces around '='"));
    // Comments take whole lines: "KEY  # the ops team" made the whole line the key.
    if (const size_t hash = key.find('#');
        hash != absl::string_view::npos && hash > 0 && absl::ascii_isspace(key[hash - 1]))
      return absl::InvalidArgumentError(absl::StrCat(
          where,
          ": a '#' after a space reads as a comment after the key, which this file does not "
          "have: write comments on lines of their own (a key cannot hold ' #')"));
    // Any other "NAME=VALUE" after the key is an option misspelt ("max_priorty=5"), which would
    // have become part of a key that nobody sends, its cap lost without a word. (Not a word of
    // base64 padding, "ghIJ==", nor one ending in '=': a key may hold those.)
    if (const size_t space = key.find_last_of(" \t"); space != absl::string_view::npos) {
      const absl::string_view word = key.substr(space + 1);
      const size_t eq = word.find('=');
      if (eq != absl::string_view::npos && eq > 0 && eq + 1 < word.size() && word[eq + 1] != '=' &&
          std::all_of(word.begin(), word.begin() + eq,
                      [](char c) { return absl::ascii_isalpha(c) || c == '_' || c == '-'; }))
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": '", word,
            "' after the key reads as an option, and the only one is max_priority=N (a key "
            "cannot end in such a word)"));
    }
    // Metadata values are visible ASCII (and spaces): gRPC clients refuse to send other bytes.
    for (const char c : key)
      if (c < 0x20 || c > 0x7E)
        return absl::InvalidArgumentError(
            where + " holds a byte no client can send in metadata; keys are printable ASCII");
    // Which line's cap would hold is not for the order of lines to decide.
    if (const auto [it, added] = line_of.emplace(std::string(key), number); !added)
      return absl::InvalidArgumentError(
          absl::StrCat(where, " repeats the key of line ", it->second, "; list each key once"));
    out.keys_.push_back({std::string(key), max_priority, number, out.next_id_++});
  }
  if (out.keys_.empty())
    return absl::InvalidArgumentError("--api-key-file: '" + path +
                                      "' holds no key (write one key per line)");
  return out;
}

void ApiKeys::keep_identities(const ApiKeys& previous) {
  std::unordered_map<std::string_view, int> id_of;
  for (const Key& p : previous.keys_) id_of.emplace(p.key, p.id);
  int next = previous.next_id_;
  for (Key& k : keys_) {
    const auto old = id_of.find(k.key);
    k.id = old != id_of.end() ? old->second : next++;
  }
  next_id_ = next;
}

const ApiKeys::Key* ApiKeys::find(absl::string_view key) const {
  const Key* found = nullptr;
  for (const auto& k : keys_)  // every key compared, whichever matches
    if (equal_constant_time(k.key, key)) found = &k;
  return found;
}

grpc::Status ApiKeys::check(const Metadata& md, Grant* grant) const {
  if (grant) *grant = Grant{};
  if (!enabled()) return grpc::Status::OK;
  auto it = md.find("authorization");
  if (it == md.end())
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing API key: send the metadata 'authorization: Bearer <key>'");
  // Which of several would count is up to the order a proxy on the way appended them in: none.
  if (const size_t n = md.count("authorization"); n > 1)
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the call carries " + std::to_string(n) +
                            " 'authorization' metadata entries; send exactly one");
  absl::string_view value(it->second.data(), it->second.size());
  // The scheme is case-insensitive (RFC 7235 §2.1): "bearer KEY" is as good as "Bearer KEY";
  // spaces after it and at the end are none of the key (RFC 9110 §11.4, §5.5), as in the key file.
  const Key* key = absl::StartsWithIgnoreCase(value, kBearer)
                       ? find(absl::StripAsciiWhitespace(value.substr(kBearer.size())))
                       : nullptr;
  if (!key)
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "invalid API key in the 'authorization' metadata");
  if (grant) *grant = Grant{key->max_priority, key->id};
  return grpc::Status::OK;
}

}  // namespace cemlm::server
