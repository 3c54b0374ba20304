#include "core/fixture_model.h"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/model_layout.h"
#include "core/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace refit::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using ::refit::testing::RemoveTree;

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string TempDir(absl::string_view name) {
  std::string dir =
      absl::StrCat(::testing::TempDir(), "fixture_model_test_", ::getpid(), "_", name);
  RemoveTree(dir);
  return dir;
}

struct Moments {
  double mean = 0;
  double std = 0;
};

Moments MomentsOf(const OwnedTensor& t) {
  const size_t n = t.bytes.size() / DTypeSize(t.dtype);
  double sum = 0, sq = 0;
  for (size_t i = 0; i < n; ++i) {
    const double v = LoadAsFloat(t.bytes.data(), t.dtype, i);
    sum += v;
    sq += v * v;
  }
  Moments m;
  m.mean = sum / n;
  m.std = std::sqrt(sq / n - m.mean * m.mean);
  return m;
}

TEST(FixtureModelTest, ConfigIsTheDocumentedDemoModel) {
  const ModelConfig c = FixtureConfig();
  EXPECT_EQ(c.arch, Architecture::kLlama);
  EXPECT_EQ(c.arch_name, "LlamaForCausalLM");
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 352);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.vocab_size, 1000);
  EXPECT_EQ(c.dtype, DType::kBFloat16);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(FixtureConfig(Architecture::kQwen2).attention_bias);
  EXPECT_EQ(FixtureConfig(Architecture::kQwen3).arch_name, "Qwen3ForCausalLM");
  // It fits every tensor-parallel size the tests use.
  for (int64_t tp : {1, 2, 4}) {
    auto layout = ModelLayout::Build(c, {tp - 1, tp}, QuantScheme::kBlock128);
    EXPECT_TRUE(layout.ok()) << layout.status();
  }
}

TEST(FixtureModelTest, WeightsCoverEveryRequiredCheckpointTensor) {
  for (Architecture arch : {Architecture::kLlama, Architecture::kQwen2, Architecture::kQwen3}) {
    const ModelConfig c = FixtureConfig(arch);
    auto layout = ModelLayout::Build(c, {0, 1}, QuantScheme::kNone);
    ASSERT_TRUE(layout.ok()) << layout.status();
    std::vector<std::string> expected;
    for (const CheckpointTensor& t : (*layout)->checkpoint_tensors()) {
      if (t.use == CheckpointTensor::Use::kTarget && !t.optional) expected.push_back(t.name);
    }
    auto weights = MakeFixtureWeights(c, 1);
    ASSERT_TRUE(weights.ok()) << weights.status();
    std::vector<std::string> names;
    for (const OwnedTensor& t : *weights) {
      names.push_back(t.name);
      EXPECT_EQ(t.dtype, DType::kBFloat16) << t.name;
      int64_t numel = 1;
      for (int64_t d : t.shape) numel *= d;
      EXPECT_EQ(t.bytes.size(), static_cast<size_t>(numel) * 2) << t.name;
    }
    EXPECT_EQ(names, expected);
    // 2 layers x (q, k, v, o, gate, up, down, 2 norms) + embed + norm + lm_head,
    // plus q/k/v bias (Qwen2) or q/k norms (Qwen3).
    const size_t extra = arch == Architecture::kLlama ? 0 : arch == Architecture::kQwen2 ? 6 : 4;
    EXPECT_EQ(names.size(), 2 * 9 + 3 + extra);
  }
}

TEST(FixtureModelTest, WeightsAreDeterministicAndDependOnSeed) {
  const ModelConfig c = FixtureConfig();
  auto a = MakeFixtureWeights(c, 42);
  auto b = MakeFixtureWeights(c, 42);
  auto other = MakeFixtureWeights(c, 43);
  ASSERT_TRUE(a.ok() && b.ok() && other.ok());
  ASSERT_EQ(a->size(), other->size());
  for (size_t i = 0; i < a->size(); ++i) {
    EXPECT_EQ((*a)[i].bytes, (*b)[i].bytes) << (*a)[i].name;
    EXPECT_NE((*a)[i].bytes, (*other)[i].bytes) << (*a)[i].name;
  }
  // Different tensors of one model are not copies of each other.
  EXPECT_NE((*a)[1].bytes, (*a)[2].bytes);
}

TEST(FixtureModelTest, WeightsLookNormalAndNormsAreAroundOne) {
  ModelConfig c = FixtureConfig();
  c.dtype = DType::kFloat32;
  auto weights = MakeFixtureWeights(c, 7);
  ASSERT_TRUE(weights.ok()) << weights.status();
  std::map<std::string, const OwnedTensor*> by_name;
  for (const OwnedTensor& t : *weights) by_name[t.name] = &t;
  const OwnedTensor& embed = *by_name.at("model.embed_tokens.weight");
  EXPECT_EQ(embed.dtype, DType::kFloat32);
  EXPECT_THAT(embed.shape, ElementsAre(1000, 128));
  const Moments w = MomentsOf(embed);
  EXPECT_NEAR(w.mean, 0.0, 0.002);
  EXPECT_NEAR(w.std, 0.05, 0.002);
  const Moments n = MomentsOf(*by_name.at("model.layers.1.post_attention_layernorm.weight"));
  EXPECT_NEAR(n.mean, 1.0, 0.01);
  EXPECT_GT(n.std, 0.005);
  EXPECT_LT(n.std, 0.05);
}

