// Flag parser implementation (see flags.h).
#include "cemlm/cli/flags.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string_view>
#include <system_error>
#include <utility>

#include "nlohmann/json.hpp"

namespace cemlm::cli {
namespace {

template <typename T>
bool parse_number(const std::string& s, T* out) {
  if (s.empty()) return false;
  if constexpr (std::is_floating_point_v<T>) {
    // Decimal or scientific only, the whole text: strtod also took leading blanks and hex
    // ("--lr 0x10" was 16).
    double v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, std::chars_format::general);
    if (ec != std::errc() || p != s.data() + s.size()) return false;
    // A finite value T cannot hold would become inf or 0: refused rather than changed.
    if (std::isfinite(v) &&
        (std::abs(v) > double(std::numeric_limits<T>::max()) || (v != 0 && T(v) == 0)))
      return false;
    *out = T(v);
    return true;
  } else {
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
    return ec == std::errc() && p == s.data() + s.size();
  }
}

template <typename T>
std::string to_text(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// A flag's help under its name: every line indented, those the text breaks itself included.
std::string indented(const std::string& text) {
  std::string out = "      ";
  for (char c : text) out += c == '\n' ? std::string("\n      ") : std::string(1, c);
  return out;
}
}  // namespace

Flags::Flags(std::string usage, std::string summary)
    : usage_(std::move(usage)), summary_(std::move(summary)) {}

Flags::Flag& Flags::declare(const std::string& name, const std::string& help, bool required) {
  flags_.push_back(Flag{name, help, "", "", required});
  return flags_.back();
}

void Flags::add(const std::string& name, std::string* out, const std::string& help, bool required) {
  Flag& f = declare(name, help, required);
  f.default_text = out->empty() ? "" : "\"" + *out + "\"";
  f.metavar = "STR";
  f.set = [out](const std::string& v) { *out = v; return true; };
}

void Flags::add_nonempty(const std::string& name, std::string* out, const std::string& help,
                         const std::string& if_empty, bool required) {
  add(name, out, help, required);
  flags_.back().if_empty = if_empty;
}

#define CEMLM_NUMERIC_FLAG(T, META, EXPECTED)                                                \
  void Flags::add(const std::string& name, T* out, const std::string& help, bool required) { \
    Flag& f = declare(name, help, required);                                                 \
    f.default_text = to_text(*out);                                                          \
    f.metavar = META;                                                                        \
    f.expected = EXPECTED;                                                                   \
    f.set = [out](const std::string& v) { return parse_number(v, out); };                    \
  }
CEMLM_NUMERIC_FLAG(int, "N", "an integer in [-2147483648, 2147483647]")
CEMLM_NUMERIC_FLAG(int64_t, "N", "an integer in [-2^63, 2^63)")
CEMLM_NUMERIC_FLAG(uint64_t, "N", "an integer in [0, 2^64)")
CEMLM_NUMERIC_FLAG(double, "X", "a decimal number like 0.001 or 1e-3")
CEMLM_NUMERIC_FLAG(float, "X",
                   "a decimal number like 0.5 that a float holds (within ±3.4e38, and 0 or at "
                   "least 1.2e-38 in size: smaller ones would round to 0)")
#undef CEMLM_NUMERIC_FLAG

void Flags::add_bool(const std::string& name, bool* out, const std::string& help) {
  Flag& f = declare(name, help, false);
  f.is_bool = true;
  f.set = [out](const std::string&) { *out = true; return true; };
}

void Flags::add_list(const std::string& name, std::vector<std::string>* out,
                     const std::string& help, bool required) {
  Flag& f = declare(name, help, required);
  f.is_list = true;
  f.metavar = "ITEM…";
  f.set = [out](const std::string& v) { out->push_back(v); return true; };
}

void Flags::add_positional(const std::string& name, std::string* out, const std::string& help,
                           bool required) {
  positionals_.push_back(Flag{name, help, "", name, required});
  positionals_.back().set = [out](const std::string& v) { *out = v; return true; };
}

bool Flags::given(const std::string& name) const {
  for (const auto& f : flags_)
    if (f.name == name) return f.given;
  for (const auto& f : positionals_)
    if (f.name == name) return f.given;
  return false;
}

std::string Flags::help() const {
  std::ostringstream os;
  os << "usage: " << usage_ << "\n\n" << summary_ << "\n";
  if (!positionals_.empty()) {
    os << "\narguments:\n";
    for (const auto& f : positionals_) os << "  " << f.name << "\n" << indented(f.help) << "\n";
  }
  os << "\noptions:\n";
  for (const auto& f : flags_) {
    os << "  --" << f.name;
    if (!f.is_bool) os << " " << f.metavar;
    os << "\n" << indented(f.help);
    if (f.required) os << " (required)";
    // A help that says its own default (one computed or drawn at run time) is not contradicted.
    else if (!f.default_text.empty() && f.help.find("default: ") == std::string::npos)
      os << " (default: " << f.default_text << ")";
    os << "\n";
  }
  os << "  --help\n      show this help and exit\n";
  return os.str();
}

int Flags::parse(int argc, char** argv) {
  size_t next_positional = 0;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return 0;
    }
    if (a.rfind("--", 0) != 0) {
      if (next_positional >= positionals_.size()) {
        std::fprintf(stderr, "error: unexpected argument '%s' (see --help)\n", a.c_str());
        return 2;
      }
      positionals_[next_positional].given = true;
      positionals_[next_positional++].set(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    Flag* f = nullptr;
    for (auto& g : flags_)
      if (g.name == name) f = &g;
    if (!f) {
      std::fprintf(stderr, "error: unknown option '--%s' (see --help)\n", name.c_str());
      return 2;
    }
    f->given = true;
    if (f->is_bool) {
      if (has_value) {  // "--json=false" must not turn JSON on
        std::fprintf(stderr, "error: option '--%s' takes no value (got '%s'); leave it out to "
                     "keep it off\n", name.c_str(), value.c_str());
        return 2;
      }
      f->set("");
      continue;
    }
    if (f->is_list) {
      // The values run to the next option: "--" then a letter. "--" and "-- Larry Wall" are values
      // (stop strings the default model writes); "--ab" as a value is written --stop=--ab.
      auto option = [](std::string_view arg) {
        return arg.size() > 2 && arg.starts_with("--") && std::isalpha(uint8_t(arg[2]));
      };
      const int before = i;
      if (has_value) f->set(value);
      while (i + 1 < argc && !option(argv[i + 1])) f->set(argv[++i]);
      if (!has_value && i == before) {  // "--data $EMPTY" must not fall back to the default
        if (i + 1 < argc)
          std::fprintf(stderr,
                       "error: option '--%s' needs at least one value, but '%s' follows it, read "
                       "as an option; for that text as a value write --%s=%s\n",
                       name.c_str(), argv[i + 1], name.c_str(), argv[i + 1]);
        else
          std::fprintf(stderr, "error: option '--%s' needs at least one value (see --help)\n",
                       name.c_str());
        return 2;
      }
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "error: option '--%s' needs a value (see --help)\n", name.c_str());
        return 2;
      }
      value = argv[++i];
      // "--prompt --json" left the prompt's text out rather than asking for "--json" as a prompt.
      if (std::string_view other = value; other.starts_with("--")) {
        other.remove_prefix(2);
        other = other.substr(0, other.find('='));
        const bool is_flag =
            other == "help" || std::any_of(flags_.begin(), flags_.end(),
                                           [&](const Flag& g) { return g.name == other; });
        if (is_flag) {
          std::fprintf(stderr,
                       "error: option '--%s' needs a value, but '%s' follows it, an option "
                       "of its own; for that text as the value write --%s=%s\n",
                       name.c_str(), value.c_str(), name.c_str(), value.c_str());
          return 2;
        }
      }
    }
    if (value.empty() && !f->if_empty.empty()) {
      std::fprintf(stderr, "error: --%s is empty: %s\n", name.c_str(), f->if_empty.c_str());
      return 2;
    }
    if (!f->set(value)) {
      std::fprintf(stderr, "error: option '--%s': expected %s, got '%s'\n", name.c_str(),
                   f->expected.c_str(), value.c_str());
      return 2;
    }
  }
  for (const auto* list : {&flags_, &positionals_})
    for (const auto& f : *list)
      if (f.required && !f.given) {
        std::fprintf(stderr, "error: '%s%s' is required (see --help)\n",
                     list == &flags_ ? "--" : "", f.name.c_str());
        return 2;
      }
  return -1;
}

