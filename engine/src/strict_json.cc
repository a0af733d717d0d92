// parse_json_strict (see strict_json.h): nlohmann's SAX parser building the tree and tracking the
// keys of every open object, and its parse_error turned into a message with the position.
#include "cemlm/engine/strict_json.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace cemlm {
namespace {

using nlohmann::json;

// One open object or array. A frame keeps only its own name in its parent, not its whole path:
// copying the path into every frame costs memory quadratic in the nesting depth (a 40 KB file of
// "[[[[..." took a gigabyte). The path is built only for an error.
struct Frame {
  json* value;       // in its parent, which changes no more while this one is open
  std::string name;  // "key" or "[i]" in the parent ("" at the root)
  std::string last_key;  // (objects) the key whose value comes next
};

std::string child_path(const std::string& parent, const std::string& name, bool index) {
  if (index) return absl::StrCat(parent, name);
  return parent.empty() ? name : absl::StrCat(parent, ".", name);
}

// The dotted path of the innermost open container.
std::string path_of(const std::vector<Frame>& stack) {
  std::string path;
  for (size_t i = 1; i < stack.size(); ++i)
    path = child_path(path, stack[i].name, !stack[i - 1].value->is_object());
  return path;
}

// Builds the tree from nlohmann's SAX events, noting the first repeated key. (nlohmann's parser
// with a callback rescans the enclosing container at the end of every object: parsing took time
// quadratic in the entries, 60 s for a 1 MB config.json of 100,000 "key":{} pairs.)
class StrictSax {
 public:
  explicit StrictSax(json* root) : root_(root) {}
  const std::string& duplicate() const { return duplicate_; }
  const std::string& underflow() const { return underflow_; }

  bool null() { return put(nullptr) != nullptr; }
  bool boolean(bool v) { return put(v) != nullptr; }
  bool number_integer(json::number_integer_t v) { return put(v) != nullptr; }
  bool number_unsigned(json::number_unsigned_t v) { return put(v) != nullptr; }
  bool number_float(json::number_float_t v, const std::string& text) {
    // A number too small for a double reads as 0: "1e-400" was then refused as "= 0".
    if (v == 0 && underflow_.empty() &&
        text.substr(0, text.find_first_of("eE")).find_first_of("123456789") != std::string::npos)
      underflow_ = text;
    return put(v) != nullptr;
  }
  bool string(json::string_t& v) { return put(std::move(v)) != nullptr; }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))) != nullptr; }
  bool start_object(std::size_t /*size*/) { return open(json::object()); }
  bool start_array(std::size_t /*size*/) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    Frame& top = stack_.back();
    if (duplicate_.empty() && top.value->contains(k))
      duplicate_ = child_path(path_of(stack_), k, false);
    top.last_key = std::move(k);
    return true;
  }
  // The parser's error, thrown as the type it made (parse_error, out_of_range).
  template <typename Exception>
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const Exception& e) {
    throw e;
  }

 private:
  // Places `v` where the next value goes: the root, the end of the open array, or the open
  // object's last key (a repeated key's value replaces the first: the error is raised after).
  json* put(json v) {
    if (stack_.empty()) {
      *root_ = std::move(v);
      return root_;
    }
    json& parent = *stack_.back().value;
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    json& slot = parent[stack_.back().last_key];
    slot = std::move(v);
    return &slot;
  }
  bool open(json empty) {
    std::string name;
    if (!stack_.empty())
      name = stack_.back().value->is_object() ? stack_.back().last_key
                                              : absl::StrCat("[", stack_.back().value->size(), "]");
    json* v = put(std::move(empty));
    stack_.push_back(Frame{v, std::move(name), {}});
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }

  json* const root_;
  std::vector<Frame> stack_;
  std::string duplicate_;  // path of the first repeated key; empty while none
  std::string underflow_;  // the first number not 0 that reads as 0; empty while none
};

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

// A number no double holds: said where it stands, in words.
absl::Status number_error(std::string_view text, const std::string& literal, const char* what) {
  const size_t at = number_at(text, literal);
  return absl::InvalidArgumentError(absl::StrCat(
      "not valid JSON", at == std::string_view::npos ? "" : " at ",
      at == std::string_view::npos ? "" : position(text, at), ": the number ", literal, " ", what));
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
  json root;
  StrictSax sax(&root);
  try {
    json::sax_parse(text.begin(), text.end(), &sax);
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
      return number_error(text, what.substr(open + 1, close - open - 1),
                          "is beyond the range of a 64-bit float");
    }
    return absl::InvalidArgumentError(absl::StrCat("not valid JSON: ", e.what()));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("not valid JSON: ", e.what()));
  }
  if (const std::string& literal = sax.underflow(); !literal.empty())
    return number_error(text, literal, "is below the range of a 64-bit float (it would read as 0)");
  if (const std::string& duplicate = sax.duplicate(); !duplicate.empty())
    return absl::InvalidArgumentError(absl::StrCat("duplicate key \"", absl::CHexEscape(duplicate),
                                                   "\" (a key may appear once per object)"));
  return root;
}

}  // namespace cemlm
