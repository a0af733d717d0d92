// MetricsHttpServer on loopback: /metrics answers (GET, HEAD, a query string), other paths and
// methods get their HTTP errors and the server goes on (a 404 once crashed the process through
// civetweb's small stacks), idle and slow connections cannot keep a scrape out, it stops with
// connections open, and it listens on IPv6 (with IPv4 on "::").
#include "cemlm/server/metrics_http.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "server_process.h"

namespace cemlm::server {
namespace {

using testing_server::http_exchange;

std::unique_ptr<MetricsHttpServer> start(const std::string& host, std::atomic<int>* renders) {
  auto s = MetricsHttpServer::start(host, 0, [renders] {
    ++*renders;
    return std::string("up 1\n");
  });
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

// An open TCP connection to 127.0.0.1:port that has sent `bytes` (-1 when it failed).
int connect_and_send(int port, const std::string& bytes) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      write(fd, bytes.data(), bytes.size()) != ssize_t(bytes.size())) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string get(int port, const std::string& path, const std::string& method = "GET") {
  return http_exchange("127.0.0.1", port, method + " " + path + " HTTP/1.1\r\nHost: x\r\n\r\n");
}

TEST(MetricsHttp, ServesMetricsAndAnswersEverythingElseWithAnError) {
  std::atomic<int> renders{0};
  auto s = start("127.0.0.1", &renders);
  ASSERT_TRUE(s);
  const std::string ok = get(s->port(), "/metrics");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << ok;
  EXPECT_NE(ok.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << ok;
  EXPECT_NE(ok.find("Content-Length: 5\r\n"), std::string::npos) << ok;
  EXPECT_EQ(ok.substr(ok.size() - 5), "up 1\n");
  EXPECT_EQ(renders.load(), 1);
  EXPECT_EQ(get(s->port(), "/metrics?format=text").rfind("HTTP/1.1 200", 0), 0u);
  const std::string head = get(s->port(), "/metrics", "HEAD");
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_EQ(head.substr(head.size() - 4), "\r\n\r\n") << "HEAD has no body: " << head;
  EXPECT_EQ(get(s->port(), "/favicon.ico").rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(get(s->port(), "/").rfind("HTTP/1.1 404", 0), 0u);
  const std::string post = get(s->port(), "/metrics", "POST");
  EXPECT_EQ(post.rfind("HTTP/1.1 405", 0), 0u) << post;
  EXPECT_NE(post.find("Allow: GET, HEAD"), std::string::npos) << post;
  EXPECT_EQ(http_exchange("127.0.0.1", s->port(), "hello\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  const std::string huge = http_exchange("127.0.0.1", s->port(), "GET /" + std::string(9000, 'a'));
  EXPECT_EQ(huge.rfind("HTTP/1.1 431", 0), 0u) << huge.substr(0, 40);
  EXPECT_EQ(get(s->port(), "/metrics").rfind("HTTP/1.1 200", 0), 0u) << "still serving";
  // The bound is on the head, 8 KiB, even one that ends within the read that crosses it (a 9 KB
  // head, read 4 KiB at a time, was answered).
  auto padded = [&](size_t pad) {
    return http_exchange("127.0.0.1", s->port(),
                         "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(pad, 'a') + "\r\n\r\n");
  };
  EXPECT_EQ(padded(9000).rfind("HTTP/1.1 431", 0), 0u);
  EXPECT_EQ(padded(8000).rfind("HTTP/1.1 200", 0), 0u);
  // The absolute form a proxy sends, and empty lines before the request line (RFC 9112).
  EXPECT_EQ(get(s->port(), "http://127.0.0.1/metrics").rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_EQ(http_exchange("127.0.0.1", s->port(), "\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n")
                .rfind("HTTP/1.1 200", 0),
            0u);
  // A line ends in CRLF or a bare LF, in any mix: the head ends at its first empty line (a bare
  // LF then an empty CRLF line went unseen, and the scrape waited out its deadline for nothing).
  for (const char* head :
       {"GET /metrics HTTP/1.1\nHost: x\n\n", "GET /metrics HTTP/1.1\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: x\n\r\n", "GET /metrics HTTP/1.1\r\nHost: x\r\n\n"})
    EXPECT_EQ(http_exchange("127.0.0.1", s->port(), head).rfind("HTTP/1.1 200", 0), 0u) << head;
  // A request with a body, or a second one behind it, still gets its whole answer (closing
  // with those bytes unread would reset the connection).
  const std::string body = http_exchange(
      "127.0.0.1", s->port(),
      "GET /metrics HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + std::string(5000, 'b') +
          "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(body.rfind("HTTP/1.1 200", 0), 0u) << body.substr(0, 40);
  EXPECT_EQ(body.substr(body.size() - 5), "up 1\n");
}

TEST(MetricsHttp, IdleAndSlowConnectionsDoNotKeepAScrapeOut) {
  std::atomic<int> renders{0};
  auto s = start("127.0.0.1", &renders);
  ASSERT_TRUE(s);
  std::vector<int> held;  // more than the server keeps: the oldest are closed for new ones
  for (int i = 0; i < 100; ++i) held.push_back(connect_and_send(s->port(), i % 2 ? "" : "GET /met"));
  for (int fd : held) ASSERT_GE(fd, 0);
  const std::string ok = get(s->port(), "/metrics");
  EXPECT_EQ(ok.rfind("HTTP/1.1 200", 0), 0u) << ok;
  for (int fd : held) close(fd);
}

// Everything a connection sends it. "" on a failure (a closed or reset connection included).
std::string read_all(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, size_t(n));
  return n < 0 ? "" : out;
}

// A scrape that arrives with a burst of idle connections, accepted together, is read as it is
// accepted: it was closed unread as the oldest idle one once the burst passed the 64 kept (9 of
// 40 scrapes failed under such bursts). The server's thread is held in a render while the burst
// queues, so that the scrape and the burst are accepted in one go.
TEST(MetricsHttp, AScrapeInABurstOfIdleConnectionsIsAnswered) {
  std::atomic<bool> hold{true};
  std::atomic<int> renders{0};
  auto s = MetricsHttpServer::start("127.0.0.1", 0, [&] {
    if (++renders == 1)
      while (hold.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return std::string("up 1\n");
  });
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();
  std::thread held_scrape(
      [port] { http_exchange("127.0.0.1", port, "GET /metrics HTTP/1.1\r\n\r\n"); });
  while (renders.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const int scrape = connect_and_send(port, "GET /metrics HTTP/1.1\r\n\r\n");
  ASSERT_GE(scrape, 0);
  std::vector<int> burst;  // within the listener's backlog of 128
  for (int i = 0; i < 100; ++i) burst.push_back(connect_and_send(port, ""));
  for (int fd : burst) ASSERT_GE(fd, 0);
  hold = false;
  held_scrape.join();
  const std::string answer = read_all(scrape);
  EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << "[" << answer << "]";
  close(scrape);
  for (int fd : burst) close(fd);
}

// What a client sends after its request is read and dropped up to 64 KiB, then the connection
// is closed: a client streaming bytes kept the thread reading them until the deadline.
TEST(MetricsHttp, BytesAfterTheRequestAreBounded) {
  std::atomic<int> renders{0};
  auto s = start("127.0.0.1", &renders);
  ASSERT_TRUE(s);
  const int fd = connect_and_send(s->port(), "GET /metrics HTTP/1.1\r\n\r\n");
  ASSERT_GE(fd, 0);
  const std::string junk(1 << 16, 'j');
  size_t sent = 0;
  while (sent < (size_t(256) << 20)) {  // the loopback's buffers hold a few MB at most
    const ssize_t n = send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += size_t(n);
  }
  EXPECT_LT(sent, size_t(256) << 20) << "the server read everything it was sent";
  close(fd);
  EXPECT_EQ(get(s->port(), "/metrics").rfind("HTTP/1.1 200", 0), 0u) << "still serving";
}

TEST(MetricsHttp, StopsWithConnectionsOpen) {
  std::atomic<int> renders{0};
  auto s = start("127.0.0.1", &renders);
  ASSERT_TRUE(s);
  const int idle = connect_and_send(s->port(), "GET /metrics HTTP/1.1\r\n");
  ASSERT_GE(idle, 0);
  s.reset();  // returns although the request never ends
  char c;
  EXPECT_LE(read(idle, &c, 1), 0) << "the connection is closed (or reset: its request is unread)";
  close(idle);
}

TEST(MetricsHttp, ListensOnIpv6AndTheWildcardTakesIpv4) {
  std::atomic<int> renders{0};
  auto v6 = start("::1", &renders);
  ASSERT_TRUE(v6);
  EXPECT_EQ(http_exchange("::1", v6->port(), "GET /metrics HTTP/1.0\r\n\r\n").rfind("HTTP/1.1 200", 0),
            0u);
  auto any = start("::", &renders);
  ASSERT_TRUE(any);
  EXPECT_EQ(get(any->port(), "/metrics").rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_EQ(http_exchange("::1", any->port(), "GET /metrics HTTP/1.0\r\n\r\n").rfind("HTTP/1.1 200", 0),
            0u);
  // 0.0.0.0, the default, takes IPv6 too, as gRPC's listener on it does.
  auto v4_any = start("0.0.0.0", &renders);
  ASSERT_TRUE(v4_any);
  EXPECT_EQ(get(v4_any->port(), "/metrics").rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_EQ(http_exchange("::1", v4_any->port(), "GET /metrics HTTP/1.0\r\n\r\n")
                .rfind("HTTP/1.1 200", 0),
            0u);
}

// A name listens on its addresses as gRPC does: "localhost" is reachable on 127.0.0.1 whether
// or not the hosts file lists ::1 for it first.
TEST(MetricsHttp, ANameListensOnItsAddresses) {
  std::atomic<int> renders{0};
  auto s = start("localhost", &renders);
  ASSERT_TRUE(s);
  EXPECT_EQ(get(s->port(), "/metrics").rfind("HTTP/1.1 200", 0), 0u);
}

TEST(MetricsHttp, AHostItCannotListenOnIsAnErrorNamingTheFlag) {
  std::atomic<int> renders{0};
  auto first = start("127.0.0.1", &renders);
  ASSERT_TRUE(first);
  auto again = MetricsHttpServer::start("127.0.0.1", first->port(), [] { return std::string(); });
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find(
                "--metrics-port " + std::to_string(first->port()) + ": cannot listen on 127.0.0.1"),
            std::string::npos)
      << again.status();
  auto nowhere = MetricsHttpServer::start("no.such.host.invalid", 0, [] { return std::string(); });
  ASSERT_FALSE(nowhere.ok());
  EXPECT_NE(nowhere.status().message().find(
                "--metrics-host (or --host) no.such.host.invalid: cannot listen on"),
            std::string::npos)
      << nowhere.status();
}

}  // namespace
}  // namespace cemlm::server
