// `cemlm serve`: loads a checkpoint into the engine and serves it over gRPC, with /metrics on a
// second port. Lifecycle: listen (NOT_SERVING) -> load + warm up -> SERVING -> SIGTERM/SIGINT ->
// NOT_SERVING, GOAWAY, drain up to --shutdown-timeout -> cancel the rest -> exit 0 (a signal
// while loading: exit 0 at once).
#include <google/protobuf/stubs/logging.h>
#include <grpc/support/log.h>
#include <netdb.h>
#include <prometheus/text_serializer.h>
#include <pthread.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "api_key_file.h"
#include "cemlm/cli/commands.h"
#include "cemlm/cli/flags.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/float32.h"
#include "cemlm/engine/model_runner.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/utf8.h"
#include "cemlm/kernels/blas_select.h"
#include "cemlm/server/inference_server.h"
#include "cemlm/server/metrics_http.h"
#include "tls_files.h"

namespace cemlm::cli {
namespace {

struct ServeFlags {
  std::string model, host = "0.0.0.0", device = "cpu", kv_cache_memory = "256M";
  std::string kv_cache_dtype = "fp32", grpc_memory = "256M";
  std::string api_key_file, tls_cert, tls_key, log_level = "info", model_name;
  std::string metrics_host;  // empty: host's
  std::string prefix_cache_scope = "key";
  int port = 50051, metrics_port = 9400, max_batch_tokens = 512, max_waiting = 1024, threads = 0;
  int max_running = 256, engine_nice = 10, max_priority = INT32_MAX;
  int tls_reload_interval = 60, api_key_reload_interval = 60;
  double shutdown_timeout = 30;
  double max_connection_age = 0;
  // Its own: it was --shutdown-timeout (30 s), which cut the stream of a long generation at its
  // connection's every --max-connection-age.
  double max_connection_age_grace = 600;
  double keepalive_time = 60, keepalive_timeout = 20;
  double unread_timeout = 10;
};

// "models/tiny/" -> "tiny": the default model_name label. Taken from the absolute path, so that
// `--model .` or `..` names the directory, not "." (the root alone gives "model").
std::string dir_name(const std::string& dir) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(dir, ec).lexically_normal();
  if (ec) p = std::filesystem::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() || name == "." || name == ".." ? "model" : name;
}

// The error that ends the server, logged, or on stderr where --log-level hides errors (critical,
// off): a misconfigured pod crash-looped with empty logs.
int fail(const absl::Status& st) {
  if (spdlog::should_log(spdlog::level::err))
    spdlog::error("{}", std::string(st.message()));
  else
    std::fprintf(stderr, "error: %s\n", std::string(st.message()).c_str());
  return 1;
}

// A flag's value refused for itself, before anything else runs: "error: …", exit 2, as every
// command's usage errors (it was a log line and exit 1).
int flag_error(const absl::Status& st) { return usage_error(std::string(st.message())); }

// Loads the engine and runs one short scoring pass, so the first request pays no warm-up.
absl::StatusOr<std::unique_ptr<Engine>> load_engine(const ServeFlags& f, int64_t kv_bytes) {
  EngineOptions opts;
  opts.model_dir = f.model;
  opts.device = f.device;
  opts.kv_cache_memory = kv_bytes;
  opts.max_batch_tokens = f.max_batch_tokens;
  opts.max_waiting = f.max_waiting;
  opts.max_running = f.max_running;
  opts.threads = f.threads;
  opts.kv_cache_dtype = f.kv_cache_dtype;
  opts.step_thread_nice = f.engine_nice;
  CEMLM_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(opts));
  // It runs the forward once; a model sure enough that token 0 never follows token 0 gives a
  // perplexity past a double (OUT_OF_RANGE), which says nothing against serving it.
  ScoreRequest warmup;
  warmup.ids = {0, 0};
  if (auto r = engine->score(warmup); !r.ok() && !absl::IsOutOfRange(r.status()))
    return absl::InternalError(absl::StrCat("warm-up failed: ", r.status().message()));
  return engine;
}

