#include "core/refit_session.h"

#include "core/safetensors_ingest.h"

#include <ATen/ATen.h>

#include <stdlib.h>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <limits>
#include <thread>

#include <xxhash.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/fixture_model.h"
#include "core/fp8_quantizer.h"
#include "core/safetensors.h"
#include "core/shard_store_tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::IngestAll;
using ::refit::testing::MakeStore;
using ::refit::testing::PushAll;
using ::refit::testing::ShuffledChunks;
using ::refit::testing::Snapshot;
using ::refit::testing::ToChunk;
using ::testing::HasSubstr;

std::vector<OwnedTensor> Weights(const ModelConfig& config, uint64_t seed) {
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(config, seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : std::vector<OwnedTensor>{};
}

const OwnedTensor& Find(const std::vector<OwnedTensor>& tensors, absl::string_view name) {
  for (const OwnedTensor& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  return tensors.front();
}

// mkdtemp rather than std::filesystem: LibTorch exports its own copies of
// std::filesystem symbols, which crash when mixed with libstdc++'s.
std::string TempDir(absl::string_view name) {
  std::string pattern = absl::StrCat(::testing::TempDir(), "/refit_session_", name, "_XXXXXX");
  char* dir = mkdtemp(pattern.data());
  EXPECT_NE(dir, nullptr);
  return pattern;
}

class RefitSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = FixtureConfig();
    store_ = MakeStore(config_);
    ASSERT_NE(store_, nullptr);
    v1_ = Weights(config_, 1);
    v2_ = Weights(config_, 2);
    ASSERT_TRUE(PushAll(*store_, v1_).ok());
    ASSERT_EQ(store_->version(), 1u);
    live_ = Snapshot(*store_);
    fingerprint_ = store_->fingerprint();
  }

  // Nothing live changed and the session slot is free again.
  void ExpectUnchanged() {
    EXPECT_EQ(store_->version(), 1u);
    EXPECT_EQ(store_->fingerprint(), fingerprint_);
    EXPECT_TRUE(Snapshot(*store_) == live_) << "live bytes changed";
    EXPECT_EQ(store_->active_session(), "");
  }

  std::unique_ptr<RefitSession> Begin(RefitOptions options = {}) {
    absl::StatusOr<std::unique_ptr<RefitSession>> s = RefitSession::Begin(store_.get(), options);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  ModelConfig config_;
  std::unique_ptr<ShardStore> store_;
  std::vector<OwnedTensor> v1_, v2_;
  std::map<std::string, std::string> live_;
  std::string fingerprint_;
};

TEST_F(RefitSessionTest, ReloadGivesExactlyTheBytesOfAFreshLoad) {
  absl::StatusOr<RefitResult> result = PushAll(*store_, v2_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->version, 2u);
  EXPECT_TRUE(result->kept_layers.empty());

  std::unique_ptr<ShardStore> fresh = MakeStore(config_);
  ASSERT_TRUE(PushAll(*fresh, v2_).ok());
  std::map<std::string, std::string> reloaded = Snapshot(*store_);
  std::map<std::string, std::string> loaded = Snapshot(*fresh);
  ASSERT_EQ(reloaded.size(), store_->layout().num_kernels());
  for (const auto& [name, bytes] : loaded) {
    EXPECT_TRUE(reloaded[name] == bytes) << name;
  }
  EXPECT_EQ(store_->fingerprint(), fresh->fingerprint());
  EXPECT_EQ(result->fingerprint, fresh->fingerprint());
  EXPECT_NE(store_->fingerprint(), fingerprint_);
}

TEST_F(RefitSessionTest, TimingsSayHowMuchOfTheLayerWorkWasHashing) {
  absl::StatusOr<RefitResult> result = PushAll(*store_, v2_);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(result->timings.hashing, absl::ZeroDuration());
  EXPECT_LE(result->timings.hashing, result->timings.quantize);
}

// `tensors` with every element's sign flipped: every byte of a weight
// changes, no per-tensor amax does.
std::vector<OwnedTensor> Negated(std::vector<OwnedTensor> tensors) {
  for (OwnedTensor& t : tensors) {
    const size_t esize = DTypeSize(t.dtype);
    for (size_t i = esize - 1; i < t.bytes.size(); i += esize) t.bytes[i] ^= 0x80;
  }
  return tensors;
}

TEST_F(RefitSessionTest, AScaleThatHeldOverTwoRefitsIsReusedAndTheBytesAreAFreshLoads) {
  // Each weight's scale is offered as a hint when its last two refits gave
  // the same one; it is reused (the weight read once) when the new scale is
  // that hint. The bytes never depend on it.
  const std::vector<OwnedTensor> n1 = Negated(v1_), n2 = Negated(v2_);
  const std::vector<const std::vector<OwnedTensor>*> pushes = {&v1_, &n1, &v2_, &n2, &v2_};
  std::map<std::string, std::string> before2, before1 = Snapshot(*store_);  // SetUp's load
  bool first = true;
  for (size_t i = 0; i < pushes.size(); ++i) {
    SCOPED_TRACE(i);
    std::unique_ptr<ShardStore> fresh = MakeStore(config_);
    ASSERT_TRUE(PushAll(*fresh, *pushes[i]).ok());
    const std::map<std::string, std::string> expected = Snapshot(*fresh);
    int64_t reusable = 0;
    int64_t weights = 0;
    for (const auto& [name, bytes] : expected) {
      if (!absl::EndsWith(name, ".weight_scale")) continue;
      ++weights;
      const bool hinted = !first && before2[name] == before1[name];
      reusable += hinted && bytes == before1[name];
    }
    absl::StatusOr<RefitResult> result = PushAll(*store_, *pushes[i]);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->scales_reused, reusable);
    if (pushes[i] == &n1) {
      EXPECT_EQ(result->scales_reused, weights) << "every scale held";
    }
    if (i == 2) {
      EXPECT_LT(result->scales_reused, weights) << "new weights, new scales";
    }
    EXPECT_EQ(store_->fingerprint(), fresh->fingerprint());
    EXPECT_TRUE(Snapshot(*store_) == expected);
    before2 = std::move(before1);
    before1 = expected;
    first = false;
  }
}

