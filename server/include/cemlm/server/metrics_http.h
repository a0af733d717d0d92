// The HTTP endpoint of /metrics: a small HTTP/1.1 server on one thread of its own (a poll loop
// over non-blocking sockets, one request per connection). It replaces prometheus-cpp's civetweb
// server, whose 100 KiB worker stacks lose OpenBLAS's ~60 KiB of static TLS (a 404 overflowed
// one and the process died on the next request) and whose two workers two idle connections held.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace cemlm::server {

class MetricsHttpServer {
 public:
  // The exposition text of a scrape (Prometheus text format 0.0.4); called on the server's thread.
  using Render = std::function<std::string()>;

  // Listens on host:port (an IPv4 or IPv6 address, or a name: on every address it has, as gRPC
  // does; "::" takes both families; port 0 picks a free one). The error names --metrics-port.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> start(const std::string& host,
                                                                   int port, Render render);
  // Stops within milliseconds, whatever connections are open.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer(std::vector<int> listen_fds, int port, const int stop_fds[2], Render render);
  void loop();

  const std::vector<int> listen_fds_;
  const int port_;
  const int stop_read_, stop_write_;  // a pipe: a byte on it ends the loop
  const Render render_;
  std::thread thread_;
};

}  // namespace cemlm::server
