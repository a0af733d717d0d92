// MetricsHttpServer (see metrics_http.h): accept, read a request head, answer, close. Every
// connection has a deadline for all of that, and past kMaxConnections the oldest is closed (one
// that has sent nothing first; each is read as it is accepted), so slow or idle clients cannot keep
// a scrape out.
#include "cemlm/server/metrics_http.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace cemlm::server {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxRequestBytes = 8192;
constexpr auto kConnectionTime = std::chrono::seconds(5);  // to send the request, read the answer
constexpr size_t kMaxConnections = 64;
// Read after the answer (a body, pipelined requests) before the connection is closed: a client
// streaming bytes at it kept the thread reading at full speed until the deadline (5.7 GB in 5 s,
// other scrapes delayed up to 1.1 s).
constexpr size_t kMaxDiscardedBytes = 64 << 10;

struct Connection {
  int fd;
  Clock::time_point deadline;
  std::string in, out;  // the request read so far; the answer, once there is one
  size_t sent = 0;
  bool closing = false;  // answered: reading what the client still sends until it closes
  size_t discarded = 0;  // bytes read while closing
};

std::string answer(int code, const char* reason, const std::string& body, bool head,
                   const char* extra_header = "") {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason,
                      "\r\nContent-Type: ", code == 200 ? "text/plain; version=0.0.4" : "text/plain",
                      "; charset=utf-8\r\nContent-Length: ", body.size(), "\r\n", extra_header,
                      "Connection: close\r\n\r\n", head ? "" : body);
}

// The path of a request target: origin form ("/metrics?x"), or absolute form
// ("http://host:port/metrics", what a proxy sends) without its scheme and authority.
std::string path_of(std::string target) {
  for (const char* scheme : {"http://", "https://"})
    if (target.rfind(scheme, 0) == 0) {
      const size_t slash = target.find('/', std::strlen(scheme));
      target = slash == std::string::npos ? "/" : target.substr(slash);
    }
  return target.substr(0, target.find('?'));
}

// The answer to a complete request head.
std::string respond(const std::string& request, const MetricsHttpServer::Render& render) {
  // Empty lines before the request line are skipped (RFC 9112 §2.2).
  const size_t begin = std::min(request.find_first_not_of("\r\n"), request.size());
  const std::string line = request.substr(begin, request.find_first_of("\r\n", begin) - begin);
  const size_t sp1 = line.find(' '), sp2 = line.rfind(' ');
  if (sp1 == std::string::npos || sp2 == sp1 || line.compare(sp2 + 1, 5, "HTTP/") != 0)
    return answer(400, "Bad Request", "not an HTTP request\n", false);
  const std::string method = line.substr(0, sp1);
  const std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const bool head = method == "HEAD";
  if (path_of(target) != "/metrics")
    return answer(404, "Not Found", "not found; the metrics are at /metrics\n", head);
  if (method != "GET" && !head)
    return answer(405, "Method Not Allowed", "use GET\n", false, "Allow: GET, HEAD\r\n");
  return answer(200, "OK", render(), head);
}

// Reads what the connection has; false when it is to be closed (gone, or done).
bool on_readable(Connection& c, const MetricsHttpServer::Render& render) {
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    if (c.closing) {  // a body or a pipelined request: read, not answered, up to a bound
      if ((c.discarded += size_t(n)) > kMaxDiscardedBytes) return false;
      continue;
    }
    c.in.append(buf, size_t(n));
    const size_t text = c.in.find_first_not_of("\r\n");  // leading empty lines are no end
    size_t end = std::string::npos;                      // just past the head's empty line
    if (text != std::string::npos) {  // a line end is CRLF or LF: "\n\r\n" also ends "\r\n\r\n"
      if (const size_t lf_crlf = c.in.find("\n\r\n", text); lf_crlf != std::string::npos)
        end = lf_crlf + 3;
      if (const size_t lf = c.in.find("\n\n", text); lf != std::string::npos)
        end = std::min(end, lf + 2);
    }
    // The bound holds for a head that ends within the read that crosses it, too.
    if ((end == std::string::npos ? c.in.size() : end) > kMaxRequestBytes) {
      c.out = answer(431, "Request Header Fields Too Large", "request too large\n", false);
      return true;
    }
    if (end != std::string::npos) {
      c.out = respond(c.in, render);
      return true;
    }
  }
}

// Sends what is left of the answer; false when the connection is gone. Once all is sent the
// connection half-closes and reads until the client closes (or its deadline): closing with
// unread bytes (a body, a pipelined request) would reset it and could lose the answer.
bool on_writable(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    c.sent += size_t(n);
  }
  ::shutdown(c.fd, SHUT_WR);
  c.closing = true;
  return true;
}

// Reads what the connection has and sends what it can of its answer; false when it is to be
// closed.
bool progress(Connection& c, const MetricsHttpServer::Render& render) {
  bool open = true;
  if (c.closing || c.out.empty()) open = on_readable(c, render);
  if (open && !c.closing && !c.out.empty()) open = on_writable(c);
  return open;
}

int open_listener(const addrinfo& ai, std::string* why) {
  const int fd = ::socket(ai.ai_family, ai.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *why = std::strerror(errno);
    return -1;
  }
  const int one = 1, zero = 0;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  // "::" takes IPv4 too, as gRPC's listener on "::" does.
  if (ai.ai_family == AF_INET6) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  if (::bind(fd, ai.ai_addr, ai.ai_addrlen) == 0 && ::listen(fd, 128) == 0) return fd;
  *why = std::strerror(errno);
  ::close(fd);
  return -1;
}

