// Generate calls read raw (see generate_stream.h), through the factories gRPC's generated stubs
// call, with a ByteBuffer for the response type.
#include "generate_stream.h"

#include <grpcpp/impl/rpc_method.h>

#include <string>
#include <vector>

#include "cemlm/v1/inference.grpc.pb.h"

namespace cemlm::cli {
namespace {

const std::string& generate_path() {
  static const std::string path =
      std::string("/") + v1::Inference::service_full_name() + "/Generate";
  return path;
}

grpc::internal::RpcMethod generate_method() {
  return grpc::internal::RpcMethod(generate_path().c_str(),
                                   grpc::internal::RpcMethod::SERVER_STREAMING);
}

}  // namespace

std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> generate_raw(grpc::Channel& channel,
                                                                   grpc::ClientContext* context,
                                                                   const v1::GenerateRequest& req) {
  return std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>>(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(&channel, generate_method(),
                                                                    context, req));
}

void generate_raw(grpc::Channel& channel, grpc::ClientContext* context,
                  const v1::GenerateRequest* req,
                  grpc::ClientReadReactor<grpc::ByteBuffer>* reactor) {
  grpc::internal::ClientCallbackReaderFactory<grpc::ByteBuffer>::Create(&channel, generate_method(),
                                                                        context, req, reactor);
}

bool parse_response(const grpc::ByteBuffer& raw, v1::GenerateResponse* out) {
  std::vector<grpc::Slice> slices;
  if (!raw.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out->ParseFromString(bytes);
}

grpc::Status unparsed_status() {
  return grpc::Status(grpc::StatusCode::INTERNAL,
                      "a message of the server's Generate stream does not parse as a "
                      "GenerateResponse (a text that is not UTF-8?); the call was cancelled. "
                      "Check that the server runs this client's version of the API");
}

}  // namespace cemlm::cli
