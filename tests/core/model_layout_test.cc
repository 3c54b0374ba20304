#include "core/model_layout.h"

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ModelConfig MakeConfig(Architecture arch, int64_t heads, int64_t kv_heads, int64_t vocab,
                       bool attention_bias = false, bool tied = false) {
  ModelConfig c;
  c.arch = arch;
  c.arch_name = arch == Architecture::kQwen2   ? "Qwen2ForCausalLM"
                : arch == Architecture::kQwen3 ? "Qwen3ForCausalLM"
                                               : "LlamaForCausalLM";
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 2;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = 8;
  c.vocab_size = vocab;
  c.attention_bias = attention_bias || arch == Architecture::kQwen2;
  c.tie_word_embeddings = tied;
  c.dtype = DType::kFloat32;
  return c;
}

std::shared_ptr<const ModelLayout> BuildOrDie(const ModelConfig& c, int64_t rank, int64_t tp,
                                              QuantScheme quant = QuantScheme::kPerTensor) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(c, {rank, tp}, quant);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *layout : nullptr;
}

at::Tensor Full(const CheckpointTensor& t) { return at::randn(t.shape, at::kFloat); }

// One rank's params after applying every target's SliceSpec, plus how many
// times each element was written.
struct RankBuffers {
  std::shared_ptr<const ModelLayout> layout;
  std::vector<std::vector<at::Tensor>> params;
  std::vector<std::vector<at::Tensor>> writes;

  const at::Tensor& Param(absl::string_view layer, absl::string_view suffix) const {
    const int l = layout->FindLayer(layer);
    EXPECT_GE(l, 0) << layer;
    const std::vector<ParamSpec>& specs = layout->layers()[l].params;
    for (size_t p = 0; p < specs.size(); ++p) {
      if (specs[p].suffix == suffix) return params[l][p];
    }
    ADD_FAILURE() << "no param " << suffix << " in " << layer;
    return params[l][0];
  }
};

// The 2-D block copy that the session does, written independently here.
void ApplySlice(const at::Tensor& src, const SliceSpec& s, at::Tensor& param, at::Tensor& writes) {
  if (s.numel() == 0) return;
  at::Tensor src2d = src.dim() == 0   ? src.reshape({1, 1})
                     : src.dim() == 1 ? src.reshape({src.size(0), 1})
                                      : src;
  const int64_t param_rows = param.numel() / s.num_cols;
  ASSERT_EQ(param_rows * s.num_cols, param.numel());
  ASSERT_LE(s.dst_row + s.num_rows, param_rows);
  ASSERT_LE(s.src_row + s.num_rows, src2d.size(0));
  ASSERT_LE(s.src_col + s.num_cols, src2d.size(1));
  at::Tensor block = src2d.narrow(0, s.src_row, s.num_rows).narrow(1, s.src_col, s.num_cols);
  param.view({param_rows, s.num_cols}).narrow(0, s.dst_row, s.num_rows).copy_(block);
  writes.view({param_rows, s.num_cols}).narrow(0, s.dst_row, s.num_rows).add_(1);
}

RankBuffers LoadRank(const ModelConfig& c, int64_t rank, int64_t tp,
                     const std::map<std::string, at::Tensor>& full) {
  RankBuffers b;
  b.layout = BuildOrDie(c, rank, tp);
  for (const LayerSpec& layer : b.layout->layers()) {
    b.params.emplace_back();
    b.writes.emplace_back();
    for (const ParamSpec& p : layer.params) {
      b.params.back().push_back(at::zeros(p.shape, at::kFloat));
      b.writes.back().push_back(at::zeros(p.shape, at::kInt));
    }
  }
  for (const CheckpointTensor& t : b.layout->checkpoint_tensors()) {
    if (t.use != CheckpointTensor::Use::kTarget) continue;
    auto it = full.find(t.name);
    EXPECT_NE(it, full.end()) << t.name;
    if (it == full.end()) continue;
    ApplySlice(it->second, t.slice, b.params[t.layer][t.param], b.writes[t.layer][t.param]);
  }
  return b;
}

struct TpCase {
  const char* label;
  ModelConfig config;
};