// The port a listening socket has (the one the system picked for port 0).
int bound_port(int fd) {
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  return ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
}

void set_port(addrinfo& ai, int port) {
  if (ai.ai_family == AF_INET6)
    reinterpret_cast<sockaddr_in6*>(ai.ai_addr)->sin6_port = htons(uint16_t(port));
  else
    reinterpret_cast<sockaddr_in*>(ai.ai_addr)->sin_port = htons(uint16_t(port));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::start(
    const std::string& host, int port, Render render) {
  std::string name = host;
  if (name.size() > 2 && name.front() == '[' && name.back() == ']') name = name.substr(1, name.size() - 2);
  // gRPC listens on both families for either wildcard, 0.0.0.0 too: so does /metrics, where the
  // machine has IPv6 (an IPv6-only cluster's Prometheus reached gRPC but not /metrics).
  if (name == "0.0.0.0")
    if (auto both = start("::", port, render); both.ok()) return both;
  addrinfo hints{};
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string where = absl::StrCat("--metrics-port ", port, ": cannot listen on ", host);
  if (const int rc = ::getaddrinfo(name.c_str(), std::to_string(port).c_str(), &hints, &found))
    return absl::InvalidArgumentError(absl::StrCat("--metrics-host (or --host) ", host,
                                                   ": cannot listen on ", host, " (",
                                                   ::gai_strerror(rc), "); give an address"));
  // Every address of the name ("localhost": ::1 and 127.0.0.1), on one port: the first one's
  // when port 0 lets the system pick. An address this machine lacks is skipped.
  std::vector<int> fds;
  std::string why;
  for (addrinfo* ai = found; ai; ai = ai->ai_next) {
    if (!fds.empty()) set_port(*ai, bound_port(fds[0]));
    if (const int fd = open_listener(*ai, &why); fd >= 0) fds.push_back(fd);
  }
  ::freeaddrinfo(found);
  if (fds.empty()) return absl::UnavailableError(absl::StrCat(where, " (", why, ")"));
  int stop[2];
  if (::pipe2(stop, O_CLOEXEC | O_NONBLOCK) != 0) {
    for (int fd : fds) ::close(fd);
    return absl::ResourceExhaustedError(absl::StrCat(where, " (pipe: ", std::strerror(errno), ")"));
  }
  const int actual = bound_port(fds[0]);
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(std::move(fds), actual, stop, std::move(render)));
}

MetricsHttpServer::MetricsHttpServer(std::vector<int> listen_fds, int port, const int stop_fds[2],
                                     Render render)
    : listen_fds_(std::move(listen_fds)),
      port_(port),
      stop_read_(stop_fds[0]),
      stop_write_(stop_fds[1]),
      render_(std::move(render)),
      thread_([this] { loop(); }) {}

MetricsHttpServer::~MetricsHttpServer() {
  const char byte = 0;
  while (::write(stop_write_, &byte, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
  ::close(stop_read_);
  ::close(stop_write_);
  for (int fd : listen_fds_) ::close(fd);
}

void MetricsHttpServer::loop() {
  std::vector<Connection> conns;
  std::vector<pollfd> fds;
  const size_t first_conn = 1 + listen_fds_.size();  // fds: the stop pipe, listeners, connections
  for (;;) {
    fds.assign({{stop_read_, POLLIN, 0}});
    for (int fd : listen_fds_) fds.push_back({fd, POLLIN, 0});
    Clock::time_point next = Clock::time_point::max();
    for (const Connection& c : conns) {
      fds.push_back({c.fd, short(c.closing || c.out.empty() ? POLLIN : POLLOUT), 0});
      next = std::min(next, c.deadline);
    }
    const int timeout =
        conns.empty() ? -1
                      : int(std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                     next - Clock::now())
                                                         .count() + 1));
    if (::poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) break;
    if (fds[0].revents) break;
    // Connections first; then the ones past their deadline go.
    const Clock::time_point now = Clock::now();
    std::vector<Connection> kept;
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      bool open = now < c.deadline;
      if (open && fds[first_conn + i].revents) open = progress(c, render_);
      if (open) {
        kept.push_back(std::move(c));
      } else {
        ::close(c.fd);
      }
    }
    conns.swap(kept);
    for (size_t l = 0; l < listen_fds_.size(); ++l) {
      if (!(fds[1 + l].revents & POLLIN)) continue;
      for (int fd; (fd = ::accept4(listen_fds_[l], nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0;) {
        if (conns.size() >= kMaxConnections) {  // one makes way: answered, idle, then oldest
          auto rank = [](const Connection& c) { return c.closing ? 0 : c.in.empty() ? 1 : 2; };
          auto victim = std::min_element(conns.begin(), conns.end(), [&](auto& a, auto& b) {
            return rank(a) != rank(b) ? rank(a) < rank(b) : a.deadline < b.deadline;
          });
          ::close(victim->fd);
          conns.erase(victim);
        }
        // Read at once: a scrape whose request came in a burst of connections is then no longer
        // idle, and the burst's later ones do not close it before it is read.
        conns.push_back({fd, Clock::now() + kConnectionTime, {}, {}, 0, false, 0});
        if (!progress(conns.back(), render_)) {
          ::close(fd);
          conns.pop_back();
        }
      }
      // Out of file descriptors: the listener stays readable, so wait for one instead of
      // spinning (the connections' deadlines free theirs).
      if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  for (const Connection& c : conns) ::close(c.fd);
}

}  // namespace cemlm::server