bool parse_uint64(const std::string& s, uint64_t* out) { return parse_number(s, out); }

std::string id_list_flag(const std::string& flag, const std::string& text, std::vector<int>* out) {
  if (!parse_id_list(text, out))
    return flag + ": expected comma-separated integers like 3,17,42, got '" + text + "'";
  for (size_t i = 0; i < out->size(); ++i)
    if ((*out)[i] < 0)
      return flag + "[" + std::to_string(i) + "] = " + std::to_string((*out)[i]) +
             " is not a token id (ids are >= 0)";
  return "";
}

std::string recursion_flag_error(int T) {
  return T < 0 ? "--recursion = " + std::to_string(T) +
                     " must be >= 0 (0 = the model's recursion.default)"
               : "";
}

bool parse_id_list(const std::string& s, std::vector<int>* out) {
  out->clear();
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    std::string item = s.substr(pos, comma - pos);
    int v = 0;
    if (!parse_number(item, &v)) return false;
    out->push_back(v);
    pos = comma + 1;
  }
  return !out->empty();
}

bool parse_logit_bias(const std::string& s, std::vector<std::pair<int, float>>* out) {
  out->clear();
  for (size_t pos = 0; pos <= s.size();) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, comma - pos);
    const size_t colon = item.find(':');
    int id = 0;
    float bias = 0;
    if (colon == std::string::npos || !parse_number(item.substr(0, colon), &id) ||
        !parse_number(item.substr(colon + 1), &bias))
      return false;
    out->push_back({id, bias});
    pos = comma + 1;
  }
  return !out->empty();
}

