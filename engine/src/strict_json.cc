// parse_json_strict (see strict_json.h): nlohmann's parser with a callback that tracks the keys
// of every open object, and its parse_error turned into a message with the position.
#include "cemlm/engine/strict_json.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace cemlm {
namespace {

using nlohmann::json;

// One open object or array, as the parser callback sees them. A frame keeps only its own name in
// its parent, not its whole path: copying the path into every frame costs memory quadratic in the
// nesting depth (a 40 KB file of "[[[[..." took a gigabyte). The path is built only for an error.
struct Frame {
  bool is_object = false;
  std::string name;  // "key" or "[i]" in the parent ("" at the root)
  std::set<std::string> keys;
  std::string last_key;      // (objects) the key whose value comes next
  size_t count = 0;          // (arrays) elements seen so far
};

std::string child_path(const std::string& parent, const std::string& name, bool index) {
  if (index) return absl::StrCat(parent, name);
  return parent.empty() ? name : absl::StrCat(parent, ".", name);
}

// The dotted path of the innermost open container.
std::string path_of(const std::vector<Frame>& stack) {
  std::string path;
  for (size_t i = 1; i < stack.size(); ++i)
    path = child_path(path, stack[i].name, !stack[i - 1].is_object);
  return path;
}

// The files read through here nest three levels deep; a deeper value is refused before parsing,
// so that neither the parser's tree nor anything that walks it recursively (dump()) can be made
// to exhaust memory or the stack by a file of brackets.
constexpr size_t kMaxDepth = 64;

// The first offset outside string literals (and their quotes) for which `hit(offset)` holds, or
// npos. Escapes inside strings are skipped; a malformed text is left to the parser to describe.
template <typename Hit>
size_t find_outside_strings(std::string_view text, Hit hit) {
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (hit(i)) {
      return i;
    }
  }
  return std::string_view::npos;
}

// The offset of the bracket that opens level kMaxDepth + 1, or npos.
size_t too_deep_at(std::string_view text) {
  size_t depth = 0;
  return find_outside_strings(text, [&](size_t i) {
    const char c = text[i];
    if (c == '[' || c == '{') return ++depth > kMaxDepth;
    if ((c == ']' || c == '}') && depth > 0) --depth;
    return false;
  });
}

// "line L, column C (byte B)" for the 0-based offset `at` (L and C from 1, C in bytes).
std::string position(std::string_view text, size_t at) {
  const size_t line_start = at == 0 ? std::string_view::npos : text.rfind('\n', at - 1);
  const size_t line = 1 + size_t(std::count(text.begin(), text.begin() + long(at), '\n'));
  const size_t column = line_start == std::string_view::npos ? at + 1 : at - line_start;
  return absl::StrCat("line ", line, ", column ", column, " (byte ", at, ")");
}

// The offset of the number `literal` where it stands as a value (outside strings, not inside a
// longer number), or npos: nlohmann's error for a number beyond a double says which, not where.
size_t number_at(std::string_view text, std::string_view literal) {
  auto in_number = [](char c) {
    return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E';
  };
  return find_outside_strings(text, [&](size_t i) {
    return text.substr(i, literal.size()) == literal && (i == 0 || !in_number(text[i - 1])) &&
           (i + literal.size() == text.size() || !in_number(text[i + literal.size()]));
  });
}

}  // namespace

absl::StatusOr<json> parse_json_strict(std::string_view text) {
  // nlohmann's lexer takes a NUL byte for the end of the input, so `{...}` followed by a NUL and
  // anything at all parsed as valid. No NUL belongs in JSON text (inside a string it must be
  // written \u0000), so one is refused wherever it is.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    return absl::InvalidArgumentError(
        absl::StrCat("not valid JSON at ", position(text, nul),
                     ": a NUL byte (JSON text never holds one; is this a binary file?)"));
  if (const size_t at = too_deep_at(text); at != std::string_view::npos)
    return absl::InvalidArgumentError(
        absl::StrCat("not valid JSON at ", position(text, at), ": nested more than ", kMaxDepth,
                     " arrays/objects deep (a config.json or safetensors header needs 3)"));
  std::vector<Frame> stack;
  std::string duplicate;  // path of the first repeated key; empty while none
  // How the container starting now is named in the enclosing frame.
  auto next_name = [&stack]() -> std::string {
    if (stack.empty()) return "";
    Frame& top = stack.back();
    if (top.is_object) return top.last_key;
    return absl::StrCat("[", top.count++, "]");
  };
  const json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t event,
                                         json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start: {
        Frame f;
        f.is_object = event == json::parse_event_t::object_start;
        f.name = next_name();
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
          duplicate = child_path(path_of(stack), top.last_key, false);
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
    // what(): "[json.exception.parse_error.101] parse error at line 1, column 2: syntax error ..."
    std::string what = e.what();
    if (const size_t colon = what.find(": "); colon != std::string::npos) what.erase(0, colon + 2);
    // "…; last read: '<the bytes read>'": those are the file's, escaped as other messages quote it.
    constexpr std::string_view kLastRead = "last read: '";
    if (const size_t open = what.find(kLastRead), close = what.rfind('\'');
        open != std::string::npos && close >= open + kLastRead.size()) {
      const size_t from = open + kLastRead.size();
      what.replace(from, close - from, absl::CHexEscape(what.substr(from, close - from)));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("not valid JSON at ", position(text, at), ": ", what));
  } catch (const json::out_of_range& e) {
    // 406: "number overflow parsing '1e999'", a number beyond a double (a value no file of ours
    // holds): said where it is, in words, without nlohmann's exception name.
    std::string what = e.what();
    const size_t open = what.find('\''), close = what.rfind('\'');
    if (e.id == 406 && open != std::string::npos && close > open) {
      const std::string literal = what.substr(open + 1, close - open - 1);
      const size_t at = number_at(text, literal);
      return absl::InvalidArgumentError(
          absl::StrCat("not valid JSON", at == std::string_view::npos ? "" : " at ",
                       at == std::string_view::npos ? "" : position(text, at), ": the number ",
                       literal, " is beyond the range of a 64-bit float"));
    }
    return absl::InvalidArgumentError(absl::StrCat("not valid JSON: ", e.what()));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!duplicate.empty())
    return absl::InvalidArgumentError(absl::StrCat("duplicate key \"", absl::CHexEscape(duplicate),
                                                   "\" (a key may appear once per object)"));
  return root;
}

}  // namespace cemlm
