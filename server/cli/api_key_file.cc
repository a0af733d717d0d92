#include "api_key_file.h"

#include <chrono>
#include <filesystem>

#include "cemlm/engine/corpus.h"
#include "spdlog/spdlog.h"

namespace cemlm::cli {
namespace {

// The file's text, or why it cannot be read (which names it).
std::optional<std::string> read_text(const std::string& path, std::string* error) {
  std::string text;
  if (!read_file(path, &text, error)) return std::nullopt;
  return text;
}

// Whether the file was written in the last 2 seconds: a look may have landed while it was being
// written in place, and read a part of it (a key cut short is another key; a line whose
// max_priority= was cut off has no cap). A write that began earlier has ended by now.
bool written_lately(const std::string& path) {
  std::error_code ec;
  const auto written = std::filesystem::last_write_time(path, ec);
  if (ec) return false;
  const auto age = std::filesystem::file_time_type::clock::now() - written;
  return age >= std::chrono::seconds(0) && age < std::chrono::seconds(2);
}

}  // namespace

absl::StatusOr<server::ApiKeys> ApiKeyFile::load() {
  std::string error;
  text_ = read_text(path_, &error);
  if (!text_) return absl::InvalidArgumentError("--api-key-file: " + error);
  return server::ApiKeys::parse(*text_, path_);
}

std::optional<server::ApiKeys> ApiKeyFile::reload(std::string_view why, bool changed_only) {
  std::string error;
  std::optional<std::string> text = read_text(path_, &error);
  if (changed_only && (text == text_ || (text && written_lately(path_)))) return std::nullopt;
  text_ = std::move(text);
  if (!text_) {
    spdlog::error("{}: --api-key-file: {}; the keys served are unchanged", why, error);
    return std::nullopt;
  }
  auto keys = server::ApiKeys::parse(*text_, path_);
  if (!keys.ok()) {
    spdlog::error("{}: {}; the keys served are unchanged", why,
                  std::string(keys.status().message()));
    return std::nullopt;
  }
  return *std::move(keys);
}

}  // namespace cemlm::cli
