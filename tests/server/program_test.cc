// The `cemlm` program as a whole, beyond one subcommand: what its dispatcher does with a command
// that runs out of memory, and with no command at all.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "cemlm/engine/cpu_threads.h"
#include "server_process.h"

namespace cemlm::testing_server {
namespace {

// A config of ~10^15 bytes of parameters: no machine holds it. The command ends with a message and exit
// code 1, not std::bad_alloc's abort (exit 134).
TEST(CemlmProgram, OutOfMemoryIsAnErrorNotAnAbort) {
  const std::string dir = fresh_temp_dir();
  std::ofstream(dir + "/huge.json") << R"({"architecture": "cemlm", "format_version": 1,
    "vocab_size": 16777216, "d_model": 65536, "n_layers": 1, "n_heads": 1, "head_dim": 2,
    "d_ff": 2, "embedding": {"type": "table"}, "attention": {"type": "standard"},
    "mlp": {"type": "swiglu"}})";
  const int status = std::system(("'" CEMLM_BIN "' init --config '" + dir + "/huge.json' --out '" +
                                  dir + "/ck' 2>'" + dir + "/err.txt'")
                                     .c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  std::ifstream in(dir + "/err.txt");
  const std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(err.find("cemlm init: out of memory"), std::string::npos) << err;
}

// RoPE's rotations are made each step for the batch's positions, not held as a table of every
// position: an 80 KB checkpoint claiming 65,000 positions of head_dim 4096 made each engine fill
// a 1 GiB table at load (seconds), outside --kv-cache-memory. Under a 1.2 GB address-space limit
// it loads and generates (~0.8 GB with its 266 MB int8 cache; the table took it past 1.5 GB).
// OMP_NUM_THREADS=1: OpenBLAS reserves a 128 MiB buffer per OpenMP thread as it loads, before
// --threads applies (16 CPUs took it past the limit, where it retries its mmap for good).
TEST(CemlmProgram, NoRopeTableOfEveryPosition) {
  const std::string dir = fresh_temp_dir();
  std::ofstream(dir + "/long.json") << R"({"architecture": "cemlm", "format_version": 1,
    "vocab_size": 300, "d_model": 2, "n_layers": 1, "n_heads": 1, "head_dim": 4096, "d_ff": 2,
    "max_seq_len": 65000, "embedding": {"type": "table"}, "attention": {"type": "cem"},
    "mlp": {"type": "cem"}})";
  ASSERT_EQ(std::system(("'" CEMLM_BIN "' init --config '" + dir + "/long.json' --out '" + dir +
                         "/ck' > /dev/null")
                            .c_str()),
            0);
  const int status =
      std::system(("ulimit -v 1200000 && OMP_NUM_THREADS=1 timeout 120 '" CEMLM_BIN "' generate --model '" + dir +
                   "/ck' --prompt-ids 1,2 --max-new-tokens 2 --threads 1 --kv-cache-dtype int8 "
                   "--kv-cache-memory 300M --json > '" +
                   dir + "/out.json' 2>'" + dir + "/err.txt'")
                      .c_str());
  std::ifstream in(dir + "/err.txt"), out(dir + "/out.json");
  const std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string json((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << ": " << err;
  EXPECT_NE(json.find("\"finish_reason\":\"length\""), std::string::npos) << json;
  // A KV cache past the limit: the load runs out of memory, and says with how many bytes.
  const int oom = std::system(
      ("ulimit -v 1200000 && OMP_NUM_THREADS=1 timeout 120 '" CEMLM_BIN "' generate --model '" + dir +
       "/ck' --prompt-ids 1,2 --max-new-tokens 2 --threads 1 --kv-cache-memory 4G --json "
       "2>'" +
       dir + "/oom.txt'")
          .c_str());
  std::ifstream oom_in(dir + "/oom.txt");
  const std::string oom_err((std::istreambuf_iterator<char>(oom_in)),
                            std::istreambuf_iterator<char>());
  EXPECT_TRUE(WIFEXITED(oom) && WEXITSTATUS(oom) == 1) << oom << ": " << oom_err;
  for (const char* part : {"out of memory loading the model: its ", " parameters take ",
                           " KiB as loaded (4 bytes each, whatever --device keeps after), the KV "
                           "cache up to 4096 MiB (--kv-cache-memory), and ",
                           " MiB was available when it began"})
    EXPECT_NE(oom_err.find(part), std::string::npos) << part << "\n" << oom_err;
}

// A training step past the memory the process may take (here a 1.5 GB address-space limit, under
// the machine's memory, so that the check before training lets it through) ends the run with a
// message naming the batch flags, exit 1.
TEST(CemlmProgram, TrainingStepOutOfMemoryNamesTheBatch) {
  // The step's activations, ~2 GB by the estimate, must fit in the machine's memory left (else
  // the check before training refuses them first, with its own words).
  if (const int64_t left = available_memory_bytes(); left >= 0 && left < (int64_t(4) << 30))
    GTEST_SKIP() << "needs 4 GiB of memory left; " << (left >> 20) << " MiB are";
  const std::string dir = fresh_temp_dir();
  std::ofstream(dir + "/tiny.json") << R"({"architecture": "cemlm", "format_version": 1,
    "vocab_size": 300, "d_model": 32, "n_layers": 2, "n_heads": 2, "head_dim": 16, "d_ff": 64,
    "max_seq_len": 64, "embedding": {"type": "table"}, "attention": {"type": "cem"},
    "mlp": {"type": "cem"}})";
  {
    std::ofstream text(dir + "/corpus.txt");
    for (int i = 0; i < 4000; ++i) text << "the cat " << i % 97 << " sat on mat " << i % 13 << "\n";
  }
  const int status = std::system(
      ("ulimit -v 1500000 && OMP_NUM_THREADS=1 timeout 300 '" CEMLM_BIN "' train --config '" + dir +
       "/tiny.json' --data '" + dir + "/corpus.txt' --out '" + dir +
       "/run' --steps 1 --batch-size 8000 --seq-len 32 --threads 1 > /dev/null 2>'" + dir +
       "/err.txt'")
          .c_str());
  std::ifstream in(dir + "/err.txt");
  const std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(WIFEXITED(status)) << status << ": " << err;
  EXPECT_EQ(WEXITSTATUS(status), 1) << err;
  EXPECT_NE(err.find("error: out of memory at training step 1: the activations of --batch-size "
                     "8000 × --seq-len 32 at T up to 2 do not fit in the memory left ("),
            std::string::npos)
      << err;
}