int serve(const ServeFlags& f, sigset_t* signals) {
  int64_t kv_bytes = 0;
  if (const std::string error = kv_cache_memory_flag(f.kv_cache_memory, &kv_bytes); !error.empty())
    return flag_error(absl::InvalidArgumentError(error));
  int64_t grpc_memory = 0;
  if (!parse_bytes(f.grpc_memory, &grpc_memory) || grpc_memory < 0)
    return flag_error(absl::InvalidArgumentError(
        "--grpc-memory: expected bytes like 256M or 1G (0: no bound), got '" + f.grpc_memory +
        "'"));
  if (grpc_memory > 0 && grpc_memory < (int64_t(16) << 20))  // a few connections' read buffers
    return flag_error(absl::InvalidArgumentError(
        absl::StrCat("--grpc-memory ", f.grpc_memory,
                     " is under 16M, too little for gRPC to serve; use 0 "
                     "for no bound")));
  if (f.engine_nice < 0 || f.engine_nice > 19)
    return flag_error(
        absl::InvalidArgumentError("--engine-nice " + std::to_string(f.engine_nice) +
                                   " must be in [0, 19] (0: the process's priority)"));
  for (const auto& [flag, port] : {std::pair{"--port", f.port}, {"--metrics-port", f.metrics_port}})
    if (port < 0 || port > 65535)
      return flag_error(absl::InvalidArgumentError(
          absl::StrCat(flag, " ", port, " is not a port: use 0-65535 (0 picks a free one)")));
  if (!(f.shutdown_timeout >= 0 && f.shutdown_timeout <= 1e6))  // 11 days: a finite deadline
    return flag_error(absl::InvalidArgumentError(absl::StrCat(
        "--shutdown-timeout ", exact_number(f.shutdown_timeout), " must be in [0, 1e6] seconds")));
  RunnerOptions runner;  // what needs no checkpoint, before listening
  runner.device = f.device;
  runner.kv_cache_dtype = f.kv_cache_dtype;
  runner.threads = f.threads;
  if (absl::Status st = check_runner_options(runner); !st.ok()) return flag_error(st);
  const std::pair<const char*, int> at_least_one[] = {{"--max-batch-tokens", f.max_batch_tokens},
                                                      {"--max-running", f.max_running},
                                                      {"--max-waiting", f.max_waiting}};
  for (const auto& [flag, value] : at_least_one)
    if (value < 1)
      return flag_error(absl::InvalidArgumentError(
          absl::StrCat(flag, " ", value, " must be at least 1 (see --help)")));
  // Below a second, a client reading at an ordinary pace could lose its stream's last message.
  if (!(f.unread_timeout >= 1 && f.unread_timeout <= 1e6))
    return flag_error(absl::InvalidArgumentError(absl::StrCat(
        "--unread-timeout ", exact_number(f.unread_timeout), " must be in [1, 1e6] seconds")));
  // gRPC counts these in whole milliseconds: a value under one was 0 ms, which closed every
  // connection at once (--max-connection-age) or pinged without a pause (--keepalive-time).
  constexpr double kMs = 1e-3;
  if (!(f.max_connection_age == 0 || f.max_connection_age >= kMs))
    return flag_error(absl::InvalidArgumentError(
        absl::StrCat("--max-connection-age ", exact_number(f.max_connection_age),
                     " must be 0 (no limit) or at least 0.001 seconds")));
  if (!(f.max_connection_age_grace >= 0 && f.max_connection_age_grace <= 1e6))
    return flag_error(absl::InvalidArgumentError(
        absl::StrCat("--max-connection-age-grace ", exact_number(f.max_connection_age_grace),
                     " must be in [0, 1e6] seconds")));
  if (!(f.keepalive_time == 0 || f.keepalive_time >= kMs))
    return flag_error(absl::InvalidArgumentError(
        absl::StrCat("--keepalive-time ", exact_number(f.keepalive_time),
                     " must be 0 (no pings) or at least 0.001 seconds")));
  if (!(f.keepalive_timeout >= kMs))
    return flag_error(absl::InvalidArgumentError(absl::StrCat("--keepalive-timeout ",
                                                              exact_number(f.keepalive_timeout),
                                                              " must be at least 0.001 seconds")));
  server::ServerOptions opts;
  opts.host = f.host;
  opts.port = f.port;
  opts.max_connection_age_s = f.max_connection_age;
  opts.max_connection_age_grace_s = f.max_connection_age_grace;
  opts.keepalive_time_s = f.keepalive_time;
  opts.keepalive_timeout_s = f.keepalive_timeout;
  // Overflow-safe: both flags may be up to INT_MAX.
  opts.max_unread_streams =
      int(std::min<int64_t>(INT32_MAX, int64_t(f.max_running) + f.max_waiting));
  opts.unread_timeout_s = f.unread_timeout;
  opts.grpc_memory_bytes = grpc_memory;
  opts.max_priority = f.max_priority;
  opts.text_slots = cpu_threads(f.threads).threads;  // tokenizing is CPU work like a step's
  opts.max_queued_texts = f.max_waiting;
  if (f.prefix_cache_scope != "key" && f.prefix_cache_scope != "shared")
    return flag_error(absl::InvalidArgumentError(absl::StrCat(
        "--prefix-cache-scope \"", f.prefix_cache_scope, "\" is not one of key, shared")));
  opts.prefix_cache_per_key = f.prefix_cache_scope == "key";
  opts.model_name = f.model_name.empty() ? dir_name(f.model) : f.model_name;
  // It goes out in GetModelInfo's string field and in every metric's label, which must be UTF-8,
  // and in log lines, which a line break in it would split.
  const char* name_is = f.model_name.empty()
                            ? "the model directory's name (the default --model-name)"
                            : "--model-name";
  const auto bad_name = f.model_name.empty() ? fail : flag_error;
  if (size_t ok = utf8_valid_prefix(opts.model_name); ok != opts.model_name.size())
    return bad_name(
        absl::InvalidArgumentError(absl::StrCat(name_is, " is not valid UTF-8 (bad byte at offset ",
                                                ok, "); pass a --model-name that is")));
  for (size_t i = 0; i < opts.model_name.size(); ++i)
    if (const unsigned char b = opts.model_name[i]; b < 0x20 || b == 0x7F)
      return bad_name(absl::InvalidArgumentError(absl::StrCat(
          name_is, " holds a control character (byte 0x", absl::Hex(b, absl::kZeroPad2),
          " at offset ", i, "); pass a --model-name without one")));
  struct Interval {
    const char* flag;
    int value;
    const char* zero;
  };
  for (const Interval& i : {Interval{"--tls-reload-interval", f.tls_reload_interval,
                                     "read the TLS files at start only"},
                            Interval{"--api-key-reload-interval", f.api_key_reload_interval,
                                     "read --api-key-file at start and on SIGHUP only"}})
    if (i.value < 0 || i.value > 86400)
      return flag_error(absl::InvalidArgumentError(
          absl::StrCat(i.flag, " ", i.value, " must be in [0, 86400] seconds (0: ", i.zero, ")")));
  std::optional<ApiKeyFile> key_file;
  if (!f.api_key_file.empty()) {
    auto keys = key_file.emplace(f.api_key_file).load();
    if (!keys.ok()) return fail(keys.status());
    opts.api_keys = *std::move(keys);
  }
  if (f.tls_cert.empty() != f.tls_key.empty())
    return flag_error(absl::InvalidArgumentError(
        "--tls-cert and --tls-key must be given together (or both left out to serve without "
        "TLS)"));
  std::optional<TlsFiles> tls;
  if (!f.tls_cert.empty()) {
    auto files = read_tls_files(f.tls_cert, f.tls_key);
    if (!files.ok()) return fail(files.status());
    tls = *std::move(files);
    opts.tls_cert_pem = tls->cert_pem;
    opts.tls_key_pem = tls->key_pem;
    opts.tls_cert_path = tls->cert_path;
    opts.tls_key_path = tls->key_path;
    opts.tls_reload_interval_s = unsigned(f.tls_reload_interval);
  }

  // The checkpoint's config.json before anything listens (the weights load after): the ports
  // line went out for a --model that names no checkpoint, and scripts that wait for it took such
  // a server for one that had started.
  if (auto config = load_checkpoint_config(f.model); !config.ok()) return fail(config.status());

  auto metrics = std::make_shared<server::ServerMetrics>(opts.model_name, f.max_waiting);
  const std::string& metrics_host = f.metrics_host.empty() ? f.host : f.metrics_host;
  auto metrics_http = server::MetricsHttpServer::start(metrics_host, f.metrics_port, [metrics] {
    return prometheus::TextSerializer().Serialize(metrics->Collect());
  });
  if (!metrics_http.ok()) return fail(metrics_http.status());
  // Before the server: gRPC's file watcher reads the watch's copies of the files.
  std::optional<TlsFileWatch> tls_watch;
  if (tls) {
    tls_watch.emplace(*tls, opts.tls_reload_interval_s,
                      [metrics](double end) { metrics->set_tls_certificate_end(end); });
    if (!tls_watch->started().ok()) return fail(tls_watch->started());
    opts.tls_cert_path = tls_watch->served_cert_path();
    opts.tls_key_path = tls_watch->served_key_path();
    // gRPC reads the copies (in memory) every second; the files are read at each look.
    if (opts.tls_reload_interval_s > 0) opts.tls_reload_interval_s = 1;
  }
  auto server = server::InferenceServer::start(opts, metrics.get());
  if (!server.ok()) return fail(server.status());
  const int metrics_port = (*metrics_http)->port();
  // One stable line on stdout, so scripts and tests can find the ports (--port 0 picks one).
  std::printf("cemlm serve: grpc port %d, metrics port %d\n", (*server)->port(), metrics_port);
  std::fflush(stdout);
  spdlog::info(
      "listening grpc={} metrics=http://{}/metrics model={} tls={} api_keys={} grpc_memory={} "
      "max_priority={}",
      server::host_port(f.host, (*server)->port()), server::host_port(metrics_host, metrics_port),
      f.model, !opts.tls_cert_pem.empty(), opts.api_keys.enabled(),
      grpc_memory > 0 ? f.grpc_memory : "unbounded",
      f.max_priority == INT32_MAX ? "any" : std::to_string(f.max_priority));

  // The model loads on a thread of its own while this one waits for a signal. A signal during
  // the load ends the process at once, exit 0 (nothing was served; a load cannot be stopped
  // half-way): waiting for the load to end first (a large model or KV cache: a minute or more)
  // could outlast the pod's grace period, and health then said SERVING for a moment.
  // SIGHUP reads --api-key-file again, and so does each look of --api-key-reload-interval that
  // finds its text changed (a Secret mounted in a pod changes in place); a text that does not
  // load leaves the keys served as they were.
  auto reload_keys = [&](std::string_view why, bool changed_only) {
    if (!key_file) {
      spdlog::warn("{}: no --api-key-file to read again; nothing changes", why);
      return;
    }
    if (auto keys = key_file->reload(why, changed_only)) {
      const size_t n = keys->size();
      (*server)->reload_api_keys(*std::move(keys));
      spdlog::info("{}: api keys read again from {}: {} keys", why, key_file->path(), n);
    }
  };
  // With --tls-reload-interval, the TLS files are looked at that often; each look puts what they
  // hold in the copies gRPC serves new connections from, and logs what those get.
  // The files looked at every so many seconds, from this thread between signals.
  struct Look {
    int interval_s;
    std::function<void()> look;
    Clock::time_point next;
  };
  std::vector<Look> looks;
  if (tls && f.tls_reload_interval > 0)
    looks.push_back({f.tls_reload_interval, [&] { tls_watch->poll(); }, {}});
  if (key_file && f.api_key_reload_interval > 0)
    looks.push_back(
        {f.api_key_reload_interval, [&] { reload_keys("--api-key-file changed", true); }, {}});
  for (Look& l : looks) l.next = Clock::now() + std::chrono::seconds(l.interval_s);
  // The looks that are due; returns the time until the next one (none: nullopt).
  auto look_at_files = [&] {
    std::optional<Clock::duration> until;
    for (Look& l : looks) {
      if (Clock::now() >= l.next) {
        l.look();
        l.next = Clock::now() + std::chrono::seconds(l.interval_s);
      }
      const auto left = std::max<Clock::duration>(l.next - Clock::now(), {});
      until = std::min(until.value_or(left), left);
    }
    return until;
  };
  auto loading = std::async(std::launch::async, [&] { return load_engine(f, kv_bytes); });
  while (loading.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    look_at_files();
    const timespec poll{0, 50'000'000};
    if (const int sig = sigtimedwait(signals, nullptr, &poll); sig == SIGHUP) {
      reload_keys("SIGHUP", /*changed_only=*/false);
    } else if (sig > 0) {
      spdlog::info("signal {} while the model loads: exiting", sig);
      spdlog::default_logger()->flush();
      std::_Exit(0);
    }
  }
  auto engine = loading.get();
  if (!engine.ok()) return fail(engine.status());
  Engine* e = engine->get();
  metrics->set_stats_source([e] { return e->stats(); });
  metrics->set_model_info(e->info());
  (*server)->set_engine(e);
  spdlog::info("serving model={} variant={} device={} kv_cache={} texts_at_once={} blas=\"{}\"",
               opts.model_name, e->config().variant_name(), e->info().device, f.kv_cache_dtype,
               opts.text_slots, blas_description());
  if (is_cpu_device(f.device)) {
    const CpuThreads t = cpu_threads(f.threads);
    spdlog::info("compute threads={} ({}); {}", t.threads, t.why, openmp_wait_description());
  }

  // Until a signal other than SIGHUP (or a failed wait, which cannot happen with a valid set).
  int sig = 0;
  for (;;) {
    if (const std::optional<Clock::duration> left = look_at_files()) {
      const auto whole = std::chrono::duration_cast<std::chrono::seconds>(*left);
      const timespec wait{
          whole.count(),
          long(std::chrono::duration_cast<std::chrono::nanoseconds>(*left - whole).count())};
      sig = sigtimedwait(signals, nullptr, &wait);
    } else {
      sig = sigwaitinfo(signals, nullptr);
    }
    if (sig == SIGHUP)
      reload_keys("SIGHUP", /*changed_only=*/false);
    else if (sig > 0 || (errno != EAGAIN && errno != EINTR))
      break;
  }
  if (sig > 0)
    spdlog::info("signal {}: draining for up to {} s", sig, f.shutdown_timeout);
  else
    spdlog::error("waiting for signals failed ({}): draining for up to {} s", std::strerror(errno),
                  f.shutdown_timeout);
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(f.shutdown_timeout));
  if (!(*server)->drain(timeout)) spdlog::warn("shutdown timeout: cancelling what is left");
  e->shutdown(/*cancel_running=*/true);
  (*server)->shutdown();
  metrics->set_stats_source(nullptr);
  metrics_http->reset();  // stops /metrics
  spdlog::info("stopped");
  return 0;
}