std::string logit_bias_flag(const std::string& s, std::vector<std::pair<int, float>>* out) {
  if (!parse_logit_bias(s, out))
    return "--logit-bias: expected ID:BIAS pairs like 17:-100,42:2.5, got '" + s + "'";
  for (size_t i = 0; i < out->size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if ((*out)[i].first == (*out)[j].first)
        return "--logit-bias gives token " + std::to_string((*out)[i].first) + " more than once";
  for (const auto& [id, bias] : *out)
    if (id < 0)
      return "--logit-bias has the key " + std::to_string(id) + ", not a token id (ids are >= 0)";
  return "";
}

std::string kv_cache_memory_flag(const std::string& text, int64_t* bytes) {
  if (!parse_bytes(text, bytes))
    return "--kv-cache-memory: expected bytes like 4G, 512M or 1048576 (below 8E), got '" + text +
           "'";
  if (*bytes <= 0)
    return "--kv-cache-memory " + text + " holds no KV cache: give its size, like 4G";
  return "";
}

bool parse_bytes(const std::string& s, int64_t* out) {
  size_t digits = 0;
  while (digits < s.size() && std::isdigit(static_cast<unsigned char>(s[digits]))) ++digits;
  if (digits == 0 || digits > 15) return false;
  const int64_t v = std::stoll(s.substr(0, digits));
  std::string unit = s.substr(digits);
  if (!unit.empty() && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();
  if (unit.size() > 1) return false;
  if (unit.empty()) return *out = v, true;
  const size_t k = std::string("KMGT").find(char(std::toupper(static_cast<unsigned char>(unit[0]))));
  if (k == std::string::npos) return false;
  const int shift = int(10 * (k + 1));
  if (v > (INT64_MAX >> shift)) return false;
  *out = v << shift;
  return true;
}

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "error: %s\n", msg.c_str());
  return 2;
}