// Output that cannot be written (a full disk: /dev/full) fails the command: `cemlm score … >
// out.json` on a full disk exited 0 with an empty file.
TEST(CemlmProgram, OutputThatCannotBeWrittenIsAnError) {
  const std::string dir = fresh_temp_dir();
  for (const std::string args : {"help", "tokenizer decode --help"}) {
    const int status =
        std::system(("'" CEMLM_BIN "' " + args + " >/dev/full 2>'" + dir + "/err.txt'").c_str());
    ASSERT_TRUE(WIFEXITED(status)) << args;
    EXPECT_EQ(WEXITSTATUS(status), 1) << args;
    std::ifstream in(dir + "/err.txt");
    const std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(err.find("cannot write the output: No space left on device"), std::string::npos)
        << args << ": " << err;
  }
}

// The error that ends `serve` reaches its output at every --log-level: at critical or off it was
// not logged, and a misconfigured pod crash-looped with empty logs.
TEST(CemlmProgram, ServeSaysWhyItEndsAtEveryLogLevel) {
  const std::string missing = fresh_temp_dir() + "/no-model";
  for (const char* level : {"info", "critical", "off"}) {
    std::string out, err;
    EXPECT_EQ(run_cemlm({"serve", "--model", missing, "--port", "0", "--metrics-port", "0",
                         "--log-level", level},
                        &out, &err),
              1)
        << level;
    EXPECT_NE((out + err).find(missing), std::string::npos) << level << ": " << out << err;
  }
}

// Without a command the list goes to stderr with exit 2, as every usage error's message does (it
// went to stdout, into whatever a script piped on); asked for, to stdout with exit 0.
// OMP_NUM_THREADS past the system's thread limit: OpenMP's thread creation failed and ended the
// process ("Thread creation failed"), as --threads 100000 did before it was bounded. The default
// is held to the same bound. (This process's own OpenMP read the variable at start: only the
// child sees it.)
TEST(CemlmProgram, AHugeOmpNumThreadsIsHeldToTheBound) {
  const std::string model = make_tiny_model(fresh_temp_dir(), {.tokenizer = false});
  ASSERT_EQ(setenv("OMP_NUM_THREADS", "100000", 1), 0);
  std::string out, err;
  const int rc = run_cemlm({"generate", "--model", model, "--prompt-ids", "5,6", "--max-new-tokens",
                            "2", "--ignore-eos", "--json"},
                           &out, &err);
  unsetenv("OMP_NUM_THREADS");
  ASSERT_EQ(rc, 0) << err;
  EXPECT_NE(out.find("\"ids\":["), std::string::npos) << out;
}

