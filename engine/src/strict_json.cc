// parse_json_strict (see strict_json.h): nlohmann's parser with a callback that tracks the keys
// of every open object, and its parse_error turned into a message with the position.
#include "cemlm/engine/strict_json.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace cemlm {
namespace {

using nlohmann::json;

// One open object or array, as the parser callback sees them.
struct Frame {
  bool is_object = false;
  std::string path;          // dotted path of this container ("" at the root)
  std::set<std::string> keys;
  std::string last_key;      // (objects) the key whose value comes next
  size_t count = 0;          // (arrays) elements seen so far
};

std::string child_path(const std::string& parent, const std::string& name, bool index) {
  if (index) return absl::StrCat(parent, name);
  return parent.empty() ? name : absl::StrCat(parent, ".", name);
}

}  // namespace

absl::StatusOr<json> parse_json_strict(std::string_view text) {
  std::vector<Frame> stack;
  std::string duplicate;  // path of the first repeated key; empty while none
  // Where the container or value starting now sits, relative to the enclosing frame.
  auto next_path = [&stack]() -> std::string {
    if (stack.empty()) return "";
    Frame& top = stack.back();
    if (top.is_object) return child_path(top.path, top.last_key, false);
    return child_path(top.path, absl::StrCat("[", top.count++, "]"), true);
  };
  const json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t event,
                                         json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start: {
        Frame f;
        f.is_object = event == json::parse_event_t::object_start;
        f.path = next_path();
        stack.push_back(std::move(f));
        break;
      }
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        if (stack.empty() || !parsed.is_string()) break;
        Frame& top = stack.back();
        top.last_key = parsed.get<std::string>();
        if (!top.keys.insert(top.last_key).second && duplicate.empty())
          duplicate = child_path(top.path, top.last_key, false);
        break;
      }
      case json::parse_event_t::value:
        if (!stack.empty() && !stack.back().is_object) ++stack.back().count;
        break;
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true);
  } catch (const json::parse_error& e) {
    // e.byte counts the characters read, the offending one included; nlohmann's own line and
    // column are not reliable (a column 0 mid-line), so both come from the offset here.
    const size_t at = std::min<size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    const size_t line_start = at == 0 ? std::string_view::npos : text.rfind('\n', at - 1);
    const size_t line = 1 + size_t(std::count(text.begin(), text.begin() + long(at), '\n'));
    const size_t column = line_start == std::string_view::npos ? at + 1 : at - line_start;
    // what(): "[json.exception.parse_error.101] parse error at line 1, column 2: syntax error ..."
    std::string what = e.what();
    if (const size_t colon = what.find(": "); colon != std::string::npos) what.erase(0, colon + 2);
    return absl::InvalidArgumentError(absl::StrCat("not valid JSON at line ", line, ", column ",
                                                   column, " (byte ", at, "): ", what));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!duplicate.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("duplicate key \"", duplicate, "\" (a key may appear once per object)"));
  return root;
}

}  // namespace cemlm