std::string score_json(const std::vector<int>& tokens, const std::vector<double>& logprobs,
                       double nll, double perplexity, int recursion) {
  nlohmann::json lp = nlohmann::json::array({nullptr});
  for (double x : logprobs) lp.push_back(x);
  return nlohmann::json{{"tokens", tokens},
                        {"logprobs", std::move(lp)},
                        {"nll", nll},
                        {"perplexity", perplexity},
                        {"recursion", recursion}}
      .dump();
}

bool check_out_file(const std::string& flag, const std::string& path, const std::string& example,
                    bool makes_dirs, std::string* error, const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path out(path);
  if (path.empty()) {
    *error = flag + " is empty; name the file to write, like " + example;
    return false;
  }
  // The same file, or the same path once resolved (an input that does not exist yet, such as a
  // checkpoint's tokenizer.model, was written and made the checkpoint one that no longer loads).
  auto same = [&](const std::string& in) {
    if (fs::equivalent(out, in, ec)) return true;
    std::error_code a, b;
    const fs::path x = fs::weakly_canonical(fs::absolute(out), a);
    const fs::path y = fs::weakly_canonical(fs::absolute(in), b);
    return !a && !b && x == y;
  };
  for (const std::string& in : inputs)
    if (same(in)) {
      *error = flag + " '" + path + "' is an input of this command" +
               (in != path ? " ('" + in + "')" : std::string()) +
               ": writing it would lose it; name another file";
      return false;
    }
  if (!out.has_filename() || fs::is_directory(out, ec)) {
    *error = flag + " '" + path + "' is a directory; name the file to write, like " +
             (out / example).lexically_normal().string();
    return false;
  }
  fs::path dir = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  while (makes_dirs && !fs::exists(dir, ec)) {
    if (!dir.has_parent_path() || dir.parent_path() == dir) {  // "a/b.model" with no a/
      dir = ".";
      break;
    }
    dir = dir.parent_path();
  }
  if (!fs::is_directory(dir, ec)) {
    *error = flag + " '" + path + "': '" + dir.string() +
             (fs::exists(dir, ec) ? "' is not a directory" : "' does not exist");
    return false;
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    *error =
        flag + " '" + path + "': cannot write into '" + dir.string() + "': " + std::strerror(errno);
    return false;
  }
  return true;
}

std::string in_flag_terms(std::string msg) {
  static const std::pair<std::string_view, std::string_view> kFlags[] = {
      {"sampling.max_new_tokens", "--max-new-tokens"},
      {"sampling.min_new_tokens", "--min-new-tokens"},
      {"sampling.logit_bias", "--logit-bias"},
      {"sampling.temperature", "--temperature"},
      {"sampling.top_k", "--top-k"},
      {"sampling.top_p", "--top-p"},
      {"sampling.min_p", "--min-p"},
      {"sampling.repetition_penalty", "--repetition-penalty"},
      {"sampling.presence_penalty", "--presence-penalty"},
      {"sampling.frequency_penalty", "--frequency-penalty"},
      {"sampling.top_logprobs", "--top-logprobs"},
      {"sampling.stop_token_ids", "--stop-token-ids"},  // before its prefix "sampling.stop"
      {"sampling.stop", "--stop"},
      {"sampling.seed", "--seed"},
      {"recursion_depth", "--recursion"},
      {"prompt_text", "--prompt"},
      {"prompt_ids", "--prompt-ids"},
      {"request_id", "--request-id"},
      {"cache_salt", "--cache-salt"}};
  for (const auto& [field, flag] : kFlags)
    for (size_t at = msg.find(field); at != std::string::npos; at = msg.find(field, at))
      msg.replace(at, field.size(), flag);
  // Fields whose names are also words ("token ids", "context"): only as the message's subject.
  for (const auto& [field, flag] :
       {std::pair<std::string_view, std::string_view>{"text", "--text"}, {"ids", "--ids"}})
    if (msg.starts_with(field) && msg.size() > field.size() &&
        std::string_view(" :[(").find(msg[field.size()]) != std::string_view::npos)
      msg.replace(0, field.size(), flag);
  return msg;
}

}  // namespace cemlm::cli