// gRPC's own log lines: a malformed request makes it write one each (a bad grpc-timeout header:
// "Error parsing metadata: ... value=abc"), so a client could fill the log, with its own bytes.
// They go through spdlog, escaped, at most one a second, saying how many were left out.
std::atomic<bool> grpc_lines_to_spdlog{true};  // false once serve() is over: plain stderr

// One library's lines: at most one a second, counting those left out.
struct LibraryLog {
  const char* lib;  // "grpc", "protobuf": each line's prefix
  std::mutex mu;
  std::chrono::steady_clock::time_point last{};
  int64_t left_out = 0;
};

// One line of gRPC's or protobuf's own, through spdlog as above.
void log_library_line(LibraryLog& log, spdlog::level::level_enum level, absl::string_view message,
                      const char* file, int line) {
  if (!grpc_lines_to_spdlog.load()) {
    std::fprintf(stderr, "%s: %s\n", log.lib, absl::CEscape(message.substr(0, 512)).c_str());
    return;
  }
  std::unique_lock lock(log.mu);
  const auto now = std::chrono::steady_clock::now();
  if (log.last != std::chrono::steady_clock::time_point{} &&
      now - log.last < std::chrono::seconds(1)) {
    ++log.left_out;
    return;
  }
  log.last = now;
  const int64_t skipped = std::exchange(log.left_out, 0);
  lock.unlock();
  spdlog::log(level, "{}: {}{} ({}:{}; {} {} lines left out before it)", log.lib,
              absl::CEscape(message.substr(0, 512)), message.size() > 512 ? "..." : "", file, line,
              skipped, log.lib);
}

