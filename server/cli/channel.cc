// Client connection helpers (see channel.h): plaintext or TLS channels, and the metadata and
// deadline every call carries.
#include "channel.h"

#include <grpc/support/log.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "cemlm/server/status_map.h"

namespace cemlm::cli {

void add_channel_flags(Flags* flags, ChannelFlags* f) {
  flags->add("addr", &f->addr, "server address HOST:PORT");
  flags->add("api-key", &f->api_key,
             "sent as 'authorization: Bearer KEY' (default: $CEMLM_API_KEY, which keeps the key "
             "out of the process list and the shell's history)");
  flags->add("tls-ca", &f->tls_ca, "PEM root certificate(s): connect with TLS, trusting these");
  flags->add("timeout", &f->timeout, "deadline of each call in seconds; 0 = none");
  flags->add("keepalive", &f->keepalive,
             "seconds between pings that find a server gone silent (the call then fails "
             "UNAVAILABLE about this much later); 0 = none; at least 1, as often as cemlm serve "
             "allows");
}

namespace {

// HOST:PORT with a port in [1, 65535] ([V6]:PORT for an IPv6 address), or a gRPC target given
// with its scheme (dns:///…, unix:…, ipv4:…), passed on as it is.
bool valid_addr(const std::string& a) {
  for (const char* scheme : {"dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:"})
    if (a.rfind(scheme, 0) == 0) return true;
  const size_t colon = a.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  const std::string host = a.substr(0, colon), port = a.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) < 1 ||
      std::stoi(port) > 65535)
    return false;
  if (host.front() == '[') return host.size() > 2 && host.back() == ']';
  return host.find(':') == std::string::npos;
}

bool tls_channel = false;  // whether make_channel made a TLS channel (report_error's hints)
const char* key_source = nullptr;  // where make_channel's key came from, if any (the same)

// gRPC's own error lines ("E1206 … ssl_transport_security.cc:1501] Handshake failed …") said on
// stderr what the call's status then says again, before cemlm's "error:" line: left out, unless
// GRPC_VERBOSITY or GRPC_TRACE asks for gRPC's lines.
void drop_grpc_line(gpr_log_func_args*) {}

std::string api_key(const ChannelFlags& f) {
  if (!f.api_key.empty()) return f.api_key;
  const char* env = std::getenv("CEMLM_API_KEY");
  return env ? env : "";
}

}  // namespace

std::shared_ptr<grpc::Channel> make_channel(const ChannelFlags& f, bool own_connection) {
  if (!valid_addr(f.addr)) {
    std::fprintf(stderr,
                 "error: --addr '%s' is not HOST:PORT (a port in [1, 65535]; [ADDR]:PORT for "
                 "IPv6, or a gRPC target such as dns:///HOST:PORT)\n",
                 f.addr.c_str());
    return nullptr;
  }
  // gRPC aborts the process on a header value it cannot send (a key read from a file with its
  // line's CR or LF, say): visible ASCII and spaces, as the server's key file takes.
  for (const unsigned char ch : api_key(f))
    if (ch < 0x20 || ch > 0x7e) {
      std::fprintf(stderr,
                   "error: %s holds a byte 0x%02x: a key is printable ASCII (a line end read "
                   "from a file?)\n",
                   f.api_key.empty() ? "CEMLM_API_KEY" : "--api-key", ch);
      return nullptr;
    }
  if (!(f.timeout >= 0) || !std::isfinite(f.timeout)) {
    std::fprintf(stderr, "error: --timeout %g must be a number of seconds >= 0 (0 = no deadline)\n",
                 f.timeout);
    return nullptr;
  }
  if (!(f.keepalive == 0 || (f.keepalive >= 1 && f.keepalive <= 86400))) {
    std::fprintf(stderr,
                 "error: --keepalive %g must be 0 (no pings) or seconds in [1, 86400] (cemlm serve "
                 "closes connections that ping more often than once a second)\n",
                 f.keepalive);
    return nullptr;
  }
  if (!std::getenv("GRPC_VERBOSITY") && !std::getenv("GRPC_TRACE"))
    gpr_set_log_function(drop_grpc_line);
  tls_channel = !f.tls_ca.empty();
  key_source = !f.api_key.empty() ? "--api-key" : api_key(f).empty() ? nullptr : "$CEMLM_API_KEY";
  grpc::ChannelArguments args;
  if (own_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  if (f.keepalive > 0) {
    const int ms = int(f.keepalive * 1e3);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ms);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms);
    // A streaming call's client sends nothing after its request, and gRPC stops pinging after
    // two pings without data sent, or spaces them 5 minutes apart with none received (a Score
    // computing): the silent server was not found.
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    args.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, ms);
  }
  if (f.tls_ca.empty())
    return grpc::CreateCustomChannel(f.addr, grpc::InsecureChannelCredentials(), args);
  std::ifstream in(f.tls_ca);
  if (!in) {
    std::fprintf(stderr, "error: --tls-ca: cannot read '%s'\n", f.tls_ca.c_str());
    return nullptr;
  }
  std::ostringstream pem;
  pem << in.rdbuf();
  if (pem.str().find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
    std::fprintf(stderr,
                 "error: --tls-ca: '%s' holds no PEM certificate (no '-----BEGIN "
                 "CERTIFICATE-----' line): give the CA certificate(s) that signed the server's\n",
                 f.tls_ca.c_str());
    return nullptr;
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = pem.str();
  return grpc::CreateCustomChannel(f.addr, grpc::SslCredentials(ssl), args);
}

void prepare_context(const ChannelFlags& f, grpc::ClientContext* context) {
  if (const std::string key = api_key(f); !key.empty())
    context->AddMetadata("authorization", "Bearer " + key);
  if (f.timeout > 0)
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::duration_cast<std::chrono::system_clock::duration>(
                              std::chrono::duration<double>(f.timeout)));
}

int report_error(const grpc::Status& status, bool answered) {
  // What the connection's failures mean for the flags (gRPC names only the TLS library's error).
  const std::string& m = status.error_message();
  std::string hint;
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    if (!tls_channel && !answered && m.find("Socket closed") != std::string::npos)
      hint = " (a server with TLS on closes plaintext connections: is --tls-ca missing?)";
    else if (tls_channel && m.find("wrong version number") != std::string::npos)
      hint = " (the server does not speak TLS: leave out --tls-ca)";
    else if (tls_channel && m.find("certificate verify failed") != std::string::npos)
      // (OpenSSL's words for a certificate out of its dates, too.)
      hint =
          " (the server's certificate is not signed by a --tls-ca certificate, or is out of its "
          "dates: expired, or not valid yet by this machine's clock)";
    else if (tls_channel && m.find("is not in peer certificate") != std::string::npos)
      hint =
          " (the server's certificate does not name the host of --addr: connect by a name or "
          "address it holds)";
    else if (m.find("keepalive watchdog timeout") != std::string::npos)
      hint = " (the server stopped answering: no reply to a ping within --keepalive seconds)";
  } else if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    hint = key_source ? std::string(" (the key sent, from ") + key_source +
                            ", is not one the server takes: is it a line of its --api-key-file?)"
                      : " (no key was sent: give one with --api-key, or in $CEMLM_API_KEY)";
  }
  std::fprintf(stderr, "error: %s: %s%s\n", server::grpc_code_name(status.error_code()).c_str(),
               in_flag_terms(m).c_str(), hint.c_str());
  return 1;
}

}  // namespace cemlm::cli
