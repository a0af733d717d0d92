// Tiny command-line flag parser shared by every `cemlm` subcommand: typed flags with defaults,
// --help text generated from the declarations, and errors that name the flag; with the value
// parsers and checks the subcommands share.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace cemlm::cli {

class Flags {
 public:
  Flags(std::string usage, std::string summary);

  // Declare flags. `name` without leading dashes. Defaults are the current values of *out.
  void add(const std::string& name, std::string* out, const std::string& help, bool required = false);
  // A string flag whose empty value is refused (an unset variable in "--init $DIR" must not mean
  // the default): "error: --NAME is empty: IF_EMPTY", which says what to give or leave out.
  void add_nonempty(const std::string& name, std::string* out, const std::string& help,
                    const std::string& if_empty, bool required = false);
  void add(const std::string& name, int* out, const std::string& help, bool required = false);
  void add(const std::string& name, int64_t* out, const std::string& help, bool required = false);
  // An integer in [0, 2^64) (a seed): a sign is refused, not wrapped.
  void add(const std::string& name, uint64_t* out, const std::string& help, bool required = false);
  void add(const std::string& name, double* out, const std::string& help, bool required = false);
  void add(const std::string& name, float* out, const std::string& help, bool required = false);
  void add_bool(const std::string& name, bool* out, const std::string& help);
  // Flag taking every following non-flag argument (e.g. --input a.txt b.txt).
  void add_list(const std::string& name, std::vector<std::string>* out, const std::string& help,
                bool required = false);
  // Positional arguments, in order.
  void add_positional(const std::string& name, std::string* out, const std::string& help,
                      bool required = true);

  // Returns -1 to continue, otherwise the exit code to return (0 after --help, 2 on a bad flag).
  int parse(int argc, char** argv);
  bool given(const std::string& name) const;
  std::string help() const;

 private:
  struct Flag {
    std::string name, help, default_text, metavar;
    bool required = false, is_bool = false, is_list = false, given = false;
    std::string expected;  // what a value must be, for the error when one does not parse
    std::string if_empty;  // add_nonempty's advice; empty: an empty value is a value
    std::function<bool(const std::string&)> set;  // false: value does not parse
  };
  Flag& declare(const std::string& name, const std::string& help, bool required);
  std::string usage_, summary_;
  std::vector<Flag> flags_;
  std::vector<Flag> positionals_;
};

// "error: MSG" on stderr; returns 2, the exit code of a usage error, as parse() does: flags that
// parse but do not go together, or a value of the wrong form. (1 is for what the model, the engine
// or the server refuses, and for failures.)
int usage_error(const std::string& msg);

// Parses "3,17,42" into ids; false on anything that is not a comma-separated integer list.
bool parse_id_list(const std::string& s, std::vector<int>* out);
// A flag's token ids ("3,17,42") into `out`: "" when they parse and none is negative (whether
// the model has them is for the model to say), else the usage error's message, naming `flag`.
std::string id_list_flag(const std::string& flag, const std::string& text, std::vector<int>* out);
// --recursion's usage error when T is negative (past the model's max is for the model to say),
// else "".
std::string recursion_flag_error(int T);
// Parses "17:-100,42:2.5" (token id:bias pairs) into out; false on anything else.
bool parse_logit_bias(const std::string& s, std::vector<std::pair<int, float>>* out);
// --logit-bias's value into `out`: "" when it parses, else the usage error's message (a malformed
// list, or a token given twice, whose second bias the request's map would drop unsaid).
std::string logit_bias_flag(const std::string& s, std::vector<std::pair<int, float>>* out);
// Parses an integer in [0, 2^64) (a seed); false on anything else, a sign included.
bool parse_uint64(const std::string& s, uint64_t* out);
// Parses a byte count: "4G", "512M", "64K", "64KB" or plain bytes (powers of 1024); false on
// anything else, a value past int64 included (--kv-cache-memory).
bool parse_bytes(const std::string& s, int64_t* out);
// --kv-cache-memory's value into `bytes`: "" when it parses and is above 0, else the usage
// error's message.
std::string kv_cache_memory_flag(const std::string& text, int64_t* bytes);

// Whether `path` can take the file a command writes at its end, checked before the (long) work
// without touching the disk: not a directory, and its directory writable, or where the write
// creates missing directories (`makes_dirs`), its nearest existing ancestor, and not one of the
// files in `inputs` (the command's own inputs: writing over one loses it). The error names
// `flag`, and for a directory given, suggests `example` (a file name) inside it.
bool check_out_file(const std::string& flag, const std::string& path, const std::string& example,
                    bool makes_dirs, std::string* error,
                    const std::vector<std::string>& inputs = {});

// The JSON line `cemlm score` and `cemlm client score --json` print, one shape for both:
// {"tokens", "logprobs", "nll", "perplexity", "recursion"}, where logprobs[i] is the logprob of
// tokens[i] given its prefix, null for the first token (it has none). `logprobs` has one fewer
// entry than `tokens` (no null).
std::string score_json(const std::vector<int>& tokens, const std::vector<double>& logprobs,
                       double nll, double perplexity, int recursion);

// A request error in the terms of the generate/score/client flags: the engine and the server name
// request fields ("sampling.top_p", "prompt_ids", "recursion_depth"), a command's user gave flags.
std::string in_flag_terms(std::string msg);

}  // namespace cemlm::cli