TEST_F(RefitSessionTest, FirstLoadFromSafetensorsMatchesPush) {
  std::string dir = TempDir("first_load");
  ASSERT_TRUE(WriteFixtureModel(dir, config_, 2, 3).ok());
  absl::StatusOr<std::vector<std::string>> files = ListSafetensorsFiles(dir);
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 3u);
  std::unique_ptr<ShardStore> from_disk = MakeStore(config_);
  int progress_calls = 0;
  absl::StatusOr<RefitResult> loaded = LoadSafetensors(
      from_disk.get(), *files, RefitOptions{}, [&](const SessionProgress&) { ++progress_calls; });
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(progress_calls, 3);
  EXPECT_EQ(from_disk->version(), 1u);
  ASSERT_TRUE(PushAll(*store_, v2_).ok());
  EXPECT_EQ(from_disk->fingerprint(), store_->fingerprint());
  EXPECT_TRUE(Snapshot(*from_disk) == Snapshot(*store_));
}

TEST_F(RefitSessionTest, KernelsKeepTheirDataPointersAcrossCommits) {
  std::vector<const void*> before;
  for (const KernelView& k : store_->Kernels()) before.push_back(k.data);
  ASSERT_TRUE(PushAll(*store_, v2_).ok());
  ASSERT_TRUE(PushAll(*store_, v1_).ok());
  std::vector<KernelView> after = store_->Kernels();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_EQ(after[i].data, before[i]) << after[i].spec->name;
  EXPECT_EQ(store_->version(), 3u);
  EXPECT_EQ(store_->fingerprint(), fingerprint_);  // same weights as version 1
}

TEST_F(RefitSessionTest, QuantizedKernelEqualsQuantizerOnTheFusedWeight) {
  ASSERT_TRUE(PushAll(*store_, v2_).ok());
  // Assemble qkv of layer 0 by hand (tp 1: q, k, v stacked by rows).
  std::vector<uint8_t> fused;
  for (const char* p : {"q", "k", "v"}) {
    const OwnedTensor& t = Find(v2_, absl::StrCat("model.layers.0.self_attn.", p, "_proj.weight"));
    fused.insert(fused.end(), t.bytes.begin(), t.bytes.end());
  }
  int64_t cols = config_.hidden_size;
  int64_t rows = static_cast<int64_t>(fused.size() / 2) / cols;
  std::vector<uint8_t> q(rows * cols);
  float scale = 0;
  ASSERT_TRUE(QuantizeFp8(fused.data(), DType::kBFloat16, rows, cols, Fp8QuantizeOptions{},
                          q.data(), &scale, "qkv")
                  .ok());
  std::string live_q, live_s;
  ASSERT_TRUE(
      store_->ReadKernel("model.layers.0.self_attn.qkv_proj.weight", &live_q, nullptr).ok());
  ASSERT_TRUE(
      store_->ReadKernel("model.layers.0.self_attn.qkv_proj.weight_scale", &live_s, nullptr).ok());
  ASSERT_EQ(live_q.size(), q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    ASSERT_EQ(q[i], static_cast<uint8_t>(live_q[i])) << "byte " << i;
  }
  ASSERT_EQ(live_s.size(), sizeof(float));
  float live_scale;
  std::memcpy(&live_scale, live_s.data(), sizeof(float));
  EXPECT_EQ(live_scale, scale);
  EXPECT_GT(scale, 0.0f);
}

TEST_F(RefitSessionTest, ChunkOrderAndSizeDoNotChangeTheResult) {
  std::unique_ptr<ShardStore> ordered = MakeStore(config_);
  ASSERT_TRUE(PushAll(*ordered, v2_).ok());
  for (uint64_t seed : {1, 2, 3}) {
    std::unique_ptr<ShardStore> shuffled = MakeStore(config_);
    std::unique_ptr<RefitSession> session = RefitSession::Begin(shuffled.get(), {}).value();
    for (const auto& chunk : ShuffledChunks(v2_, seed, seed == 1 ? 7 : 5000)) {
      ASSERT_TRUE(session->Ingest(ToChunk(chunk)).ok());
    }
    ASSERT_TRUE(session->Commit().ok());
    EXPECT_EQ(shuffled->fingerprint(), ordered->fingerprint()) << "seed " << seed;
    EXPECT_TRUE(Snapshot(*shuffled) == Snapshot(*ordered)) << "seed " << seed;
  }
}

TEST_F(RefitSessionTest, ConvertsFp32AndFp16InputToTheCheckpointDtype) {
  std::vector<OwnedTensor> as_f32 = v2_;
  for (OwnedTensor& t : as_f32) {
    std::vector<uint8_t> f32(t.bytes.size() * 2);
    ASSERT_TRUE(
        ConvertFloats(t.bytes.data(), t.dtype, f32.data(), DType::kFloat32, t.bytes.size() / 2)
            .ok());
    t.bytes = std::move(f32);
    t.dtype = DType::kFloat32;
  }
  ASSERT_TRUE(PushAll(*store_, as_f32).ok());
  std::unique_ptr<ShardStore> bf16 = MakeStore(config_);
  ASSERT_TRUE(PushAll(*bf16, v2_).ok());
  EXPECT_EQ(store_->fingerprint(), bf16->fingerprint());
}