class ModelLayoutTpTest : public ::testing::TestWithParam<std::tuple<int, int64_t>> {
 protected:
  static std::vector<TpCase> Cases() {
    return {
        // tp = 4 > kv heads: one replicated kv head per rank; o_proj bias.
        {"llama_kv_replicated", MakeConfig(Architecture::kLlama, 8, 2, 1000, true)},
        // kv heads divisible by every tp: plain split; q/k/v bias.
        {"qwen2_kv_split", MakeConfig(Architecture::kQwen2, 8, 4, 1000)},
        // Tiny vocab: at tp 4 the last ranks own only padding rows.
        {"qwen3_small_vocab", MakeConfig(Architecture::kQwen3, 4, 4, 100)},
    };
  }
};

TEST_P(ModelLayoutTpTest, SlicesReassembleTheFullCheckpoint) {
  const auto [case_index, tp] = GetParam();
  const TpCase tc = Cases()[case_index];
  const ModelConfig& c = tc.config;
  SCOPED_TRACE(absl::StrCat(tc.label, " tp=", tp));
  at::manual_seed(7);

  // Full tensors from the unsharded layout (which must equal every rank's list).
  std::shared_ptr<const ModelLayout> unsharded = BuildOrDie(c, 0, 1, QuantScheme::kNone);
  std::map<std::string, at::Tensor> full;
  for (const CheckpointTensor& t : unsharded->checkpoint_tensors()) {
    if (t.use == CheckpointTensor::Use::kTarget) full[t.name] = Full(t);
  }

  std::vector<RankBuffers> ranks;
  for (int64_t r = 0; r < tp; ++r) ranks.push_back(LoadRank(c, r, tp, full));

  const int64_t d = c.head_dim;
  const int64_t nh_r = c.num_heads / tp;
  const bool replicated = tp > c.num_kv_heads;
  const int64_t nkv_r = replicated ? 1 : c.num_kv_heads / tp;
  const int64_t i_r = c.intermediate_size / tp;
  // vLLM's VocabParallelEmbedding: pad the vocabulary to 64, then divide.
  const int64_t v_r = (c.vocab_size + 63) / 64 * 64 / tp;

  for (int64_t r = 0; r < tp; ++r) {
    const RankBuffers& b = ranks[r];
    // Every param element written exactly once, padding never, and the
    // counts agree with the layout's loaded_numel / expected_numel.
    for (size_t l = 0; l < b.layout->layers().size(); ++l) {
      const LayerSpec& layer = b.layout->layers()[l];
      int64_t loaded = 0;
      for (size_t p = 0; p < layer.params.size(); ++p) {
        const ParamSpec& spec = layer.params[p];
        const at::Tensor& w = b.writes[l][p];
        EXPECT_LE(w.max().item<int>(), 1) << layer.name << "." << spec.suffix;
        EXPECT_EQ(w.sum().item<int64_t>(), spec.loaded_numel) << layer.name << "." << spec.suffix;
        loaded += spec.loaded_numel;
      }
      if (layer.kind == LayerKind::kAttention) {
        EXPECT_EQ(layer.expected_numel, 0) << layer.name;
      } else {
        EXPECT_EQ(layer.expected_numel, loaded) << layer.name;
      }
    }
  }

  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i);
    const std::string attn = p + ".self_attn.";
    std::vector<at::Tensor> q_parts, o_parts, gate_parts, up_parts, down_parts, qb_parts;
    for (int64_t r = 0; r < tp; ++r) {
      const RankBuffers& b = ranks[r];
      const at::Tensor& qkv = b.Param(attn + "qkv_proj", "weight");
      ASSERT_EQ(qkv.size(0), (nh_r + 2 * nkv_r) * d);
      q_parts.push_back(qkv.narrow(0, 0, nh_r * d));
      at::Tensor k = qkv.narrow(0, nh_r * d, nkv_r * d);
      at::Tensor v = qkv.narrow(0, (nh_r + nkv_r) * d, nkv_r * d);
      const int64_t head0 = replicated ? r / (tp / c.num_kv_heads) : r * nkv_r;
      EXPECT_TRUE(at::equal(k, full[attn + "k_proj.weight"].narrow(0, head0 * d, nkv_r * d)))
          << "rank " << r << " layer " << i;
      EXPECT_TRUE(at::equal(v, full[attn + "v_proj.weight"].narrow(0, head0 * d, nkv_r * d)))
          << "rank " << r << " layer " << i;
      if (c.attention_bias) {
        const at::Tensor& bias = b.Param(attn + "qkv_proj", "bias");
        qb_parts.push_back(bias.narrow(0, 0, nh_r * d));
        EXPECT_TRUE(at::equal(bias.narrow(0, nh_r * d, nkv_r * d),
                              full[attn + "k_proj.bias"].narrow(0, head0 * d, nkv_r * d)));
        EXPECT_TRUE(at::equal(bias.narrow(0, (nh_r + nkv_r) * d, nkv_r * d),
                              full[attn + "v_proj.bias"].narrow(0, head0 * d, nkv_r * d)));
      }
      o_parts.push_back(b.Param(attn + "o_proj", "weight"));
      const at::Tensor& gate_up = b.Param(p + ".mlp.gate_up_proj", "weight");
      gate_parts.push_back(gate_up.narrow(0, 0, i_r));
      up_parts.push_back(gate_up.narrow(0, i_r, i_r));
      down_parts.push_back(b.Param(p + ".mlp.down_proj", "weight"));
      // Replicated layers hold the whole tensor on every rank.
      EXPECT_TRUE(at::equal(b.Param(p + ".input_layernorm", "weight"),
                            full[p + ".input_layernorm.weight"]));
      if (c.arch == Architecture::kQwen3) {
        EXPECT_TRUE(at::equal(b.Param(attn + "q_norm", "weight"), full[attn + "q_norm.weight"]));
        EXPECT_TRUE(at::equal(b.Param(attn + "k_norm", "weight"), full[attn + "k_norm.weight"]));
      }
      if (c.attention_bias && c.arch != Architecture::kQwen2) {
        EXPECT_TRUE(at::equal(b.Param(attn + "o_proj", "bias"), full[attn + "o_proj.bias"]));
      }
    }
    EXPECT_TRUE(at::equal(at::cat(q_parts, 0), full[attn + "q_proj.weight"])) << i;
    if (c.attention_bias) {
      EXPECT_TRUE(at::equal(at::cat(qb_parts, 0), full[attn + "q_proj.bias"]));
    }
    EXPECT_TRUE(at::equal(at::cat(o_parts, 1), full[attn + "o_proj.weight"])) << i;
    EXPECT_TRUE(at::equal(at::cat(gate_parts, 0), full[p + ".mlp.gate_proj.weight"])) << i;
    EXPECT_TRUE(at::equal(at::cat(up_parts, 0), full[p + ".mlp.up_proj.weight"])) << i;
    EXPECT_TRUE(at::equal(at::cat(down_parts, 1), full[p + ".mlp.down_proj.weight"])) << i;
  }

  for (const char* name : {"model.embed_tokens", "lm_head"}) {
    std::vector<at::Tensor> rows;
    for (int64_t r = 0; r < tp; ++r) {
      const at::Tensor& w = ranks[r].Param(name, "weight");
      ASSERT_EQ(w.size(0), v_r) << name;
      const int64_t begin = std::min(r * v_r, c.vocab_size);
      const int64_t owned = std::min((r + 1) * v_r, c.vocab_size) - begin;
      rows.push_back(w.narrow(0, 0, owned));
      EXPECT_EQ(w.narrow(0, owned, v_r - owned).count_nonzero().item<int64_t>(), 0)
          << name << " padding of rank " << r;
    }
    EXPECT_TRUE(at::equal(at::cat(rows, 0), full[absl::StrCat(name, ".weight")])) << name;
  }
  EXPECT_TRUE(at::equal(ranks[tp - 1].Param("model.norm", "weight"), full["model.norm.weight"]));
}

