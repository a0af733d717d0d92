// absl::Status -> grpc::Status and gRPC code names (see status_map.h): a cast, because both
// number their codes after google.rpc.Code.
#include "cemlm/server/status_map.h"

namespace cemlm::server {

grpc::Status to_grpc_status(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

std::string grpc_code_name(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

}  // namespace cemlm::server
