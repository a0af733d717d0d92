// Server test harness (see server_process.h). Processes are started with fork and exec (only
// system calls between them: safe in a multi-threaded test), die with the thread that started
// them, and talk to the test through a pipe on stdout and a log file on stderr.
#include "server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/create_channel.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"
#include "temp_dir.h"

extern char** environ;

namespace cemlm::testing_server {
namespace {

using namespace std::chrono_literals;

// Spawns `cemlm args...` with stdout into a pipe (whose read end is returned in *out_fd) and
// stderr appended to `log_path` (or inherited when empty). The child is killed when the thread
// that started it ends (PR_SET_PDEATHSIG): a test that dies (an abort, a crash) leaves no server
// behind. Between fork and exec the child only makes system calls (safe in a threaded process).
pid_t spawn_cemlm(const std::vector<std::string>& args, int* out_fd, const std::string& log_path) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -1;
  std::vector<std::string> all = {CEMLM_BIN};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = _Fork();  // fork without the atfork handlers (gRPC's), as posix_spawn does
  if (pid == 0) {
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(127);
    // As from a terminal: a test run as a background job has SIGINT ignored, which the child
    // would keep (and a test of Ctrl-C waited forever).
    signal(SIGINT, SIG_DFL);
    if (dup2(fds[1], STDOUT_FILENO) < 0) _exit(127);
    if (!log_path.empty()) {
      const int err = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (err < 0 || dup2(err, STDERR_FILENO) < 0) _exit(127);
    }
    execve(CEMLM_BIN, argv.data(), environ);
    _exit(127);
  }
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    return -1;
  }
  *out_fd = fds[0];
  return pid;
}

// One line from `fd`, waiting at most `timeout`; false on EOF or timeout.
bool read_line(int fd, std::string* line, std::chrono::milliseconds timeout) {
  line->clear();
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (char c;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        end - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, int(left.count())) <= 0) return false;
    if (read(fd, &c, 1) != 1) return false;
    if (c == '\n') return true;
    line->push_back(c);
  }
}

}  // namespace

std::string http_exchange(const std::string& host, int port, const std::string& request) {
  const bool v6 = host.find(':') != std::string::npos;
  sockaddr_storage storage{};
  socklen_t len = 0;
  if (v6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&storage);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(uint16_t(port));
    inet_pton(AF_INET6, host.c_str(), &a->sin6_addr);
    len = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&storage);
    a->sin_family = AF_INET;
    a->sin_port = htons(uint16_t(port));
    inet_pton(AF_INET, host.c_str(), &a->sin_addr);
    len = sizeof *a;
  }
  const int s = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
  std::string response;
  if (connect(s, reinterpret_cast<sockaddr*>(&storage), len) == 0 &&
      write(s, request.data(), request.size()) == ssize_t(request.size())) {
    char buf[4096];
    for (ssize_t n; (n = read(s, buf, sizeof buf)) > 0;) response.append(buf, size_t(n));
  }
  close(s);
  return response;
}

namespace {

// GET http://HOST:PORT/PATH (HOST a numeric IPv4 or IPv6 address); the body, or "" on failure.
std::string http_get(const std::string& host, int port, const std::string& path) {
  const std::string response =
      http_exchange(host, port, "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n");
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string fresh_temp_dir() { return testing_temp::fresh_dir("server"); }

CemlmRun::CemlmRun(const std::vector<std::string>& args, bool keep_stderr)
    : err_path_(keep_stderr ? fresh_temp_dir() + "/stderr.txt" : "") {
  pid_ = spawn_cemlm(args, &fd_, err_path_);
}

CemlmRun::~CemlmRun() {
  if (pid_ < 0) return;  // waited for
  kill(pid_, SIGKILL);
  wait();
}

int CemlmRun::wait(std::string* out, std::string* err) {
  if (pid_ < 0) return -1;
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(fd_, buf, sizeof buf)) > 0;) text.append(buf, size_t(n));
  close(fd_);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  if (out) *out = text;
  if (err) *err = err_path_.empty() ? "" : read_file(err_path_);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int run_cemlm(const std::vector<std::string>& args, std::string* out, std::string* err) {
  return CemlmRun(args, err != nullptr).wait(out, err);
}

std::string make_tiny_model(const std::string& dir, const TinyModelOptions& o) {
  const std::string config = dir + "/config.json", tok = dir + "/tok.model", out = dir + "/model";
  std::ofstream(config) << R"({"architecture": "cemlm", "format_version": 1, "vocab_size": 400,
    "d_model": )" << o.d_model
                        << R"(, "n_layers": )" << o.n_layers
                        << R"(, "n_heads": 2, "head_dim": 16, "d_ff": )" << o.d_ff
                        << R"(, "max_seq_len": )" << o.max_seq_len << R"(,
    "embedding": {"type": "table"}, "attention": {"type": "cem", "diag": "shared"},
    "mlp": {"type": "cem"}, "recursion": {"default": 1, "max": 8}})";
  std::vector<std::string> init = {"init", "--config", config, "--out", out, "--seed", "7"};
  if (o.tokenizer) {
    EXPECT_EQ(run_cemlm({"tokenizer", "train", "--input", "/usr/share/games/fortunes/fortunes",
                         "--vocab-size", "400", "--out", tok}),
              0);
    init.insert(init.end(), {"--tokenizer", tok});
  }
  EXPECT_EQ(run_cemlm(init), 0);
  return out;
}

