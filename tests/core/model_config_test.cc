#include "core/model_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::HasSubstr;

constexpr char kLlama[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "num_hidden_layers": 32,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "vocab_size": 128256,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "rms_norm_eps": 1e-05
})";

std::string StatusMessage(const absl::Status& s) { return std::string(s.message()); }

TEST(ModelConfigTest, ParsesLlamaWithDefaults) {
  auto c = ModelConfig::FromJson(kLlama, "llama/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kLlama);
  EXPECT_EQ(c->arch_name, "LlamaForCausalLM");
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->num_layers, 32);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);  // hidden / heads
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->dtype, DType::kBFloat16);
  EXPECT_EQ(c->num_experts, 0);
}

TEST(ModelConfigTest, DefaultsKvHeadsToHeadsAndDtypeToBf16) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["MistralForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "num_key_value_heads": null})",
                                 "m.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kMistral);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->dtype, DType::kBFloat16);
}

TEST(ModelConfigTest, Qwen2AlwaysHasAttentionBias) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["Qwen2ForCausalLM"],
      "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
      "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
      "tie_word_embeddings": true, "torch_dtype": "float16"})",
                                 "qwen2.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kQwen2);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->dtype, DType::kFloat16);
  EXPECT_EQ(c->head_dim, 64);
}

TEST(ModelConfigTest, Qwen3ReadsExplicitHeadDimAndNewDtypeField) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["Qwen3ForCausalLM"],
      "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
      "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
      "vocab_size": 151936, "attention_bias": false, "dtype": "float32"})",
                                 "qwen3.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kQwen3);
  EXPECT_EQ(c->head_dim, 128);  // not hidden / heads (64)
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->dtype, DType::kFloat32);
}

TEST(ModelConfigTest, LlamaAttentionBiasComesFromTheField) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["LlamaForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "attention_bias": true})",
                                 "c.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->attention_bias);
}

TEST(ModelConfigTest, ToJsonRoundTrips) {
  for (const char* arch :
       {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}) {
    auto parsed = ModelConfig::FromJson(std::string(R"({"architectures": [")") + arch + R"("],
        "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 24,
        "vocab_size": 1000, "tie_word_embeddings": true, "torch_dtype": "float16"})",
                                        "in.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    auto again = ModelConfig::FromJson(parsed->ToJson(), "out.json");
    ASSERT_TRUE(again.ok()) << again.status() << "\n" << parsed->ToJson();
    EXPECT_EQ(again->arch, parsed->arch);
    EXPECT_EQ(again->arch_name, arch);
    EXPECT_EQ(again->hidden_size, 96);
    EXPECT_EQ(again->intermediate_size, 160);
    EXPECT_EQ(again->num_layers, 3);
    EXPECT_EQ(again->num_heads, 6);
    EXPECT_EQ(again->num_kv_heads, 2);
    EXPECT_EQ(again->head_dim, 24);
    EXPECT_EQ(again->vocab_size, 1000);
    EXPECT_TRUE(again->tie_word_embeddings);
    EXPECT_EQ(again->attention_bias, parsed->attention_bias);
    EXPECT_EQ(again->dtype, DType::kFloat16);
  }
  // A hand-built config without arch_name still names its class.
  ModelConfig bare;
  bare.arch = Architecture::kQwen3;
  bare.hidden_size = 64;
  bare.intermediate_size = 64;
  bare.num_layers = 1;
  bare.num_heads = 2;
  bare.num_kv_heads = 1;
  bare.head_dim = 32;
  bare.vocab_size = 10;
  auto back = ModelConfig::FromJson(bare.ToJson(), "bare.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->arch_name, "Qwen3ForCausalLM");
  EXPECT_EQ(back->dtype, DType::kBFloat16);
}

// Experts in a dense class (MoE classes: tests/core/moe_test.cc).
TEST(ModelConfigTest, RejectsMixtureOfExpertsInADenseClass) {
  auto mixtral = ModelConfig::FromJson(R"({"architectures": ["MistralForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "num_local_experts": 8})",
                                       "mixtral/config.json");
  EXPECT_EQ(mixtral.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(StatusMessage(mixtral.status()), HasSubstr("mixtral/config.json"));
  EXPECT_THAT(StatusMessage(mixtral.status()), HasSubstr("mixture-of-experts"));
  auto qwen_moe = ModelConfig::FromJson(R"({"architectures": ["Qwen3ForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "num_experts": 128})",
                                        "moe.json");
  EXPECT_EQ(qwen_moe.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(StatusMessage(qwen_moe.status()), HasSubstr("128 experts"));
}

TEST(ModelConfigTest, RejectsUnsupportedArchitecture) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["GPT2LMHeadModel"], "hidden_size": 64})",
                                 "gpt2.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(StatusMessage(c.status()), HasSubstr("gpt2.json"));
  EXPECT_THAT(StatusMessage(c.status()), HasSubstr("GPT2LMHeadModel"));
}