void log_grpc_line(gpr_log_func_args* args) {
  static auto* log = new LibraryLog{"grpc"};  // never destroyed: gRPC's threads may log at exit
  const auto level = args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
                     : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                               : spdlog::level::debug;
  log_library_line(*log, level, args->message, args->file, args->line);
}

// Protobuf's (a request_id that is not UTF-8 made one, unprefixed, on stderr).
void log_protobuf_line(google::protobuf::LogLevel severity, const char* file, int line,
                       const std::string& message) {
  const auto level = severity >= google::protobuf::LOGLEVEL_ERROR     ? spdlog::level::err
                     : severity == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                                      : spdlog::level::info;
  static auto* log = new LibraryLog{"protobuf"};
  log_library_line(*log, level, message, file, line);
}

// gRPC (1.51) stops accepting connections for good once accept() has failed for want of a file
// descriptor (a fuzzing run lost the port for good at a limit of 160); each connection holds one.
// The soft limit, often 1024, goes up to the hard one, and a low hard limit is reported.
void raise_open_files_limit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  const rlim_t was = lim.rlim_cur;
  constexpr rlim_t kEnough = 4096, kMost = rlim_t(1) << 20;  // Linux's default nr_open
  const rlim_t want = lim.rlim_max == RLIM_INFINITY ? kMost : lim.rlim_max;
  if (lim.rlim_cur < want) {
    lim.rlim_cur = want;
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) lim.rlim_cur = was;
  }
  if (lim.rlim_cur < kEnough)
    spdlog::warn("open files limit {}: each client connection takes one, and once they run out "
                 "gRPC accepts no connection again until a restart; raise the hard limit "
                 "(ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=)",
                 lim.rlim_cur);
  else if (lim.rlim_cur != was)
    spdlog::info("open files limit raised from {} to {}", was, lim.rlim_cur);
}

}  // namespace