std::unique_ptr<ServerProcess> ServerProcess::start(
    const std::string& model_dir, const std::vector<std::string>& extra,
    std::shared_ptr<grpc::ChannelCredentials> creds) {
  std::unique_ptr<ServerProcess> s = start_listening(model_dir, extra, std::move(creds));
  if (!s) return nullptr;
  for (auto end = std::chrono::steady_clock::now() + 60s; health(s->channel_) != "SERVING";) {
    if (std::chrono::steady_clock::now() > end) {
      ADD_FAILURE() << "cemlm serve never reported SERVING\n" << s->log();
      return nullptr;
    }
    std::this_thread::sleep_for(20ms);
  }
  return s;
}

std::unique_ptr<ServerProcess> ServerProcess::start_listening(
    const std::string& model_dir, const std::vector<std::string>& extra,
    std::shared_ptr<grpc::ChannelCredentials> creds) {
  std::unique_ptr<ServerProcess> s(new ServerProcess());
  s->log_path_ = std::filesystem::path(model_dir).parent_path() / "serve.log";
  std::vector<std::string> args = {
      "serve",          "--model", model_dir,   "--host", "127.0.0.1",         "--port", "0",
      "--metrics-port", "0",       "--threads", "1",      "--kv-cache-memory", "32M"};
  args.insert(args.end(), extra.begin(), extra.end());
  for (size_t i = 0; i + 1 < extra.size(); ++i)
    if (extra[i] == "--host") s->host_ = extra[i + 1];
  int fd = -1;
  s->pid_ = spawn_cemlm(args, &fd, s->log_path_);
  if (s->pid_ < 0) {
    ADD_FAILURE() << "cannot start " << CEMLM_BIN;
    return nullptr;
  }
  std::string line;
  const bool got = read_line(fd, &line, 60s);
  close(fd);
  std::smatch m;
  const std::regex ports(R"(cemlm serve: grpc port (\d+), metrics port (\d+))");
  if (!got || !std::regex_search(line, m, ports)) {
    ADD_FAILURE() << "no port line from cemlm serve; stdout '" << line << "'\n" << s->log();
    return nullptr;
  }
  s->port_ = std::stoi(m[1]);
  s->metrics_port_ = std::stoi(m[2]);
  s->channel_ = grpc::CreateChannel(s->addr(), creds ? creds : grpc::InsecureChannelCredentials());
  return s;
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0 && wait_exit(0ms) < 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

std::string ServerProcess::addr() const {
  const bool v6 = host_.find(':') != std::string::npos;
  return (v6 ? "[" + host_ + "]" : host_) + ":" + std::to_string(port_);
}

std::string ServerProcess::metrics_text() const {
  return http_get(host_, metrics_port_, "/metrics");
}
std::string ServerProcess::log() const { return read_file(log_path_); }
void ServerProcess::signal(int sig) const { kill(pid_, sig); }

int ServerProcess::wait_exit(std::chrono::milliseconds timeout) {
  if (pid_ < 0) return -1;
  const auto end = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (std::chrono::steady_clock::now() >= end) return -1;
    std::this_thread::sleep_for(10ms);
  }
}

std::string health(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 2s);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  const grpc::Status st = grpc::health::v1::Health::NewStub(channel)->Check(&context, req, &resp);
  if (!st.ok()) return "error " + std::to_string(int(st.error_code()));
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
}

std::map<std::string, double> parse_metrics(const std::string& text) {
  static const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})?) (\S+)$)");
  std::map<std::string, double> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::smatch m;
    if (!std::regex_match(line, m, sample)) {
      ADD_FAILURE() << "malformed exposition line: " << line;
      continue;
    }
    out[m[1]] = std::stod(m[3]);
  }
  return out;
}

double metric(const std::map<std::string, double>& series, const std::string& name,
              const std::string& label_filter) {
  double sum = 0;
  for (const auto& [key, value] : series) {
    const size_t brace = key.find('{');
    if (key.substr(0, brace) == name && key.find(label_filter) != std::string::npos) sum += value;
  }
  return sum;
}

bool wait_for_metrics(const ServerProcess& server,
                      const std::function<bool(const std::map<std::string, double>&)>& done) {
  for (auto end = std::chrono::steady_clock::now() + 30s; std::chrono::steady_clock::now() < end;
       std::this_thread::sleep_for(10ms))
    if (done(parse_metrics(server.metrics_text()))) return true;
  return false;
}

}  // namespace cemlm::testing_server
