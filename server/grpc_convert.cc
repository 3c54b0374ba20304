#include "server/grpc_convert.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/text.h"

namespace refit::server {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::StatusOr<core::DType> FromProtoDType(v1::DType dtype, absl::string_view tensor_name) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return core::DType::kFloat32;
    case v1::DTYPE_F16:
      return core::DType::kFloat16;
    case v1::DTYPE_BF16:
      return core::DType::kBFloat16;
    case v1::DTYPE_F8_E4M3:
      return core::DType::kFloat8E4M3;
    case v1::DTYPE_I64:
      return core::DType::kInt64;
    case v1::DTYPE_I32:
      return core::DType::kInt32;
    case v1::DTYPE_U8:
      return core::DType::kUInt8;
    case v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", tensor_name, ": dtype is DTYPE_UNSPECIFIED"));
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tensor ", tensor_name, ": unknown dtype value ", static_cast<int>(dtype)));
}

v1::DType ToProtoDType(core::DType dtype) {
  switch (dtype) {
    case core::DType::kFloat32:
      return v1::DTYPE_F32;
    case core::DType::kFloat16:
      return v1::DTYPE_F16;
    case core::DType::kBFloat16:
      return v1::DTYPE_BF16;
    case core::DType::kFloat8E4M3:
      return v1::DTYPE_F8_E4M3;
    case core::DType::kInt64:
      return v1::DTYPE_I64;
    case core::DType::kInt32:
      return v1::DTYPE_I32;
    case core::DType::kUInt8:
      return v1::DTYPE_U8;
    default:
      return v1::DTYPE_UNSPECIFIED;
  }
}

absl::StatusOr<ConvertedRefitOptions> FromProtoRefitOptions(const v1::RefitOptions& options,
                                                            int64_t staging_budget_bytes) {
  ConvertedRefitOptions out;
  switch (options.completion()) {
    case v1::COMPLETION_MODE_COMMIT:
      out.prepare_only = false;
      break;
    case v1::COMPLETION_MODE_PREPARE:
      out.prepare_only = true;
      break;
    case v1::COMPLETION_MODE_UNSPECIFIED:
      return absl::InvalidArgumentError(
          "options.completion is COMPLETION_MODE_UNSPECIFIED; use COMPLETION_MODE_COMMIT or "
          "COMPLETION_MODE_PREPARE");
    default:
      return absl::InvalidArgumentError(absl::StrCat("options.completion: unknown value ",
                                                     static_cast<int>(options.completion())));
  }
  switch (options.non_finite()) {
    case v1::NON_FINITE_POLICY_REJECT:
      out.core.non_finite = core::NonFinitePolicy::kReject;
      break;
    case v1::NON_FINITE_POLICY_VLLM_COMPATIBLE:
      out.core.non_finite = core::NonFinitePolicy::kVllmCompatible;
      break;
    case v1::NON_FINITE_POLICY_UNSPECIFIED:
      return absl::InvalidArgumentError(
          "options.non_finite is NON_FINITE_POLICY_UNSPECIFIED; use NON_FINITE_POLICY_REJECT or "
          "NON_FINITE_POLICY_VLLM_COMPATIBLE");
    default:
      return absl::InvalidArgumentError(absl::StrCat("options.non_finite: unknown value ",
                                                     static_cast<int>(options.non_finite())));
  }
  if (options.has_base_version()) out.core.base_version = options.base_version();
  out.core.allow_partial_layers = options.allow_partial_layers();
  out.core.require_complete = options.require_complete();
  out.core.staging_budget_bytes = staging_budget_bytes;
  out.label = options.label();
  out.core.label = out.label;
  if (!options.fleet_refit_id().empty()) {
    const std::string& id = options.fleet_refit_id();
    if (!out.prepare_only) {
      return absl::InvalidArgumentError(
          "options.fleet_refit_id needs COMPLETION_MODE_PREPARE: a fleet refit commits when the "
          "fleet decides, not at End");
    }
    if (id.size() > 128 || !std::all_of(id.begin(), id.end(), [](char c) {
          return absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.';
        })) {
      return absl::InvalidArgumentError(absl::StrCat("options.fleet_refit_id ", core::QuoteText(id),
                                                     ": up to 128 characters of [A-Za-z0-9._-]"));
    }
    out.fleet_refit_id = id;
  }
  return out;
}

v1::RefitState ToProtoState(core::SessionState state) {
  switch (state) {
    case core::SessionState::kReceiving:
      return v1::REFIT_STATE_RECEIVING;
    case core::SessionState::kPrepared:
      return v1::REFIT_STATE_PREPARED;
    case core::SessionState::kCommitted:
      return v1::REFIT_STATE_COMMITTED;
    case core::SessionState::kAborted:
      return v1::REFIT_STATE_ABORTED;
  }
  return v1::REFIT_STATE_UNSPECIFIED;
}

