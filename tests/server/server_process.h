// Test harness of the server tests: a tiny random-init checkpoint written with `cemlm init`, a
// real `cemlm serve` process on a free loopback port, its /metrics over plain HTTP, and a parser
// of the Prometheus text format.
#pragma once
#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace cemlm::testing_server {

// A fresh, empty directory for the running test (or suite), removed when it is done with.
std::string fresh_temp_dir();

// Runs `cemlm ARGS...`; returns the exit code, with stdout in *out and stderr in *err when given.
int run_cemlm(const std::vector<std::string>& args, std::string* out = nullptr,
              std::string* err = nullptr);

// `cemlm ARGS...` running in the background (for a test that signals it, or its server).
class CemlmRun {
 public:
  // Its stderr is kept for wait() when `keep_stderr`, else goes where the test's does.
  explicit CemlmRun(const std::vector<std::string>& args, bool keep_stderr = true);
  ~CemlmRun();  // kills it if it was not waited for (a test that failed before)
  CemlmRun(const CemlmRun&) = delete;
  CemlmRun& operator=(const CemlmRun&) = delete;
  pid_t pid() const { return pid_; }  // < 0: it did not start
  // Waits for it to exit; its exit code (-1 when a signal ended it), stdout and stderr.
  int wait(std::string* out = nullptr, std::string* err = nullptr);

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string err_path_;
};

struct TinyModelOptions {
  int max_seq_len = 512;
  int d_model = 32, n_layers = 2, d_ff = 64;
  bool tokenizer = true;  // trained on a Debian fortunes file (vocab 400)
};
// Writes config.json, trains the tokenizer and runs `cemlm init`; returns the checkpoint dir.
// CEM attention (shared diag) + CEM MLP, recursion default 1, max 8; vocab 400.
std::string make_tiny_model(const std::string& dir, const TinyModelOptions& opts = {});

class ServerProcess {
 public:
  // Starts `cemlm serve --model DIR --host 127.0.0.1 --port 0 --metrics-port 0 EXTRA...` (a
  // --host in EXTRA, such as ::1, is where the test then connects) and
  // waits until health reports SERVING. Fails the test (and returns null) when it does not.
  // `creds` are those of channel() (plaintext by default).
  static std::unique_ptr<ServerProcess> start(
      const std::string& model_dir, const std::vector<std::string>& extra = {},
      std::shared_ptr<grpc::ChannelCredentials> creds = nullptr);
  // The same, returning as soon as it listens (it prints its ports before the model loads).
  static std::unique_ptr<ServerProcess> start_listening(
      const std::string& model_dir, const std::vector<std::string>& extra = {},
      std::shared_ptr<grpc::ChannelCredentials> creds = nullptr);
  ~ServerProcess();  // kills the server if it still runs

  std::string addr() const;  // host:port, an IPv6 host in brackets
  int port() const { return port_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  int metrics_port() const { return metrics_port_; }
  pid_t pid() const { return pid_; }
  const std::string& host() const { return host_; }
  std::string metrics_text() const;  // GET /metrics; empty on failure
  std::string log() const;           // what the server wrote on stderr so far

  void signal(int sig) const;
  // The exit code once the process ended, or -1 when it still runs after `timeout`.
  int wait_exit(std::chrono::milliseconds timeout);

 private:
  pid_t pid_ = -1;
  std::string host_ = "127.0.0.1";
  int port_ = 0, metrics_port_ = 0;
  std::string log_path_;
  std::shared_ptr<grpc::Channel> channel_;
};

// Sends `request` over a new TCP connection to host:port (IPv4 or IPv6) and returns everything
// the peer sent back until it closed the connection; empty when it could not connect.
std::string http_exchange(const std::string& host, int port, const std::string& request);

// grpc.health.v1 status name ("SERVING", ...) of `service` ("": the whole server), or "error N"
// with the call's error code.
std::string health(const std::shared_ptr<grpc::Channel>& channel, const std::string& service = "");

// Series of a text exposition: "name{labels}" -> value. Fails the test on a malformed line.
std::map<std::string, double> parse_metrics(const std::string& text);
// Sum of the values of every series called `name` whose labels contain `label_filter`.
double metric(const std::map<std::string, double>& series, const std::string& name,
              const std::string& label_filter = "");

// Polls /metrics until `done(series)` holds (true) or 30 s pass (false).
bool wait_for_metrics(const ServerProcess& server,
                      const std::function<bool(const std::map<std::string, double>&)>& done);

}  // namespace cemlm::testing_server
