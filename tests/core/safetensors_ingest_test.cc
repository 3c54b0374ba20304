#include "core/safetensors_ingest.h"

#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/fixture_model.h"
#include "core/refit_session.h"
#include "core/safetensors.h"
#include "core/shard_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::MakeStore;
using ::refit::testing::PushAll;
using ::refit::testing::Snapshot;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::vector<OwnedTensor> Weights(const ModelConfig& config, uint64_t seed) {
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(config, seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : std::vector<OwnedTensor>{};
}

// mkdtemp rather than std::filesystem: LibTorch exports its own copies of
// std::filesystem symbols, which crash when mixed with libstdc++'s.
std::string TempDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string pattern =
      absl::StrCat(::testing::TempDir(), "/safetensors_ingest_", info->name(), "_XXXXXX");
  EXPECT_NE(mkdtemp(pattern.data()), nullptr);
  return pattern;
}

// Writes `tensors` to `path` in the given order.
void Write(const std::string& path, const std::vector<OwnedTensor>& tensors) {
  std::vector<TensorToWrite> out;
  for (const OwnedTensor& t : tensors) out.push_back({t.name, t.dtype, t.shape, t.bytes});
  absl::Status s = WriteSafetensors(path, out);
  ASSERT_TRUE(s.ok()) << s;
}

const OwnedTensor& Find(const std::vector<OwnedTensor>& tensors, absl::string_view name) {
  for (const OwnedTensor& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return tensors.front();
}

int64_t Bytes(const std::vector<OwnedTensor>& tensors) {
  int64_t n = 0;
  for (const OwnedTensor& t : tensors) n += static_cast<int64_t>(t.bytes.size());
  return n;
}

std::vector<std::string> Names(const std::vector<OwnedTensor>& tensors) {
  std::vector<std::string> names;
  for (const OwnedTensor& t : tensors) names.push_back(t.name);
  return names;
}

class SafetensorsIngestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = FixtureConfig();
    v1_ = Weights(config_, 1);
    v2_ = Weights(config_, 2);
    ASSERT_GT(v2_.size(), 4u);
    // v2 over two files: the first third of the tensors, then the rest.
    first_.assign(v2_.begin(), v2_.begin() + v2_.size() / 3);
    second_.assign(v2_.begin() + v2_.size() / 3, v2_.end());
    dir_ = TempDir();
    files_ = {dir_ + "/model-00001-of-00002.safetensors",
              dir_ + "/model-00002-of-00002.safetensors"};
    Write(files_[0], first_);
    Write(files_[1], second_);

    store_ = MakeStore(config_);
    ASSERT_NE(store_, nullptr);
    ASSERT_TRUE(PushAll(*store_, v1_).ok());
    ASSERT_EQ(store_->version(), 1u);
    live_ = Snapshot(*store_);
    fingerprint_ = store_->fingerprint();

    // What a push of v2 gives.
    std::unique_ptr<ShardStore> pushed = MakeStore(config_);
    ASSERT_NE(pushed, nullptr);
    ASSERT_TRUE(PushAll(*pushed, v2_).ok());
    v2_fingerprint_ = pushed->fingerprint();
    ASSERT_NE(v2_fingerprint_, fingerprint_);
  }

  std::unique_ptr<RefitSession> Begin() {
    absl::StatusOr<std::unique_ptr<RefitSession>> s = RefitSession::Begin(store_.get(), {});
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // Nothing live changed and a new refit can begin.
  void ExpectUnchanged() {
    EXPECT_EQ(store_->version(), 1u);
    EXPECT_EQ(store_->fingerprint(), fingerprint_);
    EXPECT_TRUE(Snapshot(*store_) == live_) << "live bytes changed";
    EXPECT_EQ(store_->active_session(), "");
    absl::StatusOr<std::unique_ptr<RefitSession>> next = RefitSession::Begin(store_.get(), {});
    EXPECT_TRUE(next.ok()) << next.status();
  }

  ModelConfig config_;
  std::vector<OwnedTensor> v1_, v2_, first_, second_;
  std::string dir_;
  std::vector<std::string> files_;
  std::unique_ptr<ShardStore> store_;
  std::map<std::string, std::string> live_;
  std::string fingerprint_, v2_fingerprint_;
};

TEST_F(SafetensorsIngestTest, TinyChunksGiveTheFingerprintOfAPush) {
  // 7 bytes of bf16 are cut to 3 whole elements; 1 byte still sends one.
  for (uint64_t chunk_bytes : {uint64_t{7}, uint64_t{1}, uint64_t{64} << 20}) {
    SCOPED_TRACE(absl::StrCat("chunk_bytes ", chunk_bytes));
    std::unique_ptr<ShardStore> store = MakeStore(config_);
    ASSERT_NE(store, nullptr);
    absl::StatusOr<std::unique_ptr<RefitSession>> session = RefitSession::Begin(store.get(), {});
    ASSERT_TRUE(session.ok()) << session.status();
    SafetensorsIngestOptions options;
    options.chunk_bytes = chunk_bytes;
    absl::Status ingested = IngestSafetensors(files_, **session, options);
    ASSERT_TRUE(ingested.ok()) << ingested;
    EXPECT_EQ((*session)->progress().bytes_received, Bytes(v2_));
    absl::StatusOr<RefitResult> committed = (*session)->Commit();
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(committed->fingerprint, v2_fingerprint_);
    EXPECT_EQ(store->fingerprint(), v2_fingerprint_);
  }
}