TEST_F(RefitSessionTest, AbortBeforeTheFirstLayerCompletesChangesNothing) {
  std::unique_ptr<RefitSession> session = Begin();
  const OwnedTensor& q = Find(v2_, "model.layers.0.self_attn.q_proj.weight");
  ASSERT_TRUE(session->Ingest(ToChunk({&q, 0, q.bytes.size()})).ok());
  EXPECT_GT(session->progress().staging_bytes, 0);
  EXPECT_EQ(session->progress().layers_done, 0);
  session->Abort("operator said so");
  EXPECT_EQ(session->state(), SessionState::kAborted);
  EXPECT_EQ(session->progress().staging_bytes, 0);
  EXPECT_THAT(session->abort_status().message(), HasSubstr("operator said so"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, AbortMidwayChangesNothing) {
  RefitOptions options;
  options.overlap_processing = false;  // processed layers are done on return
  std::unique_ptr<RefitSession> session = Begin(options);
  for (size_t i = 0; i < v2_.size() / 2; ++i) {
    ASSERT_TRUE(session->Ingest(ToChunk({&v2_[i], 0, v2_[i].bytes.size()})).ok());
  }
  EXPECT_GT(session->progress().layers_done, 0);
  EXPECT_GT(session->progress().staged_kernel_bytes, 0);
  session->Abort("midway");
  EXPECT_EQ(session->progress().staging_bytes, 0);
  EXPECT_EQ(session->progress().staged_kernel_bytes, 0);
  // After an abort from elsewhere, Ingest says why the refit ended.
  absl::Status late = session->Ingest(ToChunk({&v2_.back(), 0, v2_.back().bytes.size()}));
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(late.message(), HasSubstr("midway"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, AbortWhileTheWorkerIsQuantizingChangesNothing) {
  // Layers complete one after another and queue for the worker; aborting
  // right away must stop it cleanly whatever it is doing.
  for (int round = 0; round < 5; ++round) {
    std::unique_ptr<RefitSession> session = Begin();
    for (const OwnedTensor& t : v2_) {
      ASSERT_TRUE(session->Ingest(ToChunk({&t, 0, t.bytes.size()})).ok());
    }
    session->Abort("round");
    EXPECT_EQ(session->progress().staged_kernel_bytes, 0);
    ExpectUnchanged();
  }
}

TEST_F(RefitSessionTest, WorkerErrorsSurfaceAndAbort) {
  std::vector<OwnedTensor> w = v2_;
  for (OwnedTensor& t : w) {
    if (t.name == "model.layers.0.mlp.down_proj.weight") {
      t.bytes[0] = 0x80;  // bf16 0x7F80 = +Inf
      t.bytes[1] = 0x7F;
    }
  }
  std::unique_ptr<RefitSession> session = Begin();
  absl::Status first_error;
  for (const OwnedTensor& t : w) {
    absl::Status s = session->Ingest(ToChunk({&t, 0, t.bytes.size()}));
    if (!s.ok()) {
      first_error = s;
      break;
    }
  }
  if (first_error.ok()) first_error = session->Prepare().status();
  EXPECT_EQ(first_error.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(first_error.message(), HasSubstr("model.layers.0.mlp.down_proj"));
  EXPECT_EQ(session->state(), SessionState::kAborted);
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, AbortAfterPreparedChangesNothing) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_TRUE(IngestAll(*session, v2_).ok());
  ASSERT_TRUE(session->Prepare().ok());
  EXPECT_EQ(session->state(), SessionState::kPrepared);
  EXPECT_EQ(store_->version(), 1u);  // prepared is not visible
  EXPECT_TRUE(Snapshot(*store_) == live_);
  session->Abort("fleet vote failed");
  ExpectUnchanged();
  EXPECT_EQ(session->Commit().status().code(), absl::StatusCode::kFailedPrecondition);
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, AFailedInputCheckFailsTheCommitAndChangesNothing) {
  int calls = 0;
  RefitOptions options;
  options.input_check = [&] {
    ++calls;
    return absl::FailedPreconditionError("region \"r\" was truncated while in use");
  };
  std::unique_ptr<RefitSession> session = Begin(options);
  ASSERT_TRUE(IngestAll(*session, v2_).ok());
  EXPECT_EQ(calls, 0);  // not while bytes may still be read
  absl::StatusOr<RefitResult> result = session->Commit();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(result.status().message(), HasSubstr("truncated while in use"));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(session->state(), SessionState::kAborted);
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, APassingInputCheckCommits) {
  int calls = 0;
  RefitOptions options;
  options.input_check = [&] {
    ++calls;
    return absl::OkStatus();
  };
  std::unique_ptr<RefitSession> session = Begin(options);
  ASSERT_TRUE(IngestAll(*session, v2_).ok());
  ASSERT_TRUE(session->Prepare().ok());
  EXPECT_EQ(calls, 1);
  absl::StatusOr<RefitResult> result = session->Commit();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->version, 2u);
  EXPECT_EQ(calls, 1);
}

TEST_F(RefitSessionTest, PreparedSessionCommitsLater) {
  std::unique_ptr<RefitSession> session = Begin();
  ASSERT_TRUE(IngestAll(*session, v2_).ok());
  ASSERT_TRUE(session->Prepare().ok());
  EXPECT_EQ(store_->active_session(), session->refit_id());
  absl::StatusOr<RefitResult> result = session->Commit();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->version, 2u);
  EXPECT_EQ(store_->active_session(), "");
}

TEST_F(RefitSessionTest, DestroyingAnUncommittedSessionAborts) {
  {
    std::unique_ptr<RefitSession> session = Begin();
    ASSERT_TRUE(IngestAll(*session, v2_).ok());
  }
  ExpectUnchanged();
  EXPECT_TRUE(PushAll(*store_, v2_).ok());
}

TEST_F(RefitSessionTest, LayersWithoutWeightsKeepTheirValuesAndAreListed) {
  std::vector<OwnedTensor> partial;
  for (const OwnedTensor& t : v2_) {
    if (t.name.find("model.layers.1.mlp.") == std::string::npos) partial.push_back(t);
  }
  absl::StatusOr<RefitResult> result = PushAll(*store_, partial);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_THAT(result->kept_layers,
              ::testing::UnorderedElementsAre("model.layers.1.mlp.gate_up_proj",
                                              "model.layers.1.mlp.down_proj"));
  std::map<std::string, std::string> now = Snapshot(*store_);
  EXPECT_EQ(now["model.layers.1.mlp.down_proj.weight"],
            live_["model.layers.1.mlp.down_proj.weight"]);
  EXPECT_NE(now["model.layers.0.mlp.down_proj.weight"],
            live_["model.layers.0.mlp.down_proj.weight"]);
}

TEST_F(RefitSessionTest, LayerMissingATensorFailsUnlessPartialIsAllowed) {
  std::vector<OwnedTensor> partial;
  for (const OwnedTensor& t : v2_) {
    if (t.name != "model.layers.0.mlp.up_proj.weight") partial.push_back(t);
  }
  absl::StatusOr<RefitResult> strict = PushAll(*store_, partial);
  EXPECT_EQ(strict.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(strict.status().message(), HasSubstr("model.layers.0.mlp.up_proj.weight"));
  ExpectUnchanged();

  RefitOptions options;
  options.allow_partial_layers = true;
  absl::StatusOr<RefitResult> lenient = PushAll(*store_, partial, options);
  ASSERT_TRUE(lenient.ok()) << lenient.status();
  EXPECT_THAT(lenient->partial_layers, ::testing::ElementsAre("model.layers.0.mlp.gate_up_proj"));
}

TEST_F(RefitSessionTest, AttentionScalesFollowTheFinalizeRules) {
  auto scalar = [](const std::string& name, float value) {
    OwnedTensor t{name, DType::kFloat32, {}, std::vector<uint8_t>(4)};
    std::memcpy(t.bytes.data(), &value, 4);
    return t;
  };
  auto read = [&](const std::string& name) {
    std::string bytes;
    EXPECT_TRUE(store_->ReadKernel(name, &bytes, nullptr).ok()) << name;
    float v = -1;
    if (bytes.size() == 4) std::memcpy(&v, bytes.data(), 4);
    return v;
  };
  const std::string a0 = "model.layers.0.self_attn.";
  const std::string a1 = "model.layers.1.self_attn.";
  // No scales at all: 1.0.
  EXPECT_EQ(read(a0 + "attn.k_scale"), 1.0f);
  EXPECT_EQ(read(a0 + "attn.q_scale"), 1.0f);
  std::vector<OwnedTensor> w = v2_;
  w.push_back(scalar(a0 + "k_proj.output_scale", 0.5f));
  w.push_back(scalar(a0 + "v_proj.output_scale", 0.25f));
  w.push_back(scalar(a1 + "k_proj.output_scale", 0.75f));  // v missing -> max
  ASSERT_TRUE(PushAll(*store_, w).ok());
  EXPECT_EQ(read(a0 + "attn.k_scale"), 0.5f);
  EXPECT_EQ(read(a0 + "attn.v_scale"), 0.25f);
  EXPECT_EQ(read(a0 + "attn.q_scale"), 0.5f);  // q missing -> k
  EXPECT_EQ(read(a1 + "attn.k_scale"), 0.75f);
  EXPECT_EQ(read(a1 + "attn.v_scale"), 0.75f);
  std::vector<OwnedTensor> legacy = v2_;
  legacy.push_back(scalar(a0 + "kv_scale", 2.0f));
  ASSERT_TRUE(PushAll(*store_, legacy).ok());
  EXPECT_EQ(read(a0 + "attn.k_scale"), 2.0f);
  EXPECT_EQ(read(a0 + "attn.v_scale"), 2.0f);
  EXPECT_EQ(read(a1 + "attn.k_scale"), 1.0f);
}

// ---- Bad input: a specific code, a message naming the tensor, nothing live changed.

struct BadChunkCase {
  const char* label;
  absl::StatusCode code;
  const char* message;
};

TEST_F(RefitSessionTest, RejectsUnknownTensorName) {
  std::unique_ptr<RefitSession> session = Begin();
  OwnedTensor t = v2_[0];
  t.name = "model.layers.7.mlp.up_proj.weight";
  absl::Status s = session->Ingest(ToChunk({&t, 0, t.bytes.size()}));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.7.mlp.up_proj.weight"));
  EXPECT_EQ(session->state(), SessionState::kAborted);
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, RejectsWrongDtype) {
  std::unique_ptr<RefitSession> session = Begin();
  OwnedTensor t = Find(v2_, "model.norm.weight");
  t.dtype = DType::kInt16;
  absl::Status s = session->Ingest(ToChunk({&t, 0, t.bytes.size()}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.norm.weight"));
  EXPECT_THAT(s.message(), HasSubstr("I16"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, RejectsWrongShape) {
  std::unique_ptr<RefitSession> session = Begin();
  OwnedTensor t = Find(v2_, "model.layers.0.mlp.down_proj.weight");
  std::swap(t.shape[0], t.shape[1]);
  absl::Status s = session->Ingest(ToChunk({&t, 0, t.bytes.size()}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.0.mlp.down_proj.weight"));
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("[", t.shape[0], ", ", t.shape[1], "]")));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, RejectsOverlappingChunk) {
  std::unique_ptr<RefitSession> session = Begin();
  const OwnedTensor& t = Find(v2_, "model.layers.0.mlp.up_proj.weight");
  ASSERT_TRUE(session->Ingest(ToChunk({&t, 0, 64})).ok());
  absl::Status s = session->Ingest(ToChunk({&t, 32, 64}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("overlap"));
  EXPECT_THAT(s.message(), HasSubstr("model.layers.0.mlp.up_proj.weight"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, RejectsDuplicateChunk) {
  std::unique_ptr<RefitSession> session = Begin();
  const OwnedTensor& t = Find(v2_, "model.layers.0.mlp.up_proj.weight");
  ASSERT_TRUE(session->Ingest(ToChunk({&t, 64, 64})).ok());
  absl::Status s = session->Ingest(ToChunk({&t, 64, 64}));
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("duplicate"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, RejectsChunkPastTheEnd) {
  std::unique_ptr<RefitSession> session = Begin();
  const OwnedTensor& t = Find(v2_, "model.norm.weight");
  core::Chunk chunk = ToChunk({&t, 0, t.bytes.size()});
  chunk.offset = 2;
  absl::Status s = session->Ingest(chunk);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("model.norm.weight"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, RejectsMisalignedChunk) {
  std::unique_ptr<RefitSession> session = Begin();
  const OwnedTensor& t = Find(v2_, "model.norm.weight");
  absl::Status s = session->Ingest(ToChunk({&t, 1, 4}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("aligned"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, RejectsChecksumMismatch) {
  std::unique_ptr<RefitSession> session = Begin();
  const OwnedTensor& t = Find(v2_, "model.norm.weight");
  core::Chunk chunk = ToChunk({&t, 0, t.bytes.size()});
  chunk.xxh3 = 12345;
  absl::Status s = session->Ingest(chunk);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("checksum"));
  EXPECT_THAT(s.message(), HasSubstr("model.norm.weight"));
  ExpectUnchanged();
}

TEST(RefitSessionChecksumTest, ChecksummedChunksOfManyBlocksGiveTheSameResult) {
  ModelConfig config = FixtureConfig();
  config.vocab_size = 5000;  // a 1.3 MB embedding: checksummed in several blocks
  std::vector<OwnedTensor> w = MakeFixtureWeights(config, 3).value();
  std::unique_ptr<ShardStore> plain = MakeStore(config);
  std::unique_ptr<ShardStore> summed = MakeStore(config);
  ASSERT_TRUE(PushAll(*plain, w).ok());
  std::unique_ptr<RefitSession> session = RefitSession::Begin(summed.get(), {}).value();
  for (const OwnedTensor& t : w) {
    core::Chunk chunk = ToChunk({&t, 0, t.bytes.size()});
    chunk.xxh3 = XXH3_64bits(t.bytes.data(), t.bytes.size());
    ASSERT_TRUE(session->Ingest(chunk).ok()) << t.name;
  }
  ASSERT_TRUE(session->Commit().ok());
  EXPECT_EQ(summed->fingerprint(), plain->fingerprint());

  // One flipped byte near the end of a multi-block chunk: the refit aborts
  // although earlier blocks were already staged, and nothing live changes.
  const std::string before = summed->fingerprint();
  session = RefitSession::Begin(summed.get(), {}).value();
  const OwnedTensor& embed = Find(w, "model.embed_tokens.weight");
  ASSERT_GT(embed.bytes.size(), size_t{1} << 20);
  core::Chunk chunk = ToChunk({&embed, 0, embed.bytes.size()});
  chunk.xxh3 = XXH3_64bits(embed.bytes.data(), embed.bytes.size()) ^ 1;
  absl::Status s = session->Ingest(chunk);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_EQ(session->state(), SessionState::kAborted);
  EXPECT_EQ(summed->fingerprint(), before);
  EXPECT_EQ(summed->version(), 1u);
}

TEST_F(RefitSessionTest, RejectsTensorStillIncompleteAtTheEnd) {
  std::unique_ptr<RefitSession> session = Begin();
  for (const OwnedTensor& t : v2_) {
    uint64_t size =
        t.name == "model.layers.1.mlp.down_proj.weight" ? t.bytes.size() - 8 : t.bytes.size();
    ASSERT_TRUE(session->Ingest(ToChunk({&t, 0, size})).ok());
  }
  absl::StatusOr<RefitResult> result = session->Commit();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(result.status().message(), HasSubstr("model.layers.1.mlp.down_proj.weight"));
  EXPECT_THAT(result.status().message(), HasSubstr("incomplete"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, RefusesASecondSessionNamingTheActiveOne) {
  RefitOptions first;
  first.refit_id = "trainer-step-42";
  std::unique_ptr<RefitSession> session = Begin(first);
  absl::StatusOr<std::unique_ptr<RefitSession>> second = RefitSession::Begin(store_.get(), {});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(second.status().message(), HasSubstr("trainer-step-42"));
  session->Abort("done");
  EXPECT_TRUE(RefitSession::Begin(store_.get(), {}).ok());
}

TEST_F(RefitSessionTest, RejectsStaleBaseVersion) {
  RefitOptions options;
  options.base_version = 7;
  absl::StatusOr<std::unique_ptr<RefitSession>> s = RefitSession::Begin(store_.get(), options);
  // A failed test-and-set: the caller re-reads the version and retries.
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(s.status().message(), HasSubstr("expects base version 7"));
  EXPECT_THAT(s.status().message(), HasSubstr("serves version 1"));
  options.base_version = 1;
  EXPECT_TRUE(RefitSession::Begin(store_.get(), options).ok());
}

TEST_F(RefitSessionTest, StagingBudgetIsEnforced) {
  RefitOptions options;
  // Room for one layer, not two: out-of-order streams that hold many
  // incomplete layers fail instead of growing without bound.
  options.staging_budget_bytes = store_->layout().max_layer_param_bytes();
  std::unique_ptr<RefitSession> session = Begin(options);
  const OwnedTensor& a = Find(v2_, "model.layers.0.mlp.up_proj.weight");
  const OwnedTensor& b = Find(v2_, "model.layers.1.mlp.up_proj.weight");
  ASSERT_TRUE(session->Ingest(ToChunk({&a, 0, a.bytes.size()})).ok());
  absl::Status s = session->Ingest(ToChunk({&b, 0, b.bytes.size()}));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.1.mlp.gate_up_proj"));
  ExpectUnchanged();
  // In layer order the same budget suffices.
  EXPECT_TRUE(PushAll(*store_, v2_, options).ok());
}

TEST_F(RefitSessionTest, NonFiniteWeightsAreRejectedByDefault) {
  std::vector<OwnedTensor> w = v2_;
  for (OwnedTensor& t : w) {
    if (t.name == "model.layers.1.mlp.down_proj.weight") {
      t.bytes[10] = 0xC0;  // bf16 0x7FC0 = NaN
      t.bytes[11] = 0x7F;
    }
  }
  absl::StatusOr<RefitResult> result = PushAll(*store_, w);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("model.layers.1.mlp.down_proj"));
  ExpectUnchanged();
  RefitOptions vllm;
  vllm.non_finite = NonFinitePolicy::kVllmCompatible;
  EXPECT_TRUE(PushAll(*store_, w, vllm).ok());
}

TEST_F(RefitSessionTest, ANonFiniteWeightIsNamedByTheCheckpointTensorAndItsPlaceThere) {
  // The quantizer sees fused kernels (q/k/v, gate/up) and this rank's slice:
  // the error names the tensor the trainer sent and the element's row and
  // column in it, before the kernel's own coordinates.
  auto set_nan = [](std::vector<OwnedTensor>& w, const std::string& name, int64_t row,
                    int64_t col) {
    for (OwnedTensor& t : w) {
      if (t.name != name) continue;
      const int64_t at = 2 * (row * t.shape[1] + col);  // bf16
      t.bytes[at] = 0xC0;
      t.bytes[at + 1] = 0x7F;
      return true;
    }
    return false;
  };
  const std::string layer = "model.layers.0.";
  struct Case {
    std::string tensor;
    int64_t row, col;
    int64_t tp_size, tp_rank;
    std::string kernel_at;  // the kernel's own words, after the prefix
  };
  const int64_t q_rows = config_.num_heads * config_.head_dim;
  const int64_t kv_rows = config_.num_kv_heads * config_.head_dim;
  const int64_t i2 = config_.intermediate_size / 2;
  const std::vector<Case> cases = {
      {layer + "self_attn.v_proj.weight", 5, 3, 1, 0,
       absl::StrCat("tensor '", layer, "self_attn.qkv_proj.weight': element ",
                    (q_rows + kv_rows + 5) * config_.hidden_size + 3, " (row ",
                    q_rows + kv_rows + 5, ", col 3) is nan")},
      {layer + "mlp.up_proj.weight", 2, 7, 1, 0,
       absl::StrCat("tensor '", layer, "mlp.gate_up_proj.weight': element ",
                    (config_.intermediate_size + 2) * config_.hidden_size + 7, " (row ",
                    config_.intermediate_size + 2, ", col 7) is nan")},
      // Rank 1 of 2: the second half of q's rows, of down's columns.
      {layer + "self_attn.q_proj.weight", q_rows / 2 + 4, 9, 2, 1,
       absl::StrCat("tensor '", layer, "self_attn.qkv_proj.weight': element ",
                    4 * config_.hidden_size + 9, " (row 4, col 9) is nan")},
      {layer + "mlp.down_proj.weight", 3, i2 + 7, 2, 1,
       absl::StrCat("tensor '", layer, "mlp.down_proj.weight': element ", 3 * i2 + 7,
                    " (row 3, col 7) is nan")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.tensor);
    std::unique_ptr<ShardStore> store = MakeStore(config_, ParallelConfig{c.tp_rank, c.tp_size});
    ASSERT_NE(store, nullptr);
    std::vector<OwnedTensor> w = v2_;
    ASSERT_TRUE(set_nan(w, c.tensor, c.row, c.col));
    absl::StatusOr<RefitResult> result = PushAll(*store, w);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(result.status().message(),
                HasSubstr(absl::StrCat("checkpoint tensor '", c.tensor, "' row ", c.row, ", col ",
                                       c.col, ": ", c.kernel_at)));
  }
  // A tensor that is its own kernel, whole: no prefix repeating it.
  std::vector<OwnedTensor> w = v2_;
  ASSERT_TRUE(set_nan(w, layer + "mlp.down_proj.weight", 1, 1));
  absl::StatusOr<RefitResult> result = PushAll(*store_, w);
  EXPECT_THAT(std::string(result.status().message()),
              ::testing::Not(HasSubstr("checkpoint tensor")));
  EXPECT_THAT(result.status().message(),
              HasSubstr(absl::StrCat("tensor '", layer, "mlp.down_proj.weight': element ",
                                     config_.intermediate_size + 1, " (row 1, col 1) is nan")));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, NonFiniteValuesInKeptTensorsAreRejectedByDefault) {
  // Tensors kept in the checkpoint dtype never reach the FP8 quantizer, so
  // the reject policy needs its own check for them.
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                           "model.layers.0.post_attention_layernorm.weight"}) {
    for (const bool inf : {false, true}) {
      SCOPED_TRACE(absl::StrCat(name, inf ? " inf" : " nan"));
      std::vector<OwnedTensor> w = v2_;
      bool found = false;
      for (OwnedTensor& t : w) {
        if (t.name != name) continue;
        ASSERT_EQ(t.dtype, DType::kBFloat16);
        found = true;
        t.bytes[6] = inf ? 0x80 : 0xC0;  // bf16 0xFF80 = -inf, 0x7FC0 = NaN
        t.bytes[7] = inf ? 0xFF : 0x7F;
      }
      ASSERT_TRUE(found);
      absl::StatusOr<RefitResult> result = PushAll(*store_, w);
      EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
      EXPECT_THAT(result.status().message(), HasSubstr("element 3 is"));
      EXPECT_THAT(result.status().message(), HasSubstr(inf ? "is -inf" : "is nan"));
      EXPECT_THAT(result.status().message(), HasSubstr("non-finite"));
      ExpectUnchanged();
    }
  }
  // The vLLM-compatible policy serves them as they are.
  std::vector<OwnedTensor> w = v2_;
  for (OwnedTensor& t : w) {
    if (t.name == "model.embed_tokens.weight") {
      t.bytes[6] = 0xC0;
      t.bytes[7] = 0x7F;
    }
  }
  RefitOptions vllm;
  vllm.non_finite = NonFinitePolicy::kVllmCompatible;
  EXPECT_TRUE(PushAll(*store_, w, vllm).ok());
}

TEST(FindNonFiniteTest, FindsTheFirstNanOrInfInEveryFloatType) {
  std::vector<uint16_t> bf16(10000, 0x3F80);  // 1.0
  EXPECT_EQ(FindNonFinite(bf16.data(), DType::kBFloat16, 10000), -1);
  bf16[9000] = 0x7F80;  // +inf
  bf16[9500] = 0x7FC1;  // NaN
  EXPECT_EQ(FindNonFinite(bf16.data(), DType::kBFloat16, 10000), 9000);
  std::vector<uint16_t> f16(8, 0x3C00);
  f16[5] = 0xFC00;  // -inf
  EXPECT_EQ(FindNonFinite(f16.data(), DType::kFloat16, 8), 5);
  std::vector<float> f32(8, 1.0f);
  f32[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FindNonFinite(f32.data(), DType::kFloat32, 8), 2);
  std::vector<double> f64(8, 1.0);
  f64[7] = -std::numeric_limits<double>::infinity();
  EXPECT_EQ(FindNonFinite(f64.data(), DType::kFloat64, 8), 7);
  // The largest finite values are finite; integers never are non-finite.
  std::vector<uint16_t> max_bf16(4, 0x7F7F);
  EXPECT_EQ(FindNonFinite(max_bf16.data(), DType::kBFloat16, 4), -1);
  std::vector<uint16_t> ints(4, 0xFFFF);
  EXPECT_EQ(FindNonFinite(ints.data(), DType::kUInt16, 4), -1);
}

TEST_F(RefitSessionTest, BrokenSafetensorsChangeNothing) {
  std::string dir = TempDir("broken");
  std::string path = dir + "/model.safetensors";
  {
    std::ofstream out(path, std::ios::binary);
    uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{\"x\": {\"dtype\": \"BF16\"";
  }
  absl::StatusOr<RefitResult> result = LoadSafetensors(store_.get(), {path}, {});
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(result.status().message(), HasSubstr("model.safetensors"));
  ExpectUnchanged();
}

TEST_F(RefitSessionTest, ReadersSeeOneVersionAtATime) {
  // Two versions with known kernel bytes: odd versions hold v1_'s kernels,
  // even ones v2_'s. A reader that holds the reader lock must see every
  // kernel of the version it was handed, also while commits run.
  std::unique_ptr<ShardStore> other = MakeStore(config_);
  ASSERT_TRUE(PushAll(*other, v2_).ok());
  const std::map<std::string, std::string> odd = live_, even = Snapshot(*other);
  const std::vector<KernelView> kernels = store_->Kernels();
  ASSERT_FALSE(kernels.empty());

  // Odd while a Commit call runs: a read overlapped a commit if it began
  // during one or if a commit began or ended while it ran.
  std::atomic<uint64_t> commit_phase{0};
  absl::Mutex mu;
  int reads = 0, overlapped = 0, torn = 0;  // guarded by mu
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    while (!stop.load()) {
      const uint64_t before = commit_phase.load();
      bool one_version = true;
      store_->WithReaderLock([&](uint64_t version) {
        const std::map<std::string, std::string>& expected = version % 2 == 1 ? odd : even;
        for (const KernelView& k : kernels) {
          const std::string& want = expected.at(k.spec->name);
          one_version &= want.compare(0, std::string::npos, static_cast<const char*>(k.data),
                                      static_cast<size_t>(k.nbytes)) == 0;
        }
      });
      const uint64_t after = commit_phase.load();
      absl::MutexLock lock(&mu);
      ++reads;
      if (!one_version) ++torn;
      if (before % 2 == 1 || after != before) ++overlapped;
    }
  });
  struct StopReader {
    std::atomic<bool>* stop;
    std::thread* thread;
    ~StopReader() {
      stop->store(true);
      thread->join();
    }
  } stop_reader{&stop, &reader};

  // Commit until a few reads overlapped a commit. Before each commit the
  // reader finishes one more read, so it is running when the commit starts;
  // the bound on commits only matters if it never gets a core.
  constexpr int kOverlaps = 3;
  constexpr int kMaxCommits = 1000;
  int commits = 0;
  for (; commits < kMaxCommits; ++commits) {
    {
      absl::MutexLock lock(&mu);
      if (overlapped >= kOverlaps) break;
      const int done = reads;
      auto read_again = [&reads, done]() { return reads > done; };
      mu.Await(absl::Condition(&read_again));
    }
    absl::StatusOr<std::unique_ptr<RefitSession>> session = RefitSession::Begin(store_.get(), {});
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(IngestAll(**session, commits % 2 == 0 ? v2_ : v1_).ok());
    commit_phase.fetch_add(1);
    absl::StatusOr<RefitResult> result = (*session)->Commit();
    commit_phase.fetch_add(1);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->version, static_cast<uint64_t>(commits) + 2);
  }
  absl::MutexLock lock(&mu);
  EXPECT_GT(overlapped, 0) << reads << " reads during " << commits << " commits";
  EXPECT_EQ(torn, 0) << torn << " of " << reads << " reads mixed two versions";
}

TEST_F(RefitSessionTest, PublishesEventsInOrder) {
  std::vector<StoreEventType> events;
  int id = store_->AddListener([&](const StoreEvent& e) { events.push_back(e.type); });
  ASSERT_TRUE(PushAll(*store_, v2_).ok());
  std::unique_ptr<RefitSession> s = Begin();
  s->Abort("x");
  store_->RemoveListener(id);
  EXPECT_THAT(events,
              ::testing::ElementsAre(StoreEventType::kStagingStarted, StoreEventType::kPrepared,
                                     StoreEventType::kCommitted, StoreEventType::kStagingStarted,
                                     StoreEventType::kAborted));
}

TEST_F(RefitSessionTest, SlotIsFreeWhenTheFinishEventArrivesAndTheNextRefitIsAnnouncedAfter) {
  // A listener that sees a refit's "committed" / "aborted" can begin the next
  // refit at once, and the next refit's "staging started" reaches listeners
  // only after every listener has seen the end of this one.
  absl::Mutex mu;
  std::vector<std::pair<StoreEventType, std::string>> seen;  // event, refit id
  std::vector<std::string> holder_at_finish;                 // the store's active refit then
  absl::Notification finished;
  int id = store_->AddListener([&](const StoreEvent& e) {
    {
      absl::MutexLock lock(&mu);
      seen.emplace_back(e.type, e.refit_id);
    }
    if (e.type != StoreEventType::kCommitted && e.type != StoreEventType::kAborted) return;
    {
      absl::MutexLock lock(&mu);
      holder_at_finish.push_back(store_->active_session());
    }
    if (e.refit_id == "first" && !finished.HasBeenNotified()) {
      finished.Notify();
      // Give the other thread's Begin time to try to overtake this event.
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  absl::StatusOr<std::unique_ptr<RefitSession>> second;
  std::thread next([&] {
    finished.WaitForNotification();
    RefitOptions options;
    options.refit_id = "second";
    second = RefitSession::Begin(store_.get(), options);
  });
  RefitOptions options;
  options.refit_id = "first";
  ASSERT_TRUE(PushAll(*store_, v2_, options).ok());
  next.join();
  ASSERT_TRUE(second.ok()) << second.status();
  (*second)->Abort("x");
  store_->RemoveListener(id);
  absl::MutexLock lock(&mu);
  EXPECT_THAT(holder_at_finish, ::testing::ElementsAre("", ""));
  std::vector<std::pair<StoreEventType, std::string>> tail(seen.end() - 3, seen.end());
  EXPECT_THAT(tail,
              ::testing::ElementsAre(std::make_pair(StoreEventType::kCommitted, "first"),
                                     std::make_pair(StoreEventType::kStagingStarted, "second"),
                                     std::make_pair(StoreEventType::kAborted, "second")));
  EXPECT_EQ(store_->active_session(), "");
}

TEST_F(RefitSessionTest, StartIsAnnouncedWhenTheCallerSaysSo) {
  std::vector<StoreEventType> events;
  int id = store_->AddListener([&](const StoreEvent& e) { events.push_back(e.type); });
  RefitOptions options;
  options.announce_start = false;
  std::unique_ptr<RefitSession> s = RefitSession::Begin(store_.get(), options).value();
  EXPECT_THAT(events, ::testing::IsEmpty());
  s->AnnounceStart();
  s->AnnounceStart();
  EXPECT_THAT(events, ::testing::ElementsAre(StoreEventType::kStagingStarted));
  s->Abort("x");
  s->AnnounceStart();  // after the end: nothing
  store_->RemoveListener(id);
  EXPECT_THAT(events,
              ::testing::ElementsAre(StoreEventType::kStagingStarted, StoreEventType::kAborted));
}

TEST_F(RefitSessionTest, ProgressNeverWaitsForARunningCall) {
  // A listener runs on the committing thread after the call's locks are
  // released: progress() and state() answer from there.
  SessionState state_at_commit = SessionState::kReceiving;
  int64_t layers_at_commit = -1;
  RefitSession* current = nullptr;
  int id = store_->AddListener([&](const StoreEvent& e) {
    if (e.type != StoreEventType::kCommitted || current == nullptr) return;
    state_at_commit = current->state();
    layers_at_commit = current->progress().layers_done;
  });
  std::unique_ptr<RefitSession> session = Begin();
  current = session.get();
  for (const OwnedTensor& t : v2_)
    ASSERT_TRUE(session->Ingest(ToChunk({&t, 0, t.bytes.size()})).ok());
  ASSERT_TRUE(session->Commit().ok());
  store_->RemoveListener(id);
  EXPECT_EQ(state_at_commit, SessionState::kCommitted);
  EXPECT_EQ(layers_at_commit, static_cast<int64_t>(store_->layout().layers().size()));
}

// ---- Tensor parallelism: the ranks' slices put back together equal the full tensors.

class TensorParallelTest : public ::testing::TestWithParam<int> {};

at::Tensor AsTensor(const void* data, DType dtype, std::vector<int64_t> shape) {
  EXPECT_EQ(dtype, DType::kBFloat16);
  return at::from_blob(const_cast<void*>(data), shape, at::kBFloat16).clone();
}

at::Tensor Kernel(const ShardStore& store, const std::string& name) {
  for (const KernelView& k : store.Kernels()) {
    if (k.spec->name == name) return AsTensor(k.data, k.spec->dtype, k.spec->shape);
  }
  ADD_FAILURE() << "no kernel " << name;
  return at::Tensor();
}

TEST_P(TensorParallelTest, RankSlicesReassembleTheFullTensors) {
  const int tp = GetParam();
  ModelConfig config = FixtureConfig();
  config.num_heads = 8;
  config.num_kv_heads = 2;  // tp 4 replicates kv heads
  config.head_dim = config.hidden_size / 8;
  std::vector<OwnedTensor> w = Weights(config, 5);
  auto full = [&](const std::string& name) {
    const OwnedTensor& t = Find(w, name);
    return AsTensor(t.bytes.data(), t.dtype, t.shape);
  };
  const int64_t d = config.head_dim;
  const int64_t kv_r = std::max<int64_t>(1, config.num_kv_heads / tp);
  std::vector<at::Tensor> q, o, gate, up, down, embed;
  for (int rank = 0; rank < tp; ++rank) {
    std::unique_ptr<ShardStore> store = MakeStore(config, {rank, tp}, QuantScheme::kNone);
    ASSERT_NE(store, nullptr);
    std::unique_ptr<RefitSession> session = RefitSession::Begin(store.get(), {}).value();
    for (const auto& chunk : ShuffledChunks(w, rank + 11, 300)) {
      ASSERT_TRUE(session->Ingest(ToChunk(chunk)).ok());
    }
    absl::StatusOr<RefitResult> result = session->Commit();
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_TRUE(result->kept_layers.empty());
    for (int layer : {0, 1}) {
      std::string p = absl::StrCat("model.layers.", layer, ".");
      at::Tensor qkv = Kernel(*store, p + "self_attn.qkv_proj.weight");
      const int64_t q_rows = config.num_heads / tp * d;
      ASSERT_EQ(qkv.size(0), q_rows + 2 * kv_r * d);
      if (layer == 1) q.push_back(qkv.narrow(0, 0, q_rows));
      // k and v: this rank's kv heads, replicated when tp > num_kv_heads.
      int64_t head = tp >= config.num_kv_heads ? rank / (tp / config.num_kv_heads) : rank * kv_r;
      EXPECT_TRUE(at::equal(qkv.narrow(0, q_rows, kv_r * d),
                            full(p + "self_attn.k_proj.weight").narrow(0, head * d, kv_r * d)))
          << "rank " << rank;
      EXPECT_TRUE(at::equal(qkv.narrow(0, q_rows + kv_r * d, kv_r * d),
                            full(p + "self_attn.v_proj.weight").narrow(0, head * d, kv_r * d)));
      if (layer == 1) {
        o.push_back(Kernel(*store, p + "self_attn.o_proj.weight"));
        at::Tensor gu = Kernel(*store, p + "mlp.gate_up_proj.weight");
        gate.push_back(gu.narrow(0, 0, gu.size(0) / 2));
        up.push_back(gu.narrow(0, gu.size(0) / 2, gu.size(0) / 2));
        down.push_back(Kernel(*store, p + "mlp.down_proj.weight"));
      }
    }
    at::Tensor e = Kernel(*store, "model.embed_tokens.weight");
    EXPECT_EQ(e.size(0) % 64, 0);
    embed.push_back(e);
  }
  const std::string p = "model.layers.1.";
  EXPECT_TRUE(at::equal(at::cat(q, 0), full(p + "self_attn.q_proj.weight")));
  EXPECT_TRUE(at::equal(at::cat(o, 1), full(p + "self_attn.o_proj.weight")));
  EXPECT_TRUE(at::equal(at::cat(gate, 0), full(p + "mlp.gate_proj.weight")));
  EXPECT_TRUE(at::equal(at::cat(up, 0), full(p + "mlp.up_proj.weight")));
  at::Tensor down_full = full(p + "mlp.down_proj.weight");
  for (int r = 0; r < tp; ++r) {
    int64_t w = down[r].size(1);
    EXPECT_TRUE(at::equal(down[r], down_full.narrow(1, r * w, w)))
        << "down_proj columns of rank " << r << " of " << tp;
  }
  at::Tensor vocab = at::cat(embed, 0);
  const int64_t v = config.vocab_size;
  EXPECT_TRUE(at::equal(vocab.narrow(0, 0, v), full("model.embed_tokens.weight")));
  EXPECT_EQ(vocab.narrow(0, v, vocab.size(0) - v).abs().sum().item<float>(), 0.0f);
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelTest, ::testing::Values(1, 2, 4));

}  // namespace
}  // namespace refit::core