TEST(CemlmProgram, CommandListIsAnErrorOnlyWhenNoCommandIsGiven) {
  std::string out, err;
  EXPECT_EQ(run_cemlm({}, &out, &err), 2);
  EXPECT_EQ(out, "");
  EXPECT_NE(err.find("usage: cemlm <command>"), std::string::npos) << err;
  for (const char* help : {"help", "--help", "-h"}) {
    EXPECT_EQ(run_cemlm({help}, &out, &err), 0) << help;
    EXPECT_NE(out.find("usage: cemlm <command>"), std::string::npos) << help << ": " << out;
    EXPECT_EQ(err, "") << help;
  }
  EXPECT_EQ(run_cemlm({"no-such-command"}, &out, &err), 2);
  EXPECT_EQ(out, "");
  EXPECT_NE(err.find("unknown command 'no-such-command'"), std::string::npos) << err;
  // help COMMAND is COMMAND --help; an unknown one is an error.
  EXPECT_EQ(run_cemlm({"help", "generate"}, &out, &err), 0);
  EXPECT_NE(out.find("usage: cemlm generate"), std::string::npos) << out;
  EXPECT_EQ(run_cemlm({"help", "bogus"}, &out, &err), 2);
  EXPECT_NE(err.find("unknown command 'bogus'"), std::string::npos) << err;
}

// The client refuses an address that is not HOST:PORT, an API key that a header cannot carry (a
// key with its file's line end made gRPC abort the process) and prompt flags that do not go
// together before it connects, exit 2.
TEST(CemlmProgram, ClientAddressesAndKeysAreCheckedBeforeAnyCall) {
  std::string out, err;
  for (const char* addr :
       {"127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:abc", "127.0.0.1", "", "::1:5", "[]:5"}) {
    EXPECT_EQ(run_cemlm({"client", "health", "--addr", addr}, &out, &err), 2) << addr;
    EXPECT_NE(err.find("--addr '" + std::string(addr) + "' is not HOST:PORT"), std::string::npos)
        << err;
  }
  EXPECT_EQ(
      run_cemlm({"client", "info", "--addr", "127.0.0.1:1", "--api-key", "key\n"}, &out, &err), 2);
  EXPECT_NE(err.find("--api-key holds a byte 0x0a"), std::string::npos) << err;
  // A space is a byte the server's key file takes: sent (the call then fails to connect, exit 1).
  EXPECT_EQ(run_cemlm({"client", "health", "--addr", "127.0.0.1:1", "--api-key", "a key",
                       "--timeout", "2"},
                      &out, &err),
            1)
      << err;
  setenv("CEMLM_API_KEY", "key\r", 1);
  const int rc = run_cemlm({"client", "health", "--addr", "127.0.0.1:1"}, &out, &err);
  unsetenv("CEMLM_API_KEY");
  EXPECT_EQ(rc, 2) << err;
  EXPECT_NE(err.find("CEMLM_API_KEY holds a byte 0x0d"), std::string::npos) << err;
  // The prompt flags are checked here too, as `cemlm generate` checks them (they went to the
  // server and came back INVALID_ARGUMENT, exit 1).
  for (const auto& prompt :
       std::vector<std::vector<std::string>>{{},
                                             {"--prompt", "x", "--prompt-ids", "1"},
                                             {"--prompt", "", "--no-bos"},
                                             {"--prompt-ids", ""}}) {
    std::vector<std::string> args = {"client", "generate", "--addr", "127.0.0.1:1"};
    args.insert(args.end(), prompt.begin(), prompt.end());
    EXPECT_EQ(run_cemlm(args, &out, &err), 2) << err;
    EXPECT_NE(err.find("--prompt"), std::string::npos) << err;
  }
  // And score's input flags (an empty --ids sent no input, both went to the server).
  for (const auto& input : std::vector<std::vector<std::string>>{
           {}, {"--text", "x", "--ids", "1"}, {"--text", ""}, {"--ids", ""}}) {
    std::vector<std::string> args = {"client", "score", "--addr", "127.0.0.1:1"};
    args.insert(args.end(), input.begin(), input.end());
    EXPECT_EQ(run_cemlm(args, &out, &err), 2) << err;
    EXPECT_TRUE(err.find("--text") != std::string::npos || err.find("--ids") != std::string::npos)
        << err;
  }
  // `cemlm client help` is its --help, as `cemlm help` is cemlm's.
  EXPECT_EQ(run_cemlm({"client", "help"}, &out, &err), 0) << err;
  EXPECT_NE(out.find("usage: cemlm client <generate|score"), std::string::npos) << out;
}

// `cemlm client health` has a deadline of its own (5 s) unless --timeout says otherwise: against a
// port that takes the connection and never answers it waited until it was killed, and so did
// the probes and start-up loops built on it.
TEST(CemlmProgram, ClientHealthDoesNotWaitForever) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(fd, 8), 0);  // the kernel completes connections; nothing ever answers
  socklen_t len = sizeof a;
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  std::string out, err;
  const int rc = run_cemlm(
      {"client", "health", "--addr", "127.0.0.1:" + std::to_string(ntohs(a.sin_port))}, &out, &err);
  close(fd);
  EXPECT_EQ(rc, 1) << err;
  EXPECT_NE(err.find("DEADLINE_EXCEEDED"), std::string::npos) << err;
}

}  // namespace
}  // namespace cemlm::testing_server
