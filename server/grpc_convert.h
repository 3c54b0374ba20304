// The one place where refitd translates between core and the wire: proto
// messages <-> core types, and absl::Status -> grpc::Status. Everything in
// server/ that answers an RPC goes through these functions, so a status code
// chosen in core reaches the client unchanged. Pure functions; thread-safe.
#ifndef REFIT_SERVER_GRPC_CONVERT_H_
#define REFIT_SERVER_GRPC_CONVERT_H_

#include <cstdint>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"
#include "refit/v1/refit.pb.h"

namespace refit::server {

// Same code, same message. The daemon never turns a grpc::Status back into
// an absl::Status; the client library has that mapping of its own.
grpc::Status ToGrpcStatus(const absl::Status& status);

// INVALID_ARGUMENT naming `tensor_name` for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<core::DType> FromProtoDType(v1::DType dtype, absl::string_view tensor_name);
// DTYPE_UNSPECIFIED for core types the API does not name.
v1::DType ToProtoDType(core::DType dtype);

// The core options of a refit plus whether it stops at PREPARED.
// INVALID_ARGUMENT for COMPLETION_MODE_UNSPECIFIED or NON_FINITE_POLICY_UNSPECIFIED
// (and unknown enum values).
struct ConvertedRefitOptions {
  core::RefitOptions core;
  bool prepare_only = false;
  std::string label;
  // RefitOptions.fleet_refit_id: one member's part of a fleet refit
  // (server/fleet_member.h); only with COMPLETION_MODE_PREPARE.
  std::string fleet_refit_id;
};
absl::StatusOr<ConvertedRefitOptions> FromProtoRefitOptions(const v1::RefitOptions& options,
                                                            int64_t staging_budget_bytes);

v1::RefitState ToProtoState(core::SessionState state);
void ToProtoResult(const core::RefitResult& result, v1::RefitState state, v1::RefitResult* out);
void ToProtoProgress(const core::SessionProgress& progress, v1::Progress* out);
void ToProtoEvent(const core::StoreEvent& event, v1::WatchEvent* out);
// The one place a TensorInfo is filled: a kernel as the store holds it, or a
// checkpoint tensor as the layout expects it (ignored names are optional).
void ToProtoTensorInfo(const core::KernelView& kernel, const core::ModelLayout& layout,
                       v1::TensorInfo* out);
void ToProtoTensorInfo(const core::CheckpointTensor& tensor, const core::ModelLayout& layout,
                       v1::TensorInfo* out);
double UnixSecondsOf(absl::Time time);

}  // namespace refit::server

#endif  // REFIT_SERVER_GRPC_CONVERT_H_