INSTANTIATE_TEST_SUITE_P(AllCases, ModelLayoutTpTest,
                         ::testing::Combine(::testing::Values(0, 1, 2),
                                            ::testing::Values<int64_t>(1, 2, 4)));

TEST(ModelLayoutTest, ReplicatesKvHeadsWhenTpExceedsKvHeads) {
  ModelConfig c = MakeConfig(Architecture::kLlama, 8, 2, 1000);
  for (int64_t r = 0; r < 4; ++r) {
    auto layout = BuildOrDie(c, r, 4);
    const LayerSpec& qkv = layout->layers()[layout->FindLayer("model.layers.0.self_attn.qkv_proj")];
    // 2 q heads + 1 k head + 1 v head of 8 rows each.
    EXPECT_THAT(qkv.params[0].shape, ElementsAre(32, 64));
    NameMapper mapper(layout);
    auto k = mapper.Lookup("model.layers.0.self_attn.k_proj.weight");
    ASSERT_TRUE(k.ok()) << k.status();
    EXPECT_EQ((*k)->slice.src_row, (r / 2) * 8);
    EXPECT_EQ((*k)->slice.num_rows, 8);
    EXPECT_EQ((*k)->slice.dst_row, 16);
    auto v = mapper.Lookup("model.layers.0.self_attn.v_proj.weight");
    ASSERT_TRUE(v.ok());
    EXPECT_EQ((*v)->slice.dst_row, 24);
  }
}

