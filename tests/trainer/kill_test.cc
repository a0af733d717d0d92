// Kills `cemlm train` (SIGKILL) at arbitrary moments of a run that saves every step: each time,
// the checkpoint directory must still load and the run must resume; at the end no temporary
// directory may be left. The binary's path comes from CMake (CEMLM_BINARY).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/corpus.h"
#include "trainer_test_util.h"

extern char** environ;

namespace cemlm {
namespace {

namespace fs = std::filesystem;

// Runs args with stdout and stderr into `log` (appended).
pid_t spawn_quietly(std::vector<std::string> args, const std::string& log = "/dev/null") {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

TEST(TrainKill, KilledAtAnyMomentTheCheckpointLoadsAndResumes) {
  const std::string dir = testing_trainer::fresh_dir();
  TrainOptions o = testing_trainer::tiny_options(dir);
  const std::vector<std::string> args = {CEMLM_BINARY,   "train",   "--config",     o.config_path,
                                         "--data",       o.data[0], "--out",        o.out_dir,
                                         "--steps",      "100000",  "--save-every", "1",
                                         "--eval-every", "100000",  "--batch-size", "2",
                                         "--seq-len",    "16",      "--threads",    "1"};
  int64_t last_step = 0;
  for (int delay_ms : {0, 37, 151, 290, 433}) {
    auto run_args = args;
    if (last_step > 0) run_args.push_back("--resume");
    const pid_t pid = spawn_quietly(run_args);
    ASSERT_GT(pid, 0);
    // Wait for the first save of this invocation, then let it run a while and kill it.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      auto saved = load_run_options(o.out_dir);
      std::string state, error;
      if (saved.ok() && read_file(o.out_dir + "/" + kTrainerStateFile, &state, &error) &&
          state.find("\"step\": " + std::to_string(last_step) + ",") == std::string::npos)
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    auto ck = load_checkpoint(o.out_dir);
    ASSERT_TRUE(ck.ok()) << "after a kill " << delay_ms << " ms in: " << ck.status();
    auto saved = load_run_options(o.out_dir);
    ASSERT_TRUE(saved.ok()) << saved.status();
    std::string state, error;
    ASSERT_TRUE(read_file(o.out_dir + "/" + kTrainerStateFile, &state, &error));
    const size_t at = state.find("\"step\": ");
    ASSERT_NE(at, std::string::npos);
    const int64_t step = std::stoll(state.substr(at + 8));
    EXPECT_GT(step, last_step);
    last_step = step;
  }
  // Finish in-process: the resumed run completes and cleans up any interrupted save.
  auto saved = load_run_options(o.out_dir);
  ASSERT_TRUE(saved.ok());
  saved->resume = true;
  saved->steps = last_step + 2;
  auto done = train(*saved);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(done->finished);
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

int64_t saved_step(const std::string& out_dir) {
  std::string state, error;
  if (!read_file(out_dir + "/" + kTrainerStateFile, &state, &error)) return -1;
  const size_t at = state.find("\"step\": ");
  return at == std::string::npos ? -1 : std::stoll(state.substr(at + 8));
}

// SIGTERM (docker stop), then SIGINT (Ctrl-C) and SIGHUP (the terminal closed) on the resumed
// runs: each run finishes its step, saves although no periodic save is due, and exits with 128 +
// the signal's number (so that `cemlm train … && cemlm serve …` stops); the next run resumes from
// the step it saved. SIGHUP comes twice, as from a closed terminal (bash forwards one, the kernel
// sends another): the second killed the run before it saved.
TEST(TrainKill, SigtermAndSigintSaveThenExitWithTheSignalsStatus) {
  const std::string dir = testing_trainer::fresh_dir();
  TrainOptions o = testing_trainer::tiny_options(dir);
  const std::string log = dir + "/train.log";
  const std::vector<std::string> args = {
      CEMLM_BINARY, "train",        "--config",     o.config_path, "--data",       o.data[0],
      "--out",      o.out_dir,      "--steps",      "100000",      "--save-every", "100000",
      "--eval-every", "100000",     "--batch-size", "2",           "--seq-len",    "16",
      "--threads",  "1",            "--log-every",  "1"};
  int64_t last_step = 0;
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    auto run_args = args;
    if (last_step > 0) run_args.push_back("--resume");
    const size_t log_before = fs::exists(log) ? fs::file_size(log) : 0;
    const pid_t pid = spawn_quietly(run_args, log);
    ASSERT_GT(pid, 0);
    // Signal once this run has logged a few steps of its own.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::string text, error;
    while (std::chrono::steady_clock::now() < deadline) {
      if (read_file(log, &text, &error) && text.size() > log_before) {
        const std::string mine = text.substr(log_before);
        size_t steps = 0;
        for (size_t at = mine.find("\nstep "); at != std::string::npos;
             at = mine.find("\nstep ", at + 1))
          ++steps;
        if (steps >= 3) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_EQ(::kill(pid, sig), 0);
    if (sig == SIGHUP) {
      // Once the first is handled (its note logged), as the kernel's comes after bash's.
      while (std::chrono::steady_clock::now() < deadline &&
             (!read_file(log, &text, &error) ||
              text.find("stopping: saving", log_before) == std::string::npos))
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ASSERT_EQ(::kill(pid, SIGHUP), 0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status) << " instead of saving";
    EXPECT_EQ(WEXITSTATUS(status), 128 + sig);
    ASSERT_TRUE(read_file(log, &text, &error));
    EXPECT_NE(text.find("interrupted: saving at step", log_before), std::string::npos) << text;
    ASSERT_TRUE(load_checkpoint(o.out_dir).ok());
    const int64_t step = saved_step(o.out_dir);
    EXPECT_GT(step, last_step + 2) << text;  // saved where it stopped, not at a periodic save
    last_step = step;
  }
}

// A run started with SIGHUP and SIGINT ignored (`nohup cemlm train … &` from a script) is not
// stopped by them: it went on past both here, and SIGTERM then stopped it. Its handlers
// replaced the ignored dispositions, and closing the terminal stopped a nohup'ed run.
TEST(TrainKill, SignalsIgnoredAtTheStartStayIgnored) {
  const std::string dir = testing_trainer::fresh_dir();
  TrainOptions o = testing_trainer::tiny_options(dir);
  const std::string log = dir + "/train.log";
  const std::vector<std::string> args = {CEMLM_BINARY,   "train",   "--config",     o.config_path,
                                         "--data",       o.data[0], "--out",        o.out_dir,
                                         "--steps",      "100000",  "--save-every", "100000",
                                         "--eval-every", "100000",  "--batch-size", "2",
                                         "--seq-len",    "16",      "--threads",    "1",
                                         "--log-every",  "1"};
  // Inherited through exec, as nohup and a non-interactive shell's `&` leave them.
  struct sigaction ignore {
  }, was_hup{}, was_int{};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGHUP, &ignore, &was_hup), 0);
  ASSERT_EQ(::sigaction(SIGINT, &ignore, &was_int), 0);
  const pid_t pid = spawn_quietly(args, log);
  ::sigaction(SIGHUP, &was_hup, nullptr);
  ::sigaction(SIGINT, &was_int, nullptr);
  ASSERT_GT(pid, 0);
  // Waits for `n` more step lines than the log has at the call; false after 60 s.
  auto steps_in_log = [&] {
    std::string text, error;
    size_t steps = 0;
    if (read_file(log, &text, &error))
      for (size_t at = text.find("\nstep "); at != std::string::npos;
           at = text.find("\nstep ", at + 1))
        ++steps;
    return steps;
  };
  auto wait_steps = [&](size_t n) {
    const size_t want = steps_in_log() + n;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      if (steps_in_log() >= want) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  };
  EXPECT_TRUE(wait_steps(3));
  ASSERT_EQ(::kill(pid, SIGHUP), 0);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  EXPECT_TRUE(wait_steps(3)) << "the run stopped at an ignored signal";
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  EXPECT_TRUE(load_checkpoint(o.out_dir).ok());
}

// Output piped to a reader that Ctrl-C ended too (`cemlm train … | tee log`): the run still
// saves and exits 130. Its next progress line killed it with SIGPIPE, before the save.
TEST(TrainKill, SigintWithTheOutputsReaderGoneStillSaves) {
  const std::string dir = testing_trainer::fresh_dir();
  TrainOptions o = testing_trainer::tiny_options(dir);
  std::vector<std::string> args = {CEMLM_BINARY,   "train",   "--config",     o.config_path,
                                   "--data",       o.data[0], "--out",        o.out_dir,
                                   "--steps",      "100000",  "--save-every", "100000",
                                   "--eval-every", "100000",  "--batch-size", "2",
                                   "--seq-len",    "16",      "--threads",    "1",
                                   "--log-every",  "1"};
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  pid_t pid = -1;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  // Read until the run has logged a few steps, then close the pipe as the reader's death would.
  std::string text;
  char buf[4096];
  size_t steps = 0;
  while (steps < 3) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    ASSERT_GT(n, 0) << text;
    text.append(buf, size_t(n));
    steps = 0;
    for (size_t at = text.find("\nstep "); at != std::string::npos;
         at = text.find("\nstep ", at + 1))
      ++steps;
  }
  ::close(fds[0]);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status) << " instead of saving";
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGINT);
  ASSERT_TRUE(load_checkpoint(o.out_dir).ok());
  EXPECT_GE(saved_step(o.out_dir), 3);
}

// SIGINT while the tokenizer trains: the run stops once that part is done, before any step, with
// nothing saved, and says so instead of promising a save. The corpus is large enough (about
// 1.5 s of tokenizer training and encoding here) that a test thread a loaded machine holds back
// still signals before the first step; 40 KB left a window of 100-150 ms.
TEST(TrainKill, SigintDuringSetupStopsBeforeTrainingAndSavesNothing) {
  const std::string dir = testing_trainer::fresh_dir();
  TrainOptions o = testing_trainer::tiny_options(dir);
  testing_trainer::write_file(dir + "/text/c.txt", testing_trainer::corpus_text(400000, 3));
  const std::string log = dir + "/train.log";
  const pid_t pid = spawn_quietly(
      {CEMLM_BINARY, "train", "--config", o.config_path, "--data", o.data[0], "--out", o.out_dir,
       "--steps", "5", "--batch-size", "2", "--seq-len", "16", "--threads", "1"},
      log);
  ASSERT_GT(pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::string text, error;
  while (std::chrono::steady_clock::now() < deadline &&
         !(read_file(log, &text, &error) && text.find("tokenizer: training") != std::string::npos))
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(read_file(log, &text, &error));
  ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status) << ": " << text;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGINT) << text;
  EXPECT_NE(text.find("stopped before the first step: nothing trained, nothing saved"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("saving after the current step"), std::string::npos) << text;
  EXPECT_EQ(text.find("\nstep "), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(o.out_dir + "/config.json"));
}

// A new run checks again, once it holds the lock, that --out holds no checkpoint: one that a run
// on the same --out left while this one listed its data (seconds on a large corpus) was replaced
// by this run's first save. The run is stopped (SIGSTOP) while it reads its data files, before
// its lock file exists; a finished run's checkpoint then appears in --out; it is let go.
TEST(TrainKill, ACheckpointThatAppearsBeforeTheLockIsNotReplaced) {
  const std::string dir = testing_trainer::fresh_dir();
  TrainOptions o = testing_trainer::tiny_options(dir);
  for (int i = 0; i < 4000; ++i)  // read one by one (UTF-8 checked) before the lock
    testing_trainer::write_file(dir + "/many/" + std::to_string(i) + ".txt",
                                testing_trainer::corpus_text(2, uint64_t(i)));
  TrainOptions first = o;
  first.out_dir = dir + "/first";
  first.steps = 1;
  ASSERT_TRUE(train(first).ok());
  bool caught = false;
  for (int attempt = 0; attempt < 5 && !caught; ++attempt) {
    const std::string out = dir + "/run" + std::to_string(attempt);
    const std::string lock = dir + "/.run" + std::to_string(attempt) + ".lock";
    const std::string log = dir + "/train" + std::to_string(attempt) + ".log";
    const pid_t pid = spawn_quietly(
        {CEMLM_BINARY, "train", "--config", o.config_path, "--data", dir + "/many", "--out", out,
         "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--threads", "1"},
        log);
    ASSERT_GT(pid, 0);
    // A data file open, the lock not yet taken.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    const std::string fds = "/proc/" + std::to_string(pid) + "/fd";
    while (!caught && std::chrono::steady_clock::now() < deadline && !fs::exists(lock)) {
      std::error_code ec;
      for (const auto& fd : fs::directory_iterator(fds, ec))
        if (fs::read_symlink(fd.path(), ec).string().find("/many/") != std::string::npos) {
          ASSERT_EQ(::kill(pid, SIGSTOP), 0);
          caught = !fs::exists(lock);  // else it went on meanwhile: another attempt
          break;
        }
    }
    if (caught) {
      fs::copy(first.out_dir, out, fs::copy_options::recursive);
      ASSERT_EQ(::kill(pid, SIGCONT), 0);
    } else {
      ::kill(pid, SIGKILL);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    if (!caught) continue;
    std::string text, error;
    ASSERT_TRUE(read_file(log, &text, &error));
    ASSERT_TRUE(WIFEXITED(status)) << text;
    EXPECT_NE(WEXITSTATUS(status), 0) << text;
    EXPECT_NE(text.find("already holds a checkpoint"), std::string::npos) << text;
    EXPECT_EQ(saved_step(out), 1) << "the first run's checkpoint was replaced";
  }
  EXPECT_TRUE(caught) << "never stopped the run while it listed its data";
}

}  // namespace
}  // namespace cemlm
