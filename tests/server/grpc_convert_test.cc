// The conversions between the wire and core: status mapping, dtypes, refit
// options (every UNSPECIFIED or unknown enum is rejected with its field
// named), and the proto forms of results, progress, store events and tensor
// descriptions.
#include "server/grpc_convert.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/time.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"

namespace refit::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(GrpcConvertTest, ToGrpcStatusKeepsEveryCodeAndTheMessage) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const std::vector<std::pair<absl::StatusCode, grpc::StatusCode>> codes = {
      {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
      {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
      {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
      {absl::StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
      {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
      {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
      {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
      {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
      {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
  };
  for (const auto& [absl_code, grpc_code] : codes) {
    const grpc::Status status = ToGrpcStatus(absl::Status(absl_code, "tensor w: shape [2, 3]"));
    EXPECT_EQ(status.error_code(), grpc_code) << absl::StatusCodeToString(absl_code);
    EXPECT_EQ(status.error_message(), "tensor w: shape [2, 3]");
  }
}

TEST(GrpcConvertTest, DTypesRoundTripForEveryTypeTheApiNames) {
  const std::vector<std::pair<v1::DType, core::DType>> types = {
      {v1::DTYPE_F32, core::DType::kFloat32},   {v1::DTYPE_F16, core::DType::kFloat16},
      {v1::DTYPE_BF16, core::DType::kBFloat16}, {v1::DTYPE_F8_E4M3, core::DType::kFloat8E4M3},
      {v1::DTYPE_I64, core::DType::kInt64},     {v1::DTYPE_I32, core::DType::kInt32},
      {v1::DTYPE_U8, core::DType::kUInt8},
  };
  for (const auto& [proto, core_type] : types) {
    absl::StatusOr<core::DType> converted = FromProtoDType(proto, "w");
    ASSERT_TRUE(converted.ok()) << converted.status();
    EXPECT_EQ(*converted, core_type) << v1::DType_Name(proto);
    EXPECT_EQ(ToProtoDType(core_type), proto) << v1::DType_Name(proto);
  }
}

TEST(GrpcConvertTest, UnspecifiedDTypeIsInvalidArgumentNamingTheTensor) {
  absl::StatusOr<core::DType> converted =
      FromProtoDType(v1::DTYPE_UNSPECIFIED, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(converted.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(converted.status().message(), HasSubstr("model.layers.0.mlp.up_proj.weight"));
  EXPECT_THAT(converted.status().message(), HasSubstr("DTYPE_UNSPECIFIED"));
}

TEST(GrpcConvertTest, UnknownDTypeValueIsInvalidArgumentNamingTheValue) {
  absl::StatusOr<core::DType> converted = FromProtoDType(static_cast<v1::DType>(42), "w");
  EXPECT_EQ(converted.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(converted.status().message(), HasSubstr("tensor w"));
  EXPECT_THAT(converted.status().message(), HasSubstr("unknown dtype value 42"));
}

TEST(GrpcConvertTest, CoreTypesTheApiDoesNotNameBecomeUnspecified) {
  for (core::DType dtype : {core::DType::kBool, core::DType::kInt8, core::DType::kFloat8E5M2,
                            core::DType::kFloat64, core::DType::kUInt64}) {
    EXPECT_EQ(ToProtoDType(dtype), v1::DTYPE_UNSPECIFIED) << core::DTypeName(dtype);
  }
}

v1::RefitOptions ValidOptions() {
  v1::RefitOptions options;
  options.set_completion(v1::COMPLETION_MODE_COMMIT);
  options.set_non_finite(v1::NON_FINITE_POLICY_REJECT);
  return options;
}

TEST(GrpcConvertTest, RefitOptionsCarryEveryField) {
  v1::RefitOptions options = ValidOptions();
  options.set_completion(v1::COMPLETION_MODE_PREPARE);
  options.set_non_finite(v1::NON_FINITE_POLICY_VLLM_COMPATIBLE);
  options.set_base_version(7);
  options.set_allow_partial_layers(true);
  options.set_label("step 1200");
  absl::StatusOr<ConvertedRefitOptions> converted =
      FromProtoRefitOptions(options, /*staging_budget_bytes=*/1 << 20);
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_TRUE(converted->prepare_only);
  EXPECT_EQ(converted->label, "step 1200");
  EXPECT_EQ(converted->core.non_finite, core::NonFinitePolicy::kVllmCompatible);
  EXPECT_EQ(converted->core.base_version, std::optional<uint64_t>(7));
  EXPECT_TRUE(converted->core.allow_partial_layers);
  EXPECT_EQ(converted->core.staging_budget_bytes, 1 << 20);
  EXPECT_EQ(converted->core.refit_id, "");  // the session generates it
}

TEST(GrpcConvertTest, RefitOptionsWithoutBaseVersionLeaveItUnset) {
  absl::StatusOr<ConvertedRefitOptions> converted = FromProtoRefitOptions(ValidOptions(), 4096);
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_FALSE(converted->prepare_only);
  EXPECT_EQ(converted->core.non_finite, core::NonFinitePolicy::kReject);
  EXPECT_FALSE(converted->core.base_version.has_value());
  EXPECT_FALSE(converted->core.allow_partial_layers);
  // base_version 0 is a real version (the empty store), not "unset".
  v1::RefitOptions zero = ValidOptions();
  zero.set_base_version(0);
  converted = FromProtoRefitOptions(zero, 4096);
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_EQ(converted->core.base_version, std::optional<uint64_t>(0));
}

TEST(GrpcConvertTest, FleetRefitIdNeedsPrepareAndAPlainId) {
  v1::RefitOptions options = ValidOptions();
  options.set_fleet_refit_id("fleet-20261201-abc");
  absl::Status commit = FromProtoRefitOptions(options, 4096).status();
  EXPECT_EQ(commit.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(commit.message(), ::testing::HasSubstr("COMPLETION_MODE_PREPARE"));
  options.set_completion(v1::COMPLETION_MODE_PREPARE);
  absl::StatusOr<ConvertedRefitOptions> converted = FromProtoRefitOptions(options, 4096);
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_EQ(converted->fleet_refit_id, "fleet-20261201-abc");
  options.set_fleet_refit_id("../decisions/x");
  absl::Status odd = FromProtoRefitOptions(options, 4096).status();
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(odd.message(), ::testing::HasSubstr("fleet_refit_id"));
}

TEST(GrpcConvertTest, UnspecifiedOrUnknownEnumsInRefitOptionsAreInvalidArgument) {
  struct Case {
    std::string name;
    v1::RefitOptions options;
    std::vector<std::string> fragments;
  };
  std::vector<Case> cases;
  {
    v1::RefitOptions o = ValidOptions();
    o.set_completion(v1::COMPLETION_MODE_UNSPECIFIED);
    cases.push_back({"completion unspecified",
                     o,
                     {"options.completion is COMPLETION_MODE_UNSPECIFIED", "COMPLETION_MODE_COMMIT",
                      "COMPLETION_MODE_PREPARE"}});
  }
  {
    v1::RefitOptions o = ValidOptions();
    o.set_completion(static_cast<v1::CompletionMode>(9));
    cases.push_back({"completion unknown", o, {"options.completion: unknown value 9"}});
  }
  {
    v1::RefitOptions o = ValidOptions();
    o.set_non_finite(v1::NON_FINITE_POLICY_UNSPECIFIED);
    cases.push_back({"non_finite unspecified",
                     o,
                     {"options.non_finite is NON_FINITE_POLICY_UNSPECIFIED",
                      "NON_FINITE_POLICY_REJECT", "NON_FINITE_POLICY_VLLM_COMPATIBLE"}});
  }
  {
    v1::RefitOptions o = ValidOptions();
    o.set_non_finite(static_cast<v1::NonFinitePolicy>(5));
    cases.push_back({"non_finite unknown", o, {"options.non_finite: unknown value 5"}});
  }
  // A default-constructed message: completion is checked first.
  cases.push_back({"empty options", v1::RefitOptions(), {"options.completion"}});
  for (const Case& c : cases) {
    absl::StatusOr<ConvertedRefitOptions> converted = FromProtoRefitOptions(c.options, 4096);
    EXPECT_EQ(converted.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    for (const std::string& fragment : c.fragments) {
      EXPECT_THAT(converted.status().message(), HasSubstr(fragment)) << c.name;
    }
  }
}

TEST(GrpcConvertTest, SessionStatesMapToRefitStates) {
  EXPECT_EQ(ToProtoState(core::SessionState::kReceiving), v1::REFIT_STATE_RECEIVING);
  EXPECT_EQ(ToProtoState(core::SessionState::kPrepared), v1::REFIT_STATE_PREPARED);
  EXPECT_EQ(ToProtoState(core::SessionState::kCommitted), v1::REFIT_STATE_COMMITTED);
  EXPECT_EQ(ToProtoState(core::SessionState::kAborted), v1::REFIT_STATE_ABORTED);
}

TEST(GrpcConvertTest, ResultCarriesEveryFieldInSeconds) {
  core::RefitResult result;
  result.refit_id = "r-1";
  result.version = 12;
  result.fingerprint = "0123456789abcdef";
  result.kept_layers = {"model.layers.1"};
  result.partial_layers = {"model.layers.2", "model.layers.3"};
  result.timings.receive = absl::Milliseconds(1500);
  result.timings.quantize = absl::Milliseconds(250);
  result.timings.finalize = absl::Milliseconds(125);
  result.timings.commit = absl::Microseconds(500);
  result.bytes_received = int64_t{5} << 30;
  result.peak_staging_bytes = 3 << 20;
  v1::RefitResult out;
  ToProtoResult(result, v1::REFIT_STATE_PREPARED, &out);
  EXPECT_EQ(out.refit_id(), "r-1");
  EXPECT_EQ(out.state(), v1::REFIT_STATE_PREPARED);
  EXPECT_EQ(out.version(), 12u);
  EXPECT_EQ(out.fingerprint(), "0123456789abcdef");
  EXPECT_THAT(out.kept_layers(), ElementsAre("model.layers.1"));
  EXPECT_THAT(out.partial_layers(), ElementsAre("model.layers.2", "model.layers.3"));
  EXPECT_DOUBLE_EQ(out.timings().receive_seconds(), 1.5);
  EXPECT_DOUBLE_EQ(out.timings().quantize_seconds(), 0.25);
  EXPECT_DOUBLE_EQ(out.timings().finalize_seconds(), 0.125);
  EXPECT_DOUBLE_EQ(out.timings().commit_seconds(), 0.0005);
  EXPECT_EQ(out.bytes_received(), uint64_t{5} << 30);
  EXPECT_EQ(out.peak_staging_bytes(), 3u << 20);
}

TEST(GrpcConvertTest, ProgressCarriesEveryField) {
  core::SessionProgress progress;
  progress.refit_id = "r-2";
  progress.state = core::SessionState::kReceiving;
  progress.bytes_received = 1000;
  progress.elements_loaded = 400;
  progress.elements_expected = 800;
  progress.layers_done = 3;
  progress.layers_total = 9;
  progress.staging_bytes = 2048;
  v1::Progress out;
  ToProtoProgress(progress, &out);
  EXPECT_EQ(out.refit_id(), "r-2");
  EXPECT_EQ(out.state(), v1::REFIT_STATE_RECEIVING);
  EXPECT_EQ(out.bytes_received(), 1000u);
  EXPECT_EQ(out.elements_loaded(), 400u);
  EXPECT_EQ(out.elements_expected(), 800u);
  EXPECT_EQ(out.layers_done(), 3u);
  EXPECT_EQ(out.layers_total(), 9u);
  EXPECT_EQ(out.staging_bytes(), 2048u);
}

TEST(GrpcConvertTest, StoreEventsMapToWatchEvents) {
  const std::vector<std::pair<core::StoreEventType, v1::WatchEvent::Type>> types = {
      {core::StoreEventType::kStagingStarted, v1::WatchEvent::TYPE_STAGING_STARTED},
      {core::StoreEventType::kPrepared, v1::WatchEvent::TYPE_PREPARED},
      {core::StoreEventType::kCommitted, v1::WatchEvent::TYPE_COMMITTED},
      {core::StoreEventType::kAborted, v1::WatchEvent::TYPE_ABORTED},
  };
  for (const auto& [core_type, proto_type] : types) {
    core::StoreEvent event;
    event.type = core_type;
    event.group = "target";
    event.refit_id = "r-3";
    event.version = 4;
    event.fingerprint = "fedcba9876543210";
    event.message = "aborted by operator";
    event.time = absl::FromUnixMillis(1700000000250);
    v1::WatchEvent out;
    ToProtoEvent(event, &out);
    EXPECT_EQ(out.type(), proto_type) << v1::WatchEvent::Type_Name(proto_type);
    EXPECT_EQ(out.model_group(), "target");
    EXPECT_EQ(out.refit_id(), "r-3");
    EXPECT_EQ(out.version(), 4u);
    EXPECT_EQ(out.fingerprint(), "fedcba9876543210");
    EXPECT_EQ(out.message(), "aborted by operator");
    EXPECT_DOUBLE_EQ(out.unix_seconds(), 1700000000.25);
  }
}

std::shared_ptr<const core::ModelLayout> FixtureLayout() {
  absl::StatusOr<std::shared_ptr<const core::ModelLayout>> layout =
      core::ModelLayout::Build(core::FixtureConfig(), {}, core::QuantScheme::kPerTensor);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(layout) : nullptr;
}

TEST(GrpcConvertTest, KernelTensorInfoNamesItsLayer) {
  std::shared_ptr<const core::ModelLayout> layout = FixtureLayout();
  ASSERT_NE(layout, nullptr);
  ASSERT_GE(layout->layers().size(), 2u);
  core::KernelSpec spec;
  spec.name = "model.layers.0.mlp.down_proj.weight";
  spec.dtype = core::DType::kFloat8E4M3;
  spec.shape = {64, 128};
  core::KernelView kernel;
  kernel.spec = &spec;
  kernel.layer = 1;
  kernel.nbytes = 64 * 128;
  v1::TensorInfo info;
  ToProtoTensorInfo(kernel, *layout, &info);
  EXPECT_EQ(info.name(), "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(info.dtype(), v1::DTYPE_F8_E4M3);
  EXPECT_THAT(info.shape(), ElementsAre(64, 128));
  EXPECT_EQ(info.nbytes(), 64u * 128u);
  EXPECT_EQ(info.layer(), layout->layers()[1].name);
  EXPECT_FALSE(info.optional());

  // A layer index outside the layout leaves the layer empty.
  kernel.layer = -1;
  v1::TensorInfo unplaced;
  ToProtoTensorInfo(kernel, *layout, &unplaced);
  EXPECT_EQ(unplaced.layer(), "");
}

TEST(GrpcConvertTest, CheckpointTensorInfoMarksIgnoredNamesOptional) {
  std::shared_ptr<const core::ModelLayout> layout = FixtureLayout();
  ASSERT_NE(layout, nullptr);
  core::CheckpointTensor target;
  target.name = "model.layers.0.self_attn.k_scale";
  target.dtype = core::DType::kFloat32;
  target.shape = {};
  target.layer = 0;
  target.optional = true;
  v1::TensorInfo info;
  ToProtoTensorInfo(target, *layout, &info);
  EXPECT_EQ(info.name(), "model.layers.0.self_attn.k_scale");
  EXPECT_EQ(info.dtype(), v1::DTYPE_F32);
  EXPECT_TRUE(info.shape().empty());
  EXPECT_EQ(info.nbytes(), 4u);
  EXPECT_EQ(info.layer(), layout->layers()[0].name);
  EXPECT_TRUE(info.optional());

  core::CheckpointTensor ignored;
  ignored.name = "model.layers.0.self_attn.rotary_emb.inv_freq";
  ignored.dtype = core::DType::kFloat32;
  ignored.shape = {32};
  ignored.use = core::CheckpointTensor::Use::kIgnored;
  ignored.layer = 0;  // never reported for an ignored name
  v1::TensorInfo dropped;
  ToProtoTensorInfo(ignored, *layout, &dropped);
  EXPECT_EQ(dropped.nbytes(), 32u * 4u);
  EXPECT_EQ(dropped.layer(), "");
  EXPECT_TRUE(dropped.optional()) << "an ignored name may be absent from a checkpoint";
}

TEST(GrpcConvertTest, UnixSecondsOfANeverSetTimeIsZero) {
  EXPECT_EQ(UnixSecondsOf(absl::InfinitePast()), 0);
  EXPECT_EQ(UnixSecondsOf(absl::UnixEpoch()), 0);
  EXPECT_DOUBLE_EQ(UnixSecondsOf(absl::FromUnixSeconds(86400)), 86400.0);
}

}  // namespace
}  // namespace refit::server