TEST(FixtureModelTest, LargeTensorsAreGeneratedCompletely) {
  // Big enough that generation is split over threads; every chunk must be
  // filled (an unwritten chunk would show up as a run of exact zeros; the
  // generator itself gives 0 with probability ~1e-5).
  ModelConfig c = FixtureConfig();
  c.num_layers = 1;
  c.vocab_size = 40000;
  auto weights = MakeFixtureWeights(c, 3);
  ASSERT_TRUE(weights.ok()) << weights.status();
  const OwnedTensor& embed = (*weights)[0];
  ASSERT_EQ(embed.name, "model.embed_tokens.weight");
  const size_t n = embed.bytes.size() / 2;
  size_t zeros = 0;
  for (size_t i = 0; i < n; ++i) zeros += LoadAsFloat(embed.bytes.data(), embed.dtype, i) == 0.0f;
  EXPECT_LT(zeros, n / 10000);
  auto again = MakeFixtureWeights(c, 3);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)[0].bytes, embed.bytes);
}

TEST(FixtureModelTest, WritesConfigAndShardedSafetensors) {
  const std::string dir = TempDir("write");
  const ModelConfig c = FixtureConfig(Architecture::kQwen2);
  absl::Status s = WriteFixtureModel(dir, c, 5, 3);
  ASSERT_TRUE(s.ok()) << s;

  auto config = ModelConfig::FromFile(dir + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->arch, Architecture::kQwen2);
  EXPECT_EQ(config->vocab_size, 1000);
  EXPECT_EQ(config->num_kv_heads, 2);
  EXPECT_EQ(config->dtype, DType::kBFloat16);

  auto files = ListSafetensorsFiles(dir);
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 3u);
  EXPECT_THAT((*files)[0], HasSubstr("model-00001-of-00003.safetensors"));
  EXPECT_THAT((*files)[2], HasSubstr("model-00003-of-00003.safetensors"));
  EXPECT_TRUE(Exists(dir + "/model.safetensors.index.json"));

  auto weights = MakeFixtureWeights(c, 5);
  ASSERT_TRUE(weights.ok());
  std::vector<std::string> read_order;
  std::map<std::string, std::vector<uint8_t>> read;
  for (const std::string& path : *files) {
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_FALSE((*file)->tensors().empty()) << path;
    for (const TensorEntry& e : (*file)->tensors()) {
      read_order.push_back(e.name);
      absl::StatusOr<std::string> bytes = (*file)->ReadAll(e);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      read[e.name].assign(bytes->begin(), bytes->end());
    }
  }
  ASSERT_EQ(read_order.size(), weights->size());
  for (size_t i = 0; i < weights->size(); ++i) {
    const OwnedTensor& t = (*weights)[i];
    EXPECT_EQ(read_order[i], t.name);  // checkpoint order across the files
    EXPECT_EQ(read[t.name], t.bytes) << t.name;
  }
  RemoveTree(dir);
}

TEST(FixtureModelTest, RejectsImpossibleFileCounts) {
  const std::string dir = TempDir("bad");
  absl::Status zero = WriteFixtureModel(dir, FixtureConfig(), 1, 0);
  EXPECT_EQ(zero.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(zero.message()), HasSubstr("num_files"));
  absl::Status many = WriteFixtureModel(dir, FixtureConfig(), 1, 1000);
  EXPECT_EQ(many.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(many.message()), HasSubstr("got 1000"));
  ModelConfig bad = FixtureConfig();
  bad.num_heads = 0;
  absl::Status invalid = WriteFixtureModel(dir, bad, 1);
  EXPECT_EQ(invalid.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(invalid.message()), HasSubstr("num_attention_heads"));
  EXPECT_FALSE(Exists(dir + "/config.json"));
  RemoveTree(dir);
}

TEST(FixtureModelTest, RejectsDtypesATrainerCannotPush) {
  ModelConfig config = FixtureConfig();
  config.dtype = DType::kInt8;
  absl::StatusOr<std::vector<OwnedTensor>> weights = MakeFixtureWeights(config, 1);
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(weights.status().message()),
              HasSubstr("dtype must be bf16, fp16 or fp32, got I8"));
  const std::string dir = TempDir("int8");
  absl::Status written = WriteFixtureModel(dir, config, 1);
  EXPECT_EQ(written.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(written.message()), HasSubstr("got I8"));
  EXPECT_FALSE(Exists(dir));
}

TEST(FixtureModelTest, MixtureOfExpertsIsUnimplemented) {
  ModelConfig config = FixtureConfig();
  config.num_experts = 8;
  absl::StatusOr<std::vector<OwnedTensor>> weights = MakeFixtureWeights(config, 1);
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(weights.status().message()), HasSubstr("mixture-of-experts"));
}

TEST(FixtureModelTest, DirectoryThatIsAFileIsInvalidAndBelowAFileInternal) {
  const std::string base = TempDir("file");
  ASSERT_EQ(::mkdir(base.c_str(), 0755), 0);
  const std::string file = base + "/plain";
  std::ofstream(file) << "x";
  absl::Status is_file = WriteFixtureModel(file, FixtureConfig(), 1);
  EXPECT_EQ(is_file.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(is_file.message()), HasSubstr(file + ": not a directory"));
  absl::Status below = WriteFixtureModel(file + "/model", FixtureConfig(), 1);
  EXPECT_EQ(below.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(below.message()), HasSubstr(file + "/model: cannot create"));
  RemoveTree(base);
}

}  // namespace
}  // namespace refit::core
