// `cemlm`: one program, many subcommands. This file only dispatches; see commands.h.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "cemlm/cli/commands.h"
#include "cemlm/kernels/blas_select.h"

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int, char**);
};

const Command kCommands[] = {
    {"init", "write a randomly initialised checkpoint for a config", cemlm::cli::cmd_init},
    {"score", "log-probabilities and perplexity of a text or id sequence", cemlm::cli::cmd_score},
    {"inspect", "parameter counts and KV-cache size of a checkpoint", cemlm::cli::cmd_inspect},
    {"tokenizer", "train a SentencePiece tokenizer; encode and decode with one",
     cemlm::cli::cmd_tokenizer},
    {"generate", "generate a continuation through the inference engine", cemlm::cli::cmd_generate},
    {"train", "train a model on text files (checkpoints, resume, evaluation at several T)",
     cemlm::cli::cmd_train},
    {"grads", "loss and its gradient w.r.t. every parameter, as safetensors", cemlm::cli::cmd_grads},
    {"serve", "serve a model over gRPC with Prometheus metrics", cemlm::cli::cmd_serve},
    {"client", "talk to a running server (generate, score, tokenize, detokenize, info, health)",
     cemlm::cli::cmd_client},
    {"bench-serve", "closed-loop load test of a running server", cemlm::cli::cmd_bench_serve},
};

// To stdout when asked for, to stderr as the usage error of a missing command.
void print_help(std::FILE* to) {
  std::fprintf(to,
               "usage: cemlm <command> [options]\n\nCEM/Leviathan language models: train, serve, "
               "score.\n\ncommands:\n");
  for (const auto& c : kCommands) std::fprintf(to, "  %-12s %s\n", c.name, c.summary);
  std::fprintf(to, "  %-12s %s\n", "help", "show this list (help COMMAND: that command's options)");
  std::fprintf(to, "\nRun 'cemlm <command> --help' for the options of a command.\n");
}

// rc, or 1 where stdout could not be written: output lost to a full disk or a closed pipe
// (`cemlm score … > out.json`) must not read as success.
int output_written(const char* command, int rc) {
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return rc;
  std::fprintf(stderr, "cemlm %s: cannot write the output: %s\n", command,
               std::strerror(errno ? errno : EIO));
  return rc != 0 ? rc : 1;
}

}  // namespace

int main(int argc, char** argv) {
  cemlm::reexec_with_runtime_env(argv);
  // `cemlm help COMMAND` is `cemlm COMMAND --help`.
  char help_flag[] = "--help";
  if (argc == 3 && !std::strcmp(argv[1], "help") && std::strcmp(argv[2], "help") != 0) {
    for (const auto& c : kCommands)
      if (!std::strcmp(argv[2], c.name)) {
        char* args[] = {help_flag, nullptr};
        return output_written(c.name, c.run(1, args));
      }
    std::fprintf(stderr, "cemlm: unknown command '%s' (run 'cemlm help')\n", argv[2]);
    return 2;
  }
  if (argc < 2 || !std::strcmp(argv[1], "help") || !std::strcmp(argv[1], "--help") ||
      !std::strcmp(argv[1], "-h")) {
    print_help(argc < 2 ? stderr : stdout);
    return output_written("help", argc < 2 ? 2 : 0);
  }
  for (const auto& c : kCommands)
    if (!std::strcmp(argv[1], c.name)) {
      try {
        return output_written(c.name, c.run(argc - 2, argv + 2));
      } catch (const std::bad_alloc&) {  // a config or batch beyond this machine's memory
        std::fprintf(stderr,
                     "cemlm %s: out of memory: the model or the batch does not fit in this "
                     "machine's memory; use a smaller config (cemlm inspect shows its size) or "
                     "smaller batch flags\n",
                     c.name);
        return 1;
      }
    }
  std::fprintf(stderr, "cemlm: unknown command '%s' (run 'cemlm help')\n", argv[1]);
  return 2;
}