TEST(ModelConfigTest, ErrorsNameTheFileAndField) {
  struct Bad {
    std::string json;
    const char* message;
  };
  const std::string head = R"({"architectures": ["LlamaForCausalLM"], )";
  const Bad cases[] = {
      {"{not json", "not valid JSON"},
      {"[1, 2]", "expected a JSON object"},
      {R"({"hidden_size": 64})", "field 'architectures'"},
      {head + R"("intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 100})",
       "field 'hidden_size' is missing"},
      {head + R"("hidden_size": "64", "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 100})",
       "field 'hidden_size' must be a positive integer, got \"64\""},
      {head + R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 0,
          "num_attention_heads": 4, "vocab_size": 100})",
       "field 'num_hidden_layers' must be a positive integer, got 0"},
      {head + R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 100})",
       "field 'num_key_value_heads' 3 does not divide num_attention_heads 4"},
      {head + R"("hidden_size": 66, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 100})",
       "field 'head_dim' is missing and hidden_size 66"},
      {head + R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 100, "torch_dtype": "int8"})",
       "field 'torch_dtype' must be bfloat16, float16 or float32, got \"int8\""},
      {head + R"("hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": 100, "tie_word_embeddings": "yes"})",
       "field 'tie_word_embeddings' must be true or false"},
  };
  for (const Bad& bad : cases) {
    auto c = ModelConfig::FromJson(bad.json, "dir/config.json");
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bad.message;
    EXPECT_THAT(StatusMessage(c.status()), HasSubstr("dir/config.json")) << bad.message;
    EXPECT_THAT(StatusMessage(c.status()), HasSubstr(bad.message));
  }
}

TEST(ModelConfigTest, FromFileReadsAndReportsMissingFiles) {
  const std::string path =
      ::testing::TempDir() + "model_config_test_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path);
    out << kLlama;
  }
  auto c = ModelConfig::FromFile(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 8);
  std::remove(path.c_str());
  auto missing = ModelConfig::FromFile(path);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(StatusMessage(missing.status()), HasSubstr(path));
}

TEST(ModelConfigTest, FromFileOfAnUnreadableFileIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files regardless of mode";
  const std::string path =
      ::testing::TempDir() + "model_config_test_secret_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path);
    out << kLlama;
  }
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  auto c = ModelConfig::FromFile(path);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(StatusMessage(c.status()), HasSubstr(path));
  std::remove(path.c_str());
}

TEST(ModelConfigTest, FromFileThroughAFileIsNotFoundAndAnOverlongNameInvalid) {
  const std::string file =
      ::testing::TempDir() + "model_config_test_plain_" + std::to_string(::getpid());
  {
    std::ofstream out(file);
    out << "x";
  }
  auto through = ModelConfig::FromFile(file + "/config.json");
  EXPECT_EQ(through.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(StatusMessage(through.status()), HasSubstr(file + "/config.json"));
  std::remove(file.c_str());

  const std::string overlong = ::testing::TempDir() + std::string(300, 'x') + ".json";
  auto c = ModelConfig::FromFile(overlong);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(StatusMessage(c.status()), HasSubstr("cannot open"));
}

TEST(ModelConfigTest, FromFileReportsParseErrorsWithThePath) {
  const std::string path =
      ::testing::TempDir() + "model_config_test_bad_" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream out(path);
    out << R"({"architectures": ["GPT2LMHeadModel"]})";
  }
  auto c = ModelConfig::FromFile(path);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(StatusMessage(c.status()), HasSubstr(path + ": field 'architectures'"));
  std::remove(path.c_str());
}

TEST(ModelConfigTest, RejectsMistypedOptionalFields) {
  const std::string head = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
      "vocab_size": 100, )";
  const std::pair<std::string, const char*> cases[] = {
      {head + R"("head_dim": -16})", "field 'head_dim' must be a positive integer, got -16"},
      {head + R"("num_key_value_heads": 2.5})",
       "field 'num_key_value_heads' must be a positive integer, got 2.5"},
      {head + R"("num_experts": -1})", "field 'num_experts' must be a non-negative integer"},
      {head + R"("attention_bias": 1})", "field 'attention_bias' must be true or false, got 1"},
      {head + R"("dtype": 16})", "field 'dtype' must be a string, got 16"},
      {R"({"architectures": [], "hidden_size": 64})", "field 'architectures' must be a non-empty"},
  };
  for (const auto& [json, message] : cases) {
    auto c = ModelConfig::FromJson(json, "m/config.json");
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(StatusMessage(c.status()), HasSubstr("m/config.json: "));
    EXPECT_THAT(StatusMessage(c.status()), HasSubstr(message));
  }
}

}  // namespace
}  // namespace refit::core
