// What `cemlm client` and `cemlm bench-serve` share: the connection flags (--addr, --api-key,
// --tls-ca, --timeout), the channel they describe and the per-call context.
#pragma once
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include <memory>
#include <string>

#include "cemlm/cli/flags.h"

namespace cemlm::cli {

struct ChannelFlags {
  std::string addr = "localhost:50051";
  std::string api_key;
  std::string tls_ca;  // PEM root certificates: connect with TLS
  double timeout = 0;  // seconds per call; 0 = none
  // Seconds between the keepalive pings that find a server gone silent (stopped, its host lost)
  // on a call waiting for it; 0 = none (such a call waited forever without --timeout).
  double keepalive = 10;
};

void add_channel_flags(Flags* flags, ChannelFlags* f);
// Null (with a message on stderr) when --addr is not HOST:PORT, the API key holds a byte a
// header cannot, or --tls-ca cannot be read. With `own_connection` the channel
// opens a TCP connection of its own instead of sharing one with the process's other channels to
// the same address.
std::shared_ptr<grpc::Channel> make_channel(const ChannelFlags& f, bool own_connection = false);
// Authorization metadata and deadline of one call.
void prepare_context(const ChannelFlags& f, grpc::ClientContext* context);
// "error: INVALID_ARGUMENT: message" on stderr, the request fields it names said as the flags
// that set them (in_flag_terms); returns 1. `answered`: the call had a message from the server,
// so the connection's own failures (TLS on one end only) are not what ended it.
int report_error(const grpc::Status& status, bool answered = false);

}  // namespace cemlm::cli
