// The one place where engine statuses become gRPC statuses. absl and gRPC share the
// google.rpc.Code numbering, so the mapping is one-to-one by construction.
#pragma once
#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"

namespace cemlm::server {

grpc::Status to_grpc_status(const absl::Status& s);
// "INVALID_ARGUMENT", "CANCELLED", ...: the `code` label of cemlm:request_errors_total.
std::string grpc_code_name(grpc::StatusCode code);

}  // namespace cemlm::server