void ToProtoResult(const core::RefitResult& result, v1::RefitState state, v1::RefitResult* out) {
  out->set_refit_id(result.refit_id);
  out->set_state(state);
  out->set_version(result.version);
  out->set_fingerprint(result.fingerprint);
  for (const std::string& layer : result.kept_layers) out->add_kept_layers(layer);
  for (const std::string& layer : result.partial_layers) out->add_partial_layers(layer);
  v1::PhaseTimings* t = out->mutable_timings();
  t->set_receive_seconds(absl::ToDoubleSeconds(result.timings.receive));
  t->set_quantize_seconds(absl::ToDoubleSeconds(result.timings.quantize));
  t->set_finalize_seconds(absl::ToDoubleSeconds(result.timings.finalize));
  t->set_commit_seconds(absl::ToDoubleSeconds(result.timings.commit));
  out->set_bytes_received(static_cast<uint64_t>(result.bytes_received));
  out->set_peak_staging_bytes(static_cast<uint64_t>(result.peak_staging_bytes));
  out->set_unchanged(result.unchanged);
  out->set_bytes_read_in_place(static_cast<uint64_t>(result.bytes_read_in_place));
  out->set_scales_reused(static_cast<uint64_t>(result.scales_reused));
}

void ToProtoProgress(const core::SessionProgress& progress, v1::Progress* out) {
  out->set_refit_id(progress.refit_id);
  out->set_state(ToProtoState(progress.state));
  out->set_bytes_received(static_cast<uint64_t>(progress.bytes_received));
  out->set_elements_loaded(static_cast<uint64_t>(progress.elements_loaded));
  out->set_elements_expected(static_cast<uint64_t>(progress.elements_expected));
  out->set_layers_done(static_cast<uint32_t>(progress.layers_done));
  out->set_layers_total(static_cast<uint32_t>(progress.layers_total));
  out->set_staging_bytes(static_cast<uint64_t>(progress.staging_bytes));
}

double UnixSecondsOf(absl::Time time) {
  if (time == absl::InfinitePast() || time == absl::UnixEpoch()) return 0;
  return absl::ToDoubleSeconds(time - absl::UnixEpoch());
}

void ToProtoEvent(const core::StoreEvent& event, v1::WatchEvent* out) {
  switch (event.type) {
    case core::StoreEventType::kStagingStarted:
      out->set_type(v1::WatchEvent::TYPE_STAGING_STARTED);
      break;
    case core::StoreEventType::kPrepared:
      out->set_type(v1::WatchEvent::TYPE_PREPARED);
      break;
    case core::StoreEventType::kCommitted:
      out->set_type(v1::WatchEvent::TYPE_COMMITTED);
      break;
    case core::StoreEventType::kAborted:
      out->set_type(v1::WatchEvent::TYPE_ABORTED);
      break;
  }
  out->set_model_group(event.group);
  out->set_refit_id(event.refit_id);
  out->set_version(event.version);
  out->set_fingerprint(event.fingerprint);
  out->set_message(event.message);
  out->set_unix_seconds(UnixSecondsOf(event.time));
}

void ToProtoTensorInfo(const core::KernelView& kernel, const core::ModelLayout& layout,
                       v1::TensorInfo* out) {
  out->set_name(kernel.spec->name);
  out->set_dtype(ToProtoDType(kernel.spec->dtype));
  for (int64_t d : kernel.spec->shape) out->add_shape(d);
  out->set_nbytes(static_cast<uint64_t>(kernel.nbytes));
  if (kernel.layer >= 0 && kernel.layer < static_cast<int>(layout.layers().size())) {
    out->set_layer(layout.layers()[kernel.layer].name);
  }
}

void ToProtoTensorInfo(const core::CheckpointTensor& tensor, const core::ModelLayout& layout,
                       v1::TensorInfo* out) {
  out->set_name(tensor.name);
  out->set_dtype(ToProtoDType(tensor.dtype));
  for (int64_t d : tensor.shape) out->add_shape(d);
  out->set_nbytes(static_cast<uint64_t>(tensor.nbytes()));
  const bool ignored = tensor.use == core::CheckpointTensor::Use::kIgnored;
  if (!ignored && tensor.layer >= 0 && tensor.layer < static_cast<int>(layout.layers().size())) {
    out->set_layer(layout.layers()[tensor.layer].name);
  }
  out->set_optional(tensor.optional || ignored);
}

}  // namespace refit::server