TEST_F(SafetensorsIngestTest, Fp32FilesAreConvertedToTheCheckpointDtype) {
  std::vector<OwnedTensor> wide;
  for (const OwnedTensor& t : v2_) wide.push_back(refit::testing::WidenBf16ToF32(t));
  const std::string path = dir_ + "/fp32.safetensors";
  Write(path, wide);
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_NE(session, nullptr);
  SafetensorsIngestOptions options;
  options.chunk_bytes = 1000;
  ASSERT_TRUE(IngestSafetensors({path}, *session, options).ok());
  absl::StatusOr<RefitResult> committed = session->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(store_->fingerprint(), v2_fingerprint_);
}

TEST_F(SafetensorsIngestTest, OnTensorIsCalledOncePerTensorInFileOrder) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_NE(session, nullptr);
  std::vector<std::string> seen;
  std::vector<uint64_t> sizes;
  SafetensorsIngestOptions options;
  options.chunk_bytes = 4096;
  options.on_tensor = [&](const TensorEntry& tensor) {
    seen.push_back(tensor.name);
    sizes.push_back(tensor.nbytes);
    return absl::OkStatus();
  };
  ASSERT_TRUE(IngestSafetensors(files_, *session, options).ok());
  EXPECT_EQ(seen, Names(v2_));
  ASSERT_EQ(sizes.size(), v2_.size());
  for (size_t i = 0; i < v2_.size(); ++i) EXPECT_EQ(sizes[i], v2_[i].bytes.size()) << seen[i];
}

TEST_F(SafetensorsIngestTest, OnTensorErrorStopsTheIngestWithThatStatus) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_NE(session, nullptr);
  const absl::Status stop = absl::CancelledError("stopped after three tensors");
  int calls = 0;
  int file_calls = 0;
  SafetensorsIngestOptions options;
  options.on_tensor = [&](const TensorEntry&) { return ++calls == 3 ? stop : absl::OkStatus(); };
  options.on_file = [&](const SessionProgress&) { ++file_calls; };
  absl::Status s = IngestSafetensors(files_, *session, options);
  EXPECT_EQ(s, stop);  // as it was returned: no path in front
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(file_calls, 0);
  EXPECT_EQ(session->progress().bytes_received, Bytes({v2_[0], v2_[1], v2_[2]}));
  // The ingest does not abort: that is the caller's decision.
  EXPECT_EQ(session->state(), SessionState::kReceiving);
}

TEST_F(SafetensorsIngestTest, OnFileIsCalledAfterEachFileWithTheProgress) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_NE(session, nullptr);
  std::vector<int64_t> received;
  SafetensorsIngestOptions options;
  options.on_file = [&](const SessionProgress& p) { received.push_back(p.bytes_received); };
  ASSERT_TRUE(IngestSafetensors(files_, *session, options).ok());
  EXPECT_THAT(received, ElementsAre(Bytes(first_), Bytes(v2_)));
}

TEST_F(SafetensorsIngestTest, NoFilesOrZeroChunkSizeIsInvalidArgument) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_NE(session, nullptr);
  absl::Status none = IngestSafetensors({}, *session, {});
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.message(), HasSubstr("no safetensors files"));

  SafetensorsIngestOptions zero;
  zero.chunk_bytes = 0;
  absl::Status s = IngestSafetensors(files_, *session, zero);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("chunk_bytes must be positive"));
  EXPECT_EQ(session->progress().bytes_received, 0);
  EXPECT_EQ(session->state(), SessionState::kReceiving);
}

TEST_F(SafetensorsIngestTest, MissingFileIsTheOpenError) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_NE(session, nullptr);
  const std::string missing = dir_ + "/absent.safetensors";
  int file_calls = 0;
  SafetensorsIngestOptions options;
  options.on_file = [&](const SessionProgress&) { ++file_calls; };
  absl::Status s = IngestSafetensors({files_[0], missing}, *session, options);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr(missing));
  EXPECT_EQ(s, SafetensorsFile::Open(missing).status());
  EXPECT_EQ(file_calls, 1);
}

