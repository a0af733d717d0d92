// `cemlm tokenizer`: train a SentencePiece tokenizer on text files (train), and look at what one
// does to a text (encode) or an id list (decode).
#include "cemlm/engine/tokenizer.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "cemlm/cli/commands.h"
#include "cemlm/cli/flags.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/corpus.h"
#include "cemlm/engine/utf8.h"

namespace cemlm::cli {
namespace {

int fail(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  return 1;
}

// The --input paths, and --out too when it is a text file inside an --input directory: the
// corpus holds it, so writing the model over it would lose one of its own texts.
std::vector<std::string> inputs_of(const TokenizerTrainOptions& opts) {
  namespace fs = std::filesystem;
  std::vector<std::string> inputs = opts.inputs, text;
  std::error_code ec;
  std::string ignored;
  if (!fs::is_regular_file(opts.out_path, ec) ||
      !collect_text_files({opts.out_path}, &text, &ignored) || text.empty())
    return inputs;
  const std::string out = fs::weakly_canonical(opts.out_path, ec).string();
  for (const std::string& in : opts.inputs)
    if (fs::is_directory(in, ec) && out.rfind(fs::weakly_canonical(in, ec).string() + "/", 0) == 0)
      inputs.push_back(opts.out_path);
  return inputs;
}

int train(int argc, char** argv) {
  TokenizerTrainOptions opts;
  Flags flags("cemlm tokenizer train --input FILE|DIR... --out FILE [--vocab-size N]",
              "Train a byte-fallback BPE SentencePiece tokenizer (unk 0, bos 1, eos 2, pad 3)\n"
              "on UTF-8 text, one sentence per line; any text then encodes without unk.");
  flags.add_list("input", &opts.inputs,
                 "text files or directories (walked recursively, sorted); .dat/.u8, binary and "
                 "non-UTF-8 files, and directories of a training run's checkpoint or token "
                 "cache, are skipped (such a directory named itself is refused)",
                 true);
  flags.add("out", &opts.out_path,
            "the .model file to write (not one a checkpoint holds: config.json beside it)", true);
  flags.add("vocab-size", &opts.vocab_size,
            "number of pieces: more than the 260 special and byte pieces plus the text's "
            "distinct characters (an error says how many)");
  flags.add_bool("verbose", &opts.verbose, "show SentencePiece's training log");
  flags.add("threads", &opts.threads,
            "training threads (0: OMP_NUM_THREADS where set, else the CPUs this process may use; "
            "more than 128, SentencePiece's bound, train on 128); the model file records the "
            "number, so the same text and threads give the same bytes");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  if (opts.threads < 0)
    return usage_error("--threads must be >= 0 (0: the CPUs this process may use)");
  // Too few for any text: the flag's error, before the other checks.
  if (const std::string error = tokenizer_vocab_too_small("--vocab-size", opts.vocab_size);
      !error.empty())
    return usage_error(error);
  std::string error;
  // A trained checkpoint's tokenizer is what its weights read: a new one in its place fed them
  // other ids (the same number of pieces loaded without a word).
  // Where the write lands: a link to a checkpoint's tokenizer wrote over it.
  if (std::error_code ec;
      std::filesystem::exists(opts.out_path, ec) &&
      std::filesystem::exists(
          std::filesystem::weakly_canonical(opts.out_path, ec).parent_path() / kConfigFile, ec))
    return fail("--out '" + opts.out_path + "' is the tokenizer of the checkpoint beside it (" +
                kConfigFile +
                "): its weights were trained with it, and a new one would feed them other ids; "
                "write the new tokenizer elsewhere");
  if (!opts.out_path.empty() &&  // train_tokenizer says so when it is
      !check_out_file("--out", opts.out_path, "tokenizer.model", /*makes_dirs=*/true, &error,
                      inputs_of(opts)))
    return fail(error);
  TokenizerTrainStats stats;
  if (!train_tokenizer(opts, &error, &stats)) return fail(error);
  std::printf("wrote %s: %d pieces from %d text files (%.2f MB), %zu files skipped\n",
              opts.out_path.c_str(), opts.vocab_size, stats.files, double(stats.bytes) / 1e6,
              stats.skipped.size());
  for (const std::string& dir : stats.run_dirs)
    std::fprintf(stderr, "note: left out '%s': a training run's checkpoint or token cache\n",
                 dir.c_str());
  return 0;
}

int encode(int argc, char** argv) {
  std::string model, text;
  bool pieces = false;
  Flags flags("cemlm tokenizer encode --model FILE --text STR [--pieces]",
              "Print the ids of a text (no BOS/EOS), comma-separated for `decode --ids`.");
  flags.add("model", &model, "the SentencePiece .model file", true);
  flags.add("text", &text, "the UTF-8 text to encode", true);
  flags.add_bool("pieces", &pieces, "print one 'id<TAB>piece' line per token instead");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  if (size_t valid = utf8_valid_prefix(text); valid != text.size())
    return usage_error("--text is not valid UTF-8 (bad byte at offset " + std::to_string(valid) +
                       ")");
  std::string error;
  auto tokenizer = Tokenizer::load(model, &error);
  if (!tokenizer) return fail(error + " (--model)");
  const auto encoded = tokenizer->encode(text, &error);
  if (!encoded) return fail("--text: " + error);
  const std::vector<int>& ids = *encoded;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (pieces)
      std::printf("%d\t%s\n", ids[i], tokenizer->id_to_piece(ids[i]).c_str());
    else
      std::printf("%s%d", i ? "," : "", ids[i]);
  }
  if (!pieces) std::printf("\n");
  return 0;
}

int decode(int argc, char** argv) {
  std::string model, id_text;
  Flags flags("cemlm tokenizer decode --model FILE --ids 1,2,3",
              "Print the text of a comma-separated id list.");
  flags.add("model", &model, "the SentencePiece .model file", true);
  flags.add("ids", &id_text, "comma-separated token ids", true);
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;
  std::vector<int> ids;  // none: an empty line, as `encode --text ""` gives none
  if (!id_text.empty())
    if (const std::string error = id_list_flag("--ids", id_text, &ids); !error.empty())
      return usage_error(error);
  std::string error;
  auto tokenizer = Tokenizer::load(model, &error);
  if (!tokenizer) return fail(error + " (--model)");
  for (int id : ids)
    if (id < 0 || id >= tokenizer->vocab_size())
      return fail("--ids: id " + std::to_string(id) + " is outside the tokenizer's range [0, " +
                  std::to_string(tokenizer->vocab_size()) + ")");
  const std::string text = tokenizer->decode(ids);
  std::fwrite(text.data(), 1, text.size(), stdout);  // byte pieces may decode to a NUL
  std::fputc('\n', stdout);
  return 0;
}

struct Subcommand {
  const char* name;
  const char* summary;
  int (*run)(int, char**);
};

const Subcommand kSubcommands[] = {
    {"train", "train a SentencePiece tokenizer on text files", train},
    {"encode", "print the ids of a text", encode},
    {"decode", "print the text of an id list", decode},
};

void print_help(std::FILE* out) {
  std::fprintf(out, "usage: cemlm tokenizer <subcommand> [options]\n\nsubcommands:\n");
  for (const auto& s : kSubcommands) std::fprintf(out, "  %-8s %s\n", s.name, s.summary);
  std::fprintf(out, "\nRun 'cemlm tokenizer <subcommand> --help' for its options.\n");
}

}  // namespace

int cmd_tokenizer(int argc, char** argv) {
  if (argc < 1) {
    print_help(stderr);
    return 2;
  }
  if (!std::strcmp(argv[0], "--help") || !std::strcmp(argv[0], "-h") ||
      !std::strcmp(argv[0], "help")) {
    print_help(stdout);
    return 0;
  }
  for (const auto& s : kSubcommands)
    if (!std::strcmp(argv[0], s.name)) return s.run(argc - 1, argv + 1);
  std::fprintf(stderr, "error: unknown tokenizer subcommand '%s' (see cemlm tokenizer --help)\n",
               argv[0]);
  return 2;
}

}  // namespace cemlm::cli
