// refitctl verify against a RefitService that serves a real core ShardStore
// loaded with core's own RefitSession: verify's independent re-computation
// (slices, FP8 quantization, attention scales, fingerprint) must agree with
// the daemon's pipeline byte for byte, and must notice other weights.
#include "client/verify.h"

#include <ftw.h>
#include <grpcpp/grpcpp.h>
#include <stdlib.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/refit_client.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/safetensors.h"
#include "core/safetensors_ingest.h"
#include "core/shard_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "refit/v1/refit.grpc.pb.h"
#include "tests/client/fake_refit_service.h"

namespace refit::client {
namespace {

using ::testing::HasSubstr;

// GetStatus and ReadTensor straight from a ShardStore.
class StoreBackedService final : public refit::v1::RefitService::Service {
 public:
  explicit StoreBackedService(core::ShardStore* store) : store_(store) {}

  grpc::Status GetStatus(grpc::ServerContext*, const refit::v1::GetStatusRequest*,
                         refit::v1::GetStatusResponse* response) override {
    response->set_version(store_->version());
    response->set_fingerprint(store_->fingerprint());
    response->mutable_model()->set_tp_rank(store_->layout().parallel().tp_rank);
    response->mutable_model()->set_tp_size(store_->layout().parallel().tp_size);
    response->mutable_model()->set_quantization(
        std::string(core::QuantSchemeName(store_->layout().quant())));
    response->mutable_model()->set_architecture(store_->layout().config().arch_name);
    response->mutable_model()->set_num_layers(store_->layout().config().num_layers);
    return grpc::Status::OK;
  }

  // The checkpoint layout, as refitd lists it (ignored names have no layer).
  grpc::Status ListTensors(grpc::ServerContext*, const refit::v1::ListTensorsRequest*,
                           refit::v1::ListTensorsResponse* response) override {
    const core::ModelLayout& layout = store_->layout();
    for (const core::CheckpointTensor& t : layout.checkpoint_tensors()) {
      refit::v1::TensorInfo* info = response->add_tensors();
      info->set_name(t.name);
      info->set_dtype(t.dtype == core::DType::kFloat32   ? refit::v1::DTYPE_F32
                      : t.dtype == core::DType::kFloat16 ? refit::v1::DTYPE_F16
                                                         : refit::v1::DTYPE_BF16);
      for (int64_t d : t.shape) info->add_shape(d);
      if (t.use == core::CheckpointTensor::Use::kTarget) {
        info->set_layer(layout.layers()[t.layer].name);
      }
    }
    return grpc::Status::OK;
  }

  grpc::Status ReadTensor(grpc::ServerContext*, const refit::v1::ReadTensorRequest* request,
                          grpc::ServerWriter<refit::v1::ReadTensorResponse>* writer) override {
    std::string bytes;
    uint64_t version = 0;
    absl::Status read = store_->ReadKernel(request->name(), &bytes, &version);
    if (!read.ok()) {
      return grpc::Status(static_cast<grpc::StatusCode>(read.code()), std::string(read.message()));
    }
    refit::v1::ReadTensorResponse response;
    response.mutable_info()->set_name(request->name());
    response.mutable_info()->set_nbytes(bytes.size());
    response.set_version(version);
    // As the daemon does: the version's fingerprint, which the client checks
    // against the pin verify sends.
    response.set_fingerprint(store_->fingerprint());
    response.set_data(bytes);
    writer->Write(response);
    return grpc::Status::OK;
  }

 private:
  core::ShardStore* store_;
};

class VerifyTest : public ::testing::TestWithParam<core::QuantScheme> {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/refit_verify_test_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    config_ = core::FixtureConfig();
    auto layout = core::ModelLayout::Build(config_, core::ParallelConfig{}, GetParam());
    ASSERT_TRUE(layout.ok()) << layout.status();
    auto store = core::ShardStore::Create(*layout, core::ShardStoreOptions{});
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    service_ = std::make_unique<StoreBackedService>(store_.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ClientOptions options;
    options.address = absl::StrCat("127.0.0.1:", port_);
    client_ = *RefitClient::Create(options);
  }