TEST_F(SafetensorsIngestTest, IngestErrorGetsTheFilePathInFront) {
  struct Case {
    const char* label;
    OwnedTensor tensor;
    absl::StatusCode code;
    const char* words;
  };
  OwnedTensor wrong_shape = Find(v2_, "model.norm.weight");
  wrong_shape.shape = {2, 64};
  OwnedTensor unknown = v2_.back();
  unknown.name = "model.layers.9.mlp.up_proj.weight";
  const Case cases[] = {
      {"shape", wrong_shape, absl::StatusCode::kInvalidArgument,
       "shape [2, 64] does not match the model's [128]"},
      {"name", unknown, absl::StatusCode::kNotFound, "unknown tensor"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string path = absl::StrCat(dir_, "/bad_", c.label, ".safetensors");
    Write(path, {v2_[0], c.tensor});
    std::unique_ptr<RefitSession> session = Begin();
    ASSERT_NE(session, nullptr);
    absl::Status s = IngestSafetensors({path}, *session, {});
    EXPECT_EQ(s.code(), c.code);
    EXPECT_THAT(std::string(s.message()), StartsWith(path + ": "));
    EXPECT_THAT(s.message(), HasSubstr(c.tensor.name));
    EXPECT_THAT(s.message(), HasSubstr(c.words));
    // The session aborted itself on the chunk's error.
    EXPECT_EQ(session->state(), SessionState::kAborted);
  }
}

TEST_F(SafetensorsIngestTest, AfterAbortIngestReturnsAbortedWithoutThePath) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_NE(session, nullptr);
  session->Abort("operator cancelled the reload");
  absl::Status s = IngestSafetensors(files_, *session, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("operator cancelled the reload"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr(files_[0])));
  EXPECT_EQ(s, session->abort_status());
}

TEST_F(SafetensorsIngestTest, AbortBetweenTensorsStopsTheIngestWithAborted) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_NE(session, nullptr);
  int calls = 0;
  SafetensorsIngestOptions options;
  options.on_tensor = [&](const TensorEntry&) {
    if (++calls == 2) session->Abort("idle timeout");
    return absl::OkStatus();
  };
  absl::Status s = IngestSafetensors(files_, *session, options);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.message(), HasSubstr("idle timeout"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr(files_[0])));
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(session->progress().bytes_received, Bytes({v2_[0], v2_[1]}));
}

TEST_F(SafetensorsIngestTest, LoadSafetensorsCommitsANewVersion) {
  std::vector<int64_t> progress;
  absl::StatusOr<RefitResult> result =
      LoadSafetensors(store_.get(), files_, RefitOptions{},
                      [&](const SessionProgress& p) { progress.push_back(p.bytes_received); });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->version, 2u);
  EXPECT_EQ(store_->version(), 2u);
  EXPECT_EQ(result->fingerprint, v2_fingerprint_);
  EXPECT_EQ(store_->fingerprint(), v2_fingerprint_);
  EXPECT_EQ(result->bytes_received, Bytes(v2_));
  EXPECT_THAT(progress, ElementsAre(Bytes(first_), Bytes(v2_)));
  EXPECT_EQ(store_->active_session(), "");
}

TEST_F(SafetensorsIngestTest, LoadSafetensorsAbortsTheSessionOnAnIngestError) {
  OwnedTensor wrong = Find(v2_, "model.norm.weight");
  wrong.shape = {64, 2};
  const std::string bad = dir_ + "/bad.safetensors";
  Write(bad, {wrong});
  absl::StatusOr<RefitResult> result = LoadSafetensors(store_.get(), {files_[0], bad}, {});
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(result.status().message()), StartsWith(bad + ": "));
  EXPECT_THAT(result.status().message(), HasSubstr("model.norm.weight"));
  ExpectUnchanged();
}

TEST_F(SafetensorsIngestTest, LoadSafetensorsAbortsTheSessionOnAMissingFile) {
  const std::string missing = dir_ + "/absent.safetensors";
  absl::StatusOr<RefitResult> result = LoadSafetensors(store_.get(), {files_[0], missing}, {});
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(result.status().message(), HasSubstr(missing));
  ExpectUnchanged();
}

TEST_F(SafetensorsIngestTest, LoadSafetensorsAbortsTheSessionWhenCommitFails) {
  // A layer with some of its tensors but not all fails at Prepare.
  std::vector<OwnedTensor> without_k;
  for (const OwnedTensor& t : v2_) {
    if (t.name != "model.layers.0.self_attn.k_proj.weight") without_k.push_back(t);
  }
  ASSERT_EQ(without_k.size(), v2_.size() - 1);
  const std::string path = dir_ + "/without_k.safetensors";
  Write(path, without_k);
  absl::StatusOr<RefitResult> result = LoadSafetensors(store_.get(), {path}, {});
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(result.status().message(), HasSubstr("model.layers.0.self_attn.k_proj.weight"));
  ExpectUnchanged();
}

TEST_F(SafetensorsIngestTest, LoadSafetensorsWithoutFilesIsInvalidArgument) {
  absl::StatusOr<RefitResult> result = LoadSafetensors(store_.get(), {}, {});
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("no safetensors files"));
  ExpectUnchanged();
}

TEST_F(SafetensorsIngestTest, LoadSafetensorsReturnsTheBeginError) {
  // Another refit holds the store.
  std::unique_ptr<RefitSession> holder = Begin();
  ASSERT_NE(holder, nullptr);
  absl::StatusOr<RefitResult> result = LoadSafetensors(store_.get(), files_, {});
  EXPECT_EQ(result.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(result.status().message(), HasSubstr(holder->refit_id()));
  EXPECT_EQ(store_->version(), 1u);
  EXPECT_EQ(store_->active_session(), holder->refit_id());
}

}  // namespace
}  // namespace refit::core