TEST(ModelLayoutTest, LayersComeInModuleOrder) {
  ModelConfig c = MakeConfig(Architecture::kQwen3, 4, 2, 1000);
  c.num_layers = 1;
  auto layout = BuildOrDie(c, 0, 1);
  std::vector<std::string> names;
  std::vector<LayerKind> kinds;
  for (const LayerSpec& l : layout->layers()) {
    names.push_back(l.name);
    kinds.push_back(l.kind);
  }
  EXPECT_THAT(
      names, ElementsAre("model.embed_tokens", "model.layers.0.input_layernorm",
                         "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.q_norm",
                         "model.layers.0.self_attn.k_norm", "model.layers.0.self_attn.o_proj",
                         "model.layers.0.self_attn.attn", "model.layers.0.post_attention_layernorm",
                         "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                         "model.norm", "lm_head"));
  EXPECT_THAT(kinds, ElementsAre(LayerKind::kEmbedding, LayerKind::kNorm, LayerKind::kLinear,
                                 LayerKind::kNorm, LayerKind::kNorm, LayerKind::kLinear,
                                 LayerKind::kAttention, LayerKind::kNorm, LayerKind::kLinear,
                                 LayerKind::kLinear, LayerKind::kNorm, LayerKind::kEmbedding));
  const LayerSpec& q_norm = layout->layers()[3];
  EXPECT_THAT(q_norm.params[0].shape, ElementsAre(8));
  EXPECT_THAT(q_norm.kernels[0].shape, ElementsAre(8));
  EXPECT_EQ(layout->FindLayer("model.layers.0.self_attn.o_proj"), 5);
  EXPECT_EQ(layout->FindLayer("model.layers.1.self_attn.o_proj"), -1);
}

TEST(ModelLayoutTest, LlamaHasNoQkNormsOrBiasByDefault) {
  auto layout = BuildOrDie(MakeConfig(Architecture::kLlama, 4, 2, 1000), 0, 1);
  EXPECT_EQ(layout->FindLayer("model.layers.0.self_attn.q_norm"), -1);
  const LayerSpec& qkv = layout->layers()[layout->FindLayer("model.layers.0.self_attn.qkv_proj")];
  ASSERT_EQ(qkv.params.size(), 1u);
  NameMapper mapper(layout);
  auto bias = mapper.Lookup("model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(bias.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(bias.status().message()), HasSubstr("no bias"));
  auto norm = mapper.Lookup("model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(norm.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(norm.status().message()), HasSubstr("Qwen3"));
}

TEST(ModelLayoutTest, Qwen2HasQkvBiasButNoOProjBias) {
  auto layout = BuildOrDie(MakeConfig(Architecture::kQwen2, 4, 2, 1000), 0, 2);
  const LayerSpec& qkv = layout->layers()[layout->FindLayer("model.layers.1.self_attn.qkv_proj")];
  ASSERT_EQ(qkv.params.size(), 2u);
  EXPECT_EQ(qkv.params[1].suffix, "bias");
  EXPECT_THAT(qkv.params[1].shape, ElementsAre((2 + 2 * 1) * 8));
  EXPECT_EQ(qkv.kernels.back().name, "model.layers.1.self_attn.qkv_proj.bias");
  EXPECT_EQ(qkv.kernels.back().dtype, DType::kFloat32);  // the checkpoint dtype
  const LayerSpec& o = layout->layers()[layout->FindLayer("model.layers.1.self_attn.o_proj")];
  EXPECT_EQ(o.params.size(), 1u);
  NameMapper mapper(layout);
  auto kb = mapper.Lookup("model.layers.1.self_attn.k_proj.bias");
  ASSERT_TRUE(kb.ok()) << kb.status();
  EXPECT_THAT((*kb)->shape, ElementsAre(16));
  EXPECT_EQ((*kb)->slice.num_cols, 1);
  EXPECT_EQ((*kb)->slice.dst_row, 16);
}

TEST(ModelLayoutTest, TiedEmbeddingsIgnoreLmHead) {
  auto layout = BuildOrDie(MakeConfig(Architecture::kLlama, 4, 2, 1000, false, true), 0, 1);
  EXPECT_EQ(layout->FindLayer("lm_head"), -1);
  EXPECT_EQ(layout->layers().back().name, "model.norm");
  NameMapper mapper(layout);
  auto lm = mapper.Lookup("lm_head.weight");
  ASSERT_TRUE(lm.ok()) << lm.status();
  EXPECT_EQ((*lm)->use, CheckpointTensor::Use::kIgnored);
  EXPECT_TRUE((*lm)->optional);
  // Ignored names come after every target.
  bool seen_ignored = false;
  for (const CheckpointTensor& t : layout->checkpoint_tensors()) {
    if (t.use == CheckpointTensor::Use::kIgnored) seen_ignored = true;
    if (seen_ignored) {
      EXPECT_EQ(t.use, CheckpointTensor::Use::kIgnored) << t.name;
    }
  }
  auto inv_freq = mapper.Lookup("model.layers.1.self_attn.rotary_emb.inv_freq");
  ASSERT_TRUE(inv_freq.ok()) << inv_freq.status();
  EXPECT_EQ((*inv_freq)->use, CheckpointTensor::Use::kIgnored);
  EXPECT_THAT((*inv_freq)->shape, ElementsAre(4));
  EXPECT_EQ((*inv_freq)->dtype, DType::kFloat32);
}

TEST(ModelLayoutTest, KernelShapesFollowTheQuantScheme) {
  ModelConfig c = MakeConfig(Architecture::kLlama, 4, 2, 1000);
  c.hidden_size = 300;  // not a multiple of 128: block scales round up
  c.head_dim = 75;
  c.dtype = DType::kBFloat16;
  struct Expect {
    QuantScheme quant;
    bool quantized;
    std::vector<std::string> suffixes;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<DType> dtypes;
  };
  // down_proj at tp 2: N = 300, K = 48.
  const Expect cases[] = {
      {QuantScheme::kNone, false, {"weight"}, {{300, 48}}, {DType::kBFloat16}},
      {QuantScheme::kPerTensor,
       true,
       {"weight", "weight_scale"},
       {{300, 48}, {1}},
       {DType::kFloat8E4M3, DType::kFloat32}},
      {QuantScheme::kPerChannel,
       true,
       {"weight", "weight_scale"},
       {{300, 48}, {300, 1}},
       {DType::kFloat8E4M3, DType::kFloat32}},
      {QuantScheme::kBlock128,
       true,
       {"weight", "weight_scale_inv"},
       {{300, 48}, {3, 1}},
       {DType::kFloat8E4M3, DType::kFloat32}},
  };
  for (const Expect& e : cases) {
    SCOPED_TRACE(QuantSchemeName(e.quant));
    auto layout = BuildOrDie(c, 1, 2, e.quant);
    EXPECT_EQ(layout->quant(), e.quant);
    const LayerSpec& down = layout->layers()[layout->FindLayer("model.layers.0.mlp.down_proj")];
    EXPECT_EQ(down.quantized, e.quantized);
    ASSERT_EQ(down.kernels.size(), e.suffixes.size());
    for (size_t k = 0; k < e.suffixes.size(); ++k) {
      EXPECT_EQ(down.kernels[k].suffix, e.suffixes[k]);
      EXPECT_EQ(down.kernels[k].name, "model.layers.0.mlp.down_proj." + e.suffixes[k]);
      EXPECT_EQ(down.kernels[k].shape, e.shapes[k]);
      EXPECT_EQ(down.kernels[k].dtype, e.dtypes[k]);
    }
    EXPECT_THAT(down.params[0].shape, ElementsAre(300, 48));
    EXPECT_EQ(down.params[0].dtype, DType::kBFloat16);
    // Embeddings and norms stay in the checkpoint dtype under every scheme.
    const LayerSpec& embed = layout->layers()[0];
    EXPECT_FALSE(embed.quantized);
    EXPECT_EQ(embed.kernels[0].dtype, DType::kBFloat16);
    EXPECT_THAT(embed.kernels[0].shape, ElementsAre(512, 300));
    EXPECT_EQ(embed.params[0].loaded_numel, (1000 - 512) * 300);

    int64_t kernels = 0, bytes = 0, max_param = 0;
    for (const LayerSpec& l : layout->layers()) {
      kernels += static_cast<int64_t>(l.kernels.size());
      for (const KernelSpec& k : l.kernels) bytes += k.nbytes();
      max_param = std::max(max_param, l.param_bytes());
    }
    EXPECT_EQ(layout->num_kernels(), kernels);
    EXPECT_EQ(layout->kernel_bytes(), bytes);
    EXPECT_EQ(layout->max_layer_param_bytes(), max_param);
  }
  // Block scales of qkv_proj at tp 2: N = (2 + 2*1) * 75 = 300, K = 300.
  auto block = BuildOrDie(c, 0, 2, QuantScheme::kBlock128);
  const LayerSpec& qkv = block->layers()[block->FindLayer("model.layers.1.self_attn.qkv_proj")];
  EXPECT_THAT(qkv.kernels[1].shape, ElementsAre(3, 3));
  EXPECT_EQ(qkv.kernels[1].nbytes(), 9 * 4);
}

TEST(ModelLayoutTest, AttentionLayerHasOptionalScalarScales) {
  auto layout = BuildOrDie(MakeConfig(Architecture::kLlama, 4, 2, 1000), 0, 1);
  const LayerSpec& attn = layout->layers()[layout->FindLayer("model.layers.0.self_attn.attn")];
  EXPECT_EQ(attn.kind, LayerKind::kAttention);
  EXPECT_EQ(attn.expected_numel, 0);
  std::vector<std::string> params;
  for (const ParamSpec& p : attn.params) {
    params.push_back(p.suffix);
    EXPECT_TRUE(p.optional);
    EXPECT_TRUE(p.shape.empty());
    EXPECT_EQ(p.numel(), 1);
    EXPECT_EQ(p.loaded_numel, 1);
    EXPECT_EQ(p.dtype, DType::kFloat32);
  }
  EXPECT_THAT(params, ElementsAre("k_scale", "v_scale", "q_scale", "kv_scale"));
  std::vector<std::string> kernels;
  for (const KernelSpec& k : attn.kernels) {
    kernels.push_back(k.name);
    EXPECT_TRUE(k.shape.empty());
    EXPECT_EQ(k.nbytes(), 4);
  }
  EXPECT_THAT(kernels, ElementsAre("model.layers.0.self_attn.attn.k_scale",
                                   "model.layers.0.self_attn.attn.v_scale",
                                   "model.layers.0.self_attn.attn.q_scale"));

  NameMapper mapper(layout);
  const std::pair<const char*, const char*> names[] = {
      {"model.layers.0.self_attn.k_proj.output_scale", "k_scale"},
      {"model.layers.0.self_attn.v_proj.output_scale", "v_scale"},
      {"model.layers.0.self_attn.q_proj.output_scale", "q_scale"},
      {"model.layers.0.self_attn.kv_scale", "kv_scale"}};
  for (const auto& [name, param] : names) {
    auto t = mapper.Lookup(name);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE((*t)->optional);
    EXPECT_TRUE((*t)->shape.empty());
    EXPECT_EQ((*t)->layer, layout->FindLayer("model.layers.0.self_attn.attn"));
    EXPECT_EQ(attn.params[(*t)->param].suffix, param);
    EXPECT_EQ((*t)->slice.numel(), 1);
  }
}

TEST(ModelLayoutTest, RejectsParallelConfigsThatDoNotFit) {
  struct Bad {
    ModelConfig config;
    ParallelConfig parallel;
    const char* message;
  };
  ModelConfig odd_kv = MakeConfig(Architecture::kLlama, 6, 3, 1000);
  ModelConfig odd_ffn = MakeConfig(Architecture::kLlama, 8, 8, 1000);
  odd_ffn.intermediate_size = 90;
  ModelConfig moe = MakeConfig(Architecture::kLlama, 8, 8, 1000);
  moe.num_experts = 8;
  const Bad cases[] = {
      {MakeConfig(Architecture::kLlama, 8, 2, 1000), {4, 4}, "tp_rank 4 out of range"},
      {MakeConfig(Architecture::kLlama, 8, 2, 1000), {-1, 4}, "tp_rank -1 out of range"},
      {MakeConfig(Architecture::kLlama, 8, 2, 1000), {0, 0}, "tp_size must be >= 1"},
      {MakeConfig(Architecture::kLlama, 6, 2, 1000), {0, 4}, "num_attention_heads 6"},
      {odd_ffn, {0, 4}, "intermediate_size 90"},
      {odd_kv, {0, 2}, "num_key_value_heads 3"},
      {MakeConfig(Architecture::kLlama, 6, 4, 1000),
       {0, 1},
       "not a multiple of num_key_value_heads"},
  };
  for (const Bad& bad : cases) {
    auto layout = ModelLayout::Build(bad.config, bad.parallel, QuantScheme::kPerTensor);
    EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument) << bad.message;
    EXPECT_THAT(std::string(layout.status().message()), HasSubstr(bad.message));
  }
  auto moe_layout = ModelLayout::Build(moe, {0, 1}, QuantScheme::kPerTensor);
  EXPECT_EQ(moe_layout.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(moe_layout.status().message()), HasSubstr("mixture-of-experts"));
}

// vLLM pads the vocabulary to a multiple of 64 and then divides it by the TP
// size: rank r holds global rows [r * V_pad / t, (r + 1) * V_pad / t), the
// rows at or past V zero.
class VocabParallelTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(VocabParallelTest, RanksHoldVllmsPaddedRows) {
  const auto [vocab, tp] = GetParam();
  ModelConfig c = MakeConfig(Architecture::kLlama, 8, 8, vocab);
  const int64_t padded = (vocab + 63) / 64 * 64;
  const int64_t rows = padded / tp;
  int64_t covered = 0;
  for (int64_t rank = 0; rank < tp; ++rank) {
    std::shared_ptr<const ModelLayout> layout = BuildOrDie(c, rank, tp);
    ASSERT_NE(layout, nullptr);
    for (const char* name : {"model.embed_tokens", "lm_head"}) {
      const LayerSpec& layer = layout->layers()[layout->FindLayer(name)];
      EXPECT_EQ(layer.kernels[0].shape, (std::vector<int64_t>{rows, c.hidden_size})) << name;
      EXPECT_EQ(layer.params[0].shape, (std::vector<int64_t>{rows, c.hidden_size})) << name;
      const int target = *layout->FindCheckpointTensor(absl::StrCat(name, ".weight"));
      const SliceSpec& slice = layout->checkpoint_tensors()[target].slice;
      const int64_t begin = std::min(rank * rows, vocab);
      const int64_t end = std::min((rank + 1) * rows, vocab);
      EXPECT_EQ(slice.src_row, begin) << name << " rank " << rank;
      EXPECT_EQ(slice.num_rows, end - begin) << name << " rank " << rank;
      EXPECT_EQ(slice.dst_row, 0);
      EXPECT_EQ(layer.params[0].loaded_numel, (end - begin) * c.hidden_size);
    }
    covered += std::min((rank + 1) * rows, vocab) - std::min(rank * rows, vocab);
  }
  EXPECT_EQ(covered, vocab);
}

INSTANTIATE_TEST_SUITE_P(VocabSizes, VocabParallelTest,
                         ::testing::Combine(::testing::Values<int64_t>(1000, 1100, 32000, 151936),
                                            ::testing::Values<int64_t>(1, 2, 4, 8)));

TEST(ModelLayoutTest, VocabOf1100AtTp4Has288RowsPerRank) {
  // 1100 pads to 1152; 1152 / 4 = 288 (not round_up(ceil(1100 / 4), 64) = 320).
  ModelConfig c = MakeConfig(Architecture::kLlama, 8, 8, 1100);
  std::shared_ptr<const ModelLayout> layout = BuildOrDie(c, 3, 4);
  ASSERT_NE(layout, nullptr);
  const LayerSpec& embed = layout->layers()[layout->FindLayer("model.embed_tokens")];
  EXPECT_EQ(embed.kernels[0].shape[0], 288);
  const int target = *layout->FindCheckpointTensor("model.embed_tokens.weight");
  EXPECT_EQ(layout->checkpoint_tensors()[target].slice.src_row, 864);
  EXPECT_EQ(layout->checkpoint_tensors()[target].slice.num_rows, 1100 - 864);
}

TEST(ModelLayoutTest, RejectsTpThatDoesNotDivideThePaddedVocabulary) {
  // 6 heads and intermediate 96 divide by 3; the padded vocabulary 64 does not.
  ModelConfig c = MakeConfig(Architecture::kLlama, 6, 6, 50);
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(c, {0, 3}, QuantScheme::kPerTensor);
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(layout.status().message(),
              HasSubstr("tp_size 3 does not divide the padded vocabulary 64"));
  EXPECT_THAT(layout.status().message(), HasSubstr("vocab_size 50"));
}

TEST(ModelLayoutTest, PlansEveryKernelOnce) {
  std::shared_ptr<const ModelLayout> layout =
      BuildOrDie(MakeConfig(Architecture::kQwen2, 4, 2, 256), 0, 1);
  ASSERT_NE(layout, nullptr);
  int flat = 0;
  for (const LayerSpec& layer : layout->layers()) {
    EXPECT_EQ(layer.first_kernel, flat) << layer.name;
    flat += static_cast<int>(layer.kernels.size());
    if (layer.kind == LayerKind::kAttention) {
      EXPECT_TRUE(layer.plan.empty());
      continue;
    }
    ASSERT_EQ(layer.plan.size(), layer.kernels.size()) << layer.name;
    for (size_t k = 0; k < layer.kernels.size(); ++k) {
      const KernelPlan& plan = layer.plan[k];
      const std::string& suffix = layer.kernels[k].suffix;
      if (suffix == "weight_scale" || suffix == "weight_scale_inv") {
        EXPECT_EQ(plan.param, -1);
        continue;
      }
      ASSERT_GE(plan.param, 0) << layer.kernels[k].name;
      EXPECT_EQ(layer.params[plan.param].suffix, suffix);
      const bool quantized = layer.quantized && suffix == "weight";
      EXPECT_EQ(plan.scale >= 0, quantized) << layer.kernels[k].name;
    }
  }
  EXPECT_EQ(flat, layout->num_kernels());
}

TEST(NameMapperTest, ReportsUnknownNamesWithHints) {
  auto layout = BuildOrDie(MakeConfig(Architecture::kLlama, 4, 2, 1000), 0, 1);
  NameMapper mapper(layout);
  auto idx = mapper.LookupIndex("model.layers.1.mlp.up_proj.weight");
  ASSERT_TRUE(idx.ok()) << idx.status();
  EXPECT_EQ(layout->checkpoint_tensors()[*idx].name, "model.layers.1.mlp.up_proj.weight");
  auto up = mapper.Lookup("model.layers.1.mlp.up_proj.weight");
  ASSERT_TRUE(up.ok());
  EXPECT_EQ((*up)->slice.dst_row, 96);

  auto far = mapper.Lookup("model.layers.7.mlp.up_proj.weight");
  EXPECT_EQ(far.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(far.status().message()),
              HasSubstr("\"model.layers.7.mlp.up_proj.weight\""));
  EXPECT_THAT(std::string(far.status().message()), HasSubstr("model has 2 layers"));

  auto junk = mapper.Lookup("transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(junk.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(junk.status().message()),
              HasSubstr("transformer.h.0.attn.c_attn.weight"));

  auto expert = mapper.Lookup("model.layers.0.mlp.experts.3.down_proj.weight");
  EXPECT_EQ(expert.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(expert.status().message()), HasSubstr("mixture-of-experts"));
}

TEST(QuantSchemeTest, NamesRoundTrip) {
  for (QuantScheme s : {QuantScheme::kNone, QuantScheme::kPerTensor, QuantScheme::kPerChannel,
                        QuantScheme::kBlock128}) {
    auto parsed = ParseQuantScheme(QuantSchemeName(s));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, s);
  }
  EXPECT_EQ(QuantSchemeName(QuantScheme::kBlock128), "block");
  auto bad = ParseQuantScheme("fp4");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("'fp4'"));
}

}  // namespace
}  // namespace refit::core
