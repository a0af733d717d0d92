// Generate's stream with each message parsed here, not by gRPC: when gRPC's own parse of a
// message fails (a text that is not UTF-8), its read ends as at the stream's end while the server
// goes on streaming, and the client then waited forever for a status behind the unread messages.
#pragma once
#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/client_callback.h>
#include <grpcpp/support/sync_stream.h>

#include <memory>

#include "cemlm/v1/inference.pb.h"

namespace cemlm::cli {

// Starts a Generate call whose responses are read as they came, for parse_response.
std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> generate_raw(grpc::Channel& channel,
                                                                   grpc::ClientContext* context,
                                                                   const v1::GenerateRequest& req);
// The same for a reactor; `req` must outlive the call. The reactor starts the call.
void generate_raw(grpc::Channel& channel, grpc::ClientContext* context,
                  const v1::GenerateRequest* req,
                  grpc::ClientReadReactor<grpc::ByteBuffer>* reactor);

// One response of such a call into *out; false when it does not parse. The caller then cancels
// the call (the server is streaming still) and ends with unparsed_status().
bool parse_response(const grpc::ByteBuffer& raw, v1::GenerateResponse* out);
grpc::Status unparsed_status();

}  // namespace cemlm::cli