int cmd_serve(int argc, char** argv) {
  ServeFlags f;
  Flags flags("cemlm serve --model DIR [--port 50051] [--metrics-port 9400] [options]",
              "Serve a checkpoint over gRPC (cemlm.v1.Inference, grpc.health.v1.Health,\n"
              "reflection) with Prometheus metrics at http://HOST:METRICS_PORT/metrics.\n"
              "SIGTERM/SIGINT: stop listening, send every connection a GOAWAY (clients take\n"
              "their next calls elsewhere), finish the requests in flight, exit 0 (at once while\n"
              "the model loads). SIGHUP: read --api-key-file again (a file that does not load\n"
              "leaves the keys as they were). Without a signal, --api-key-file is read again\n"
              "every --api-key-reload-interval seconds and the TLS files every\n"
              "--tls-reload-interval seconds.");
  flags.add_nonempty("model", &f.model,
                     "checkpoint directory (config.json, model.safetensors, ...)",
                     "name the checkpoint directory to serve", /*required=*/true);
  flags.add_nonempty("host", &f.host,
                     "address to listen on, gRPC and metrics (IPv4 or IPv6; the wildcards 0.0.0.0 "
                     "and :: both take both families, as gRPC does)",
                     "name an address, such as 0.0.0.0, 127.0.0.1 or ::");
  flags.add("port", &f.port,
            "gRPC port; 0 picks a free one (printed on stdout as soon as it listens, before the "
            "model loads: health says SERVING once requests are served)");
  flags.add("metrics-port", &f.metrics_port, "HTTP port of /metrics; 0 picks a free one");
  flags.add_nonempty("metrics-host", &f.metrics_host,
                     "address /metrics listens on (default: --host's); 127.0.0.1 keeps it, which "
                     "has no authentication, off the network while gRPC listens on every "
                     "interface",
                     "name an address, or leave the flag out for --host's");
  flags.add("device", &f.device,
            "cpu (= cpu:fp32) | cpu:bf16 | cpu:int8 (product weights held in bf16, or in int8 "
            "with a scale per 32x32 block, computed in fp32: a half or a quarter of the weight "
            "bytes, faster decode, logprobs move a little) | cpu:bf16dot | cpu:int8dot (the same "
            "weights, and products that round their inputs to bf16 / int8 too, with AVX512-BF16 "
            "/ VNNI dot products: batches and prefill faster again, logprobs move more) | cuda "
            "(= cuda:bf16) | cuda:fp32");
  flags.add("kv-cache-memory", &f.kv_cache_memory, "KV-cache budget in bytes (K/M/G/T suffixes)");
  flags.add(
      "kv-cache-dtype", &f.kv_cache_dtype,
      "fp32 | bf16 | int8 (CPU): bf16 holds twice the tokens of fp32 and reads half the "
      "bytes per decode step, entries (keys and the diag term's contexts) rounded to bf16 "
      "(logprobs move by ~1e-3 on the default model, more where logits are large); int8 holds "
      "3.7-3.9x the tokens of fp32 with heads of 32-64 (a byte per number plus a 4-byte scale "
      "per head of each key row and one per context row; `cemlm inspect` gives the bytes), "
      "entries quantized (logprobs move by ~2e-3 on the default model)");
  flags.add("max-batch-tokens", &f.max_batch_tokens,
            "tokens per engine step (chunked prefill; at least 1)");
  flags.add("max-running", &f.max_running,
            "requests in the running batch at once, at least 1 (the rest queue; a higher priority "
            "preempts)");
  flags.add("max-waiting", &f.max_waiting,
            "requests queued beyond the running batch's free slots (while the KV cache has room "
            "to start one) before RESOURCE_EXHAUSTED (at least 1); it also bounds the Generate "
            "calls whose prompt_text waits for its "
            "turn to be tokenized, and with --max-running the finished Generate streams whose "
            "clients have not read them");
  flags.add("unread-timeout", &f.unread_timeout,
            "seconds a finished Generate stream may go without its client reading any of it once "
            "--max-running + --max-waiting such streams wait (and at shutdown); then it is "
            "cancelled to make room (its output undelivered)");
  flags.add("grpc-memory", &f.grpc_memory,
            "memory gRPC may hold for all connections (request bodies still arriving, read "
            "buffers; K/M/G suffixes; 0 = no bound): over it, it resets streams "
            "(RESOURCE_EXHAUSTED) and closes idle connections, so that clients sending bodies "
            "slowly cannot fill the server's memory, key or no key");
  flags.add_nonempty("api-key-file", &f.api_key_file,
                     "require 'authorization: Bearer KEY', one key a line; 'KEY max_priority=N' "
                     "lets that key's requests ask for a priority of at most N (above: "
                     "PERMISSION_DENIED)",
                     "name a file of keys, or leave the flag out to serve without keys");
  flags.add("api-key-reload-interval", &f.api_key_reload_interval,
            "seconds between reads of --api-key-file: a changed text (a rotated Secret, an edit) "
            "is served from then on, each key kept keeping its prefix-cache blocks, once the file "
            "has not been written for 2 s (one being written is not taken half-way); a text "
            "that does not load is logged and the keys stay as they were; 0 = read at start "
            "and on SIGHUP only (0 to 86400)");
  flags.add("prefix-cache-scope", &f.prefix_cache_scope,
            "key | shared: which requests reuse each other's prefix-cache blocks: those of the "
            "same API key (all, without --api-key-file), so that no tenant learns from cached "
            "tokens or time to first token what another's prompts held; or all of them (more "
            "hits across keys). Either way, only requests of the same cache_salt share them");
  flags.add("max-priority", &f.max_priority,
            "the highest priority a request may ask for (above: PERMISSION_DENIED), unless its "
            "API key's line sets its own max_priority=; the default allows any, so that any "
            "client can preempt the others");
  // Empty, they served plaintext: API keys would cross the network in clear.
  flags.add_nonempty("tls-cert", &f.tls_cert,
                     "PEM certificate chain (with --tls-key: serve TLS only); refused when its "
                     "first certificate has expired or is not valid yet, warned of a week "
                     "before it expires; read again every --tls-reload-interval",
                     "name a PEM certificate file, or leave --tls-cert and --tls-key out to "
                     "serve without TLS");
  flags.add_nonempty("tls-key", &f.tls_key, "PEM private key of --tls-cert",
                     "name a PEM private key file, or leave --tls-cert and --tls-key out to "
                     "serve without TLS");
  flags.add("tls-reload-interval", &f.tls_reload_interval,
            "seconds between reads of --tls-cert and --tls-key for a replacement (a renewed "
            "certificate, a rotated Secret): connections made after a change get the new pair, "
            "those open keep theirs; each change is logged, a pair that cannot serve too (new "
            "TLS connections fail while the files hold it); 0 = read at start only (0 to 86400)");
  flags.add("shutdown-timeout", &f.shutdown_timeout,
            "seconds to let requests finish on SIGTERM (0 to 1e6)");
  flags.add("max-connection-age", &f.max_connection_age,
            "seconds after which a client connection is closed (±10%), its calls given "
            "--max-connection-age-grace to finish: clients reconnect and spread over new "
            "replicas; 0 = never");
  flags.add("max-connection-age-grace", &f.max_connection_age_grace,
            "seconds the calls of a connection --max-connection-age closed get to finish (0 to "
            "1e6); a stream still running then is cut (UNAVAILABLE): keep it above the longest "
            "generation");
  flags.add("keepalive-time", &f.keepalive_time,
            "seconds between pings to each client connection, which find connections "
            "whose client vanished without closing them (its host gone, a silent network drop); "
            "0 = never");
  flags.add("keepalive-timeout", &f.keepalive_timeout,
            "seconds a ping may go unanswered before its connection is closed and its calls "
            "cancelled, their KV blocks freed");
  flags.add("threads", &f.threads,
            absl::StrCat(kThreadsHelp,
                         "; also the texts tokenized or decoded at once (Tokenize, Detokenize, "
                         "Score's text), the others waiting their turn (at most 32 a thread; "
                         "more are RESOURCE_EXHAUSTED)"));
  flags.add("engine-nice", &f.engine_nice,
            "niceness (0..19) the engine's step and compute threads add to the process's, so "
            "that gRPC's threads read requests and write tokens without waiting behind a step");
  flags.add("log-level", &f.log_level, "trace | debug | info | warn | error | critical | off");
  flags.add_nonempty("model-name", &f.model_name,
                     "name in metrics and GetModelInfo (default: DIR's name)",
                     "name the model, or leave the flag out for its directory's name");
  if (int rc = flags.parse(argc, argv); rc >= 0) return rc;

  // Logs go to stderr: stdout carries the port line and nothing else.
  spdlog::set_default_logger(spdlog::stderr_color_mt("serve"));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  const auto level = spdlog::level::from_str(f.log_level);
  if (level == spdlog::level::off && f.log_level != "off") {
    std::fprintf(stderr,
                 "error: --log-level: '%s' is not one of trace, debug, info, warn, "
                 "error, critical, off\n",
                 f.log_level.c_str());
    return 2;
  }
  spdlog::set_level(level);
  raise_open_files_limit();
  gpr_set_log_function(log_grpc_line);
  google::protobuf::SetLogHandler(log_protobuf_line);
  // Block the signals before any thread starts, so that every thread inherits the mask and
  // only sigwait() sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);  // reads --api-key-file again (it ended the process, undrained)
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  const int rc = serve(f, &signals);
  grpc_lines_to_spdlog.store(false);  // gRPC may log after this, from threads of its own
  return rc;
}

}  // namespace cemlm::cli