  void TearDown() override {
    server_->Shutdown();
    ::nftw(
        dir_.c_str(),
        [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 8,
        FTW_DEPTH | FTW_PHYS);
  }

  // Writes the fixture with `seed`; returns its safetensors files.
  std::vector<std::string> Weights(int seed) {
    std::string out = absl::StrCat(dir_, "/w", seed);
    EXPECT_TRUE(core::WriteFixtureModel(out, config_, seed).ok());
    auto files = core::ListSafetensorsFiles(out);
    EXPECT_TRUE(files.ok()) << files.status();
    return *files;
  }

  void Load(const std::vector<std::string>& files) {
    auto result = core::LoadSafetensors(store_.get(), files, core::RefitOptions{});
    ASSERT_TRUE(result.ok()) << result.status();
  }

  std::string dir_;
  core::ModelConfig config_;
  std::unique_ptr<core::ShardStore> store_;
  std::unique_ptr<StoreBackedService> service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<RefitClient> client_;
};

TEST_P(VerifyTest, MatchesWhatTheSessionCommitted) {
  std::vector<std::string> files = Weights(2);
  Load(files);
  VerifyOptions options;
  options.files = files;
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  ASSERT_TRUE(report.ok()) << report.status();
  for (const VerifyEntry& e : report->entries) {
    EXPECT_EQ(e.state, VerifyEntry::State::kMatch) << e.name << ": " << e.detail;
  }
  EXPECT_EQ(report->mismatched, 0);
  EXPECT_EQ(report->skipped, 0);
  EXPECT_EQ(report->matched, static_cast<int>(store_->layout().num_kernels()));
  EXPECT_TRUE(report->problems.empty());
  EXPECT_EQ(report->expected_fingerprint, store_->fingerprint());
  EXPECT_TRUE(report->ok());
}

TEST_P(VerifyTest, ReportsMismatchesForOtherWeights) {
  Load(Weights(2));
  VerifyOptions options;
  options.files = Weights(3);
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_GT(report->mismatched, 0);
  EXPECT_FALSE(report->fingerprint_match());
  EXPECT_FALSE(report->ok());
  bool described = false;
  for (const VerifyEntry& e : report->entries) {
    if (e.state == VerifyEntry::State::kMismatch) {
      described |= absl::StrContains(e.detail, "bytes differ, first at byte");
    }
  }
  EXPECT_TRUE(described);
}

TEST_P(VerifyTest, SkipsLayersTheFilesDoNotHold) {
  std::vector<std::string> files = Weights(2);
  Load(files);
  VerifyOptions options;
  options.files = {files.front()};  // only the first of two files
  options.config_path = dir_ + "/w2/config.json";
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->mismatched, 0);
  EXPECT_GT(report->matched, 0);
  // Layers split across the two files are incomplete in one; they are
  // skipped and the daemon's own bytes stand in for the fingerprint.
  if (report->skipped > 0) {
    EXPECT_TRUE(report->fingerprint_match());
  }
}

TEST_P(VerifyTest, InfersTheLayoutFromTheDaemonWithoutConfigJson) {
  std::vector<std::string> files = Weights(2);
  Load(files);
  ASSERT_EQ(::remove((dir_ + "/w2/config.json").c_str()), 0);
  VerifyOptions options;
  options.files = files;
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->config_source, "the daemon's checkpoint layout");
  EXPECT_EQ(report->mismatched, 0);
  EXPECT_EQ(report->matched, static_cast<int>(store_->layout().num_kernels()));
  EXPECT_TRUE(report->ok());
}

TEST_P(VerifyTest, MissingConfigIsNotFound) {
  Load(Weights(2));
  VerifyOptions options;
  options.files = Weights(2);
  options.config_path = dir_ + "/nope.json";
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(report.status().message(), HasSubstr(dir_ + "/nope.json"));
}

TEST_P(VerifyTest, MissingFileIsNotFound) {
  Load(Weights(2));
  VerifyOptions options;
  options.files = {dir_ + "/w2/absent.safetensors"};
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(report.status().message(), HasSubstr(dir_ + "/w2/absent.safetensors"));
}

TEST_P(VerifyTest, NoFilesBadSchemeAndBadRankAreInvalidArgument) {
  Load(Weights(2));
  VerifyOptions options;
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(report.status().message(), HasSubstr("verify: no files"));

  options.files = Weights(2);
  options.quant = "int4";
  report = Verify(*client_, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(report.status().message(), HasSubstr("unknown quantization scheme 'int4'"));

  options.quant = "";
  options.tp_rank = 3;
  options.tp_size = 2;
  report = Verify(*client_, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(report.status().message(), HasSubstr("model layout"));
}

TEST_P(VerifyTest, UnsupportedArchitectureIsUnimplemented) {
  Load(Weights(2));
  const std::string config = dir_ + "/gpt2.json";
  std::ofstream(config) << R"({"architectures": ["GPT2LMHeadModel"]})";
  VerifyOptions options;
  options.files = Weights(2);
  options.config_path = config;
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(report.status().message(), HasSubstr("GPT2LMHeadModel"));
}

TEST_P(VerifyTest, NonFiniteWeightsAreInvalidArgumentNamingTheTensor) {
  Load(Weights(2));
  absl::StatusOr<std::vector<core::OwnedTensor>> weights = core::MakeFixtureWeights(config_, 2);
  ASSERT_TRUE(weights.ok()) << weights.status();
  std::vector<core::TensorToWrite> tensors;
  for (core::OwnedTensor& t : *weights) {
    if (t.name == "model.layers.0.mlp.down_proj.weight") {
      t.bytes[0] = 0xC0;  // bf16 0x7FC0: NaN
      t.bytes[1] = 0x7F;
    }
    tensors.push_back({t.name, t.dtype, t.shape, t.bytes});
  }
  const std::string file = dir_ + "/nan.safetensors";
  ASSERT_TRUE(core::WriteSafetensors(file, tensors).ok());
  VerifyOptions options;
  options.files = {file};
  options.config_path = dir_ + "/w2/config.json";
  absl::StatusOr<VerifyReport> report = Verify(*client_, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(report.status().message(), HasSubstr("model.layers.0.mlp.down_proj.weight"));
  EXPECT_THAT(report.status().message(), HasSubstr("element 0 (row 0, col 0) is nan"));
}

TEST(VerifyErrorsTest, ADaemonLayoutThatIsNotADenseDecoderIsFailedPrecondition) {
  // The fake's checkpoint layout lists one norm: no config.json can be
  // inferred from it.
  testing::FakeServer server;
  ClientOptions client_options;
  client_options.address = server.address();
  std::unique_ptr<RefitClient> client = *RefitClient::Create(client_options);
  char pattern[] = "/tmp/refit_verify_test_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern), nullptr);
  const std::string file = std::string(pattern) + "/m.safetensors";
  ASSERT_TRUE(core::WriteSafetensors(file, {}).ok());
  VerifyOptions options;
  options.files = {file};
  absl::StatusOr<VerifyReport> report = Verify(*client, options);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(report.status().message(), HasSubstr("not a dense decoder"));
  EXPECT_THAT(report.status().message(), HasSubstr("pass --config"));
  ::unlink(file.c_str());
  ::rmdir(pattern);
}

TEST(VerifyErrorsTest, AnUnreachableDaemonIsUnavailable) {
  ClientOptions client_options;
  client_options.address = "unix:/nonexistent/refitd.sock";
  client_options.retry.max_attempts = 1;
  std::unique_ptr<RefitClient> client = *RefitClient::Create(client_options);
  VerifyOptions options;
  options.files = {"/nonexistent/m.safetensors"};
  EXPECT_EQ(Verify(*client, options).status().code(), absl::StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(Schemes, VerifyTest,
                         ::testing::Values(core::QuantScheme::kPerTensor,
                                           core::QuantScheme::kPerChannel,
                                           core::QuantScheme::kBlock128),
                         [](const auto& info) {
                           std::string name(core::QuantSchemeName(info.param));
                           return name == "per-tensor"    ? std::string("PerTensor")
                                  : name == "per-channel" ? std::string("PerChannel")
                                                          : std::string("Block128");
                         });

}  // namespace
}  // namespace refit::client
