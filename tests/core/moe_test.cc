// Mixture-of-experts models end to end in core: config parsing, the kernel
// layout and TP/EP slicing of Qwen3-MoE and Mixtral, per-expert FP8 against
// LibTorch's math, bounded staging, partial refits that keep experts.
#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/fixture_model.h"
#include "core/model_config.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::refit::testing::MakeStore;
using ::refit::testing::PendingChunk;
using ::refit::testing::PushAll;
using ::refit::testing::Snapshot;
using ::refit::testing::ToChunk;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// The fixture MoE config with sizes that make experts the largest units.
ModelConfig BigExperts(Architecture arch) {
  ModelConfig c = FixtureConfig(arch);
  c.vocab_size = 64;
  c.moe_intermediate_size = 384;
  if (arch == Architecture::kMixtral) c.intermediate_size = 384;
  return c;
}

std::vector<OwnedTensor> Weights(const ModelConfig& config, uint64_t seed) {
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(config, seed);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : std::vector<OwnedTensor>{};
}

// The expert a checkpoint name belongs to ("...experts.5.w1.weight" -> 5), or -1.
int64_t ExpertOf(const std::string& name) {
  const size_t at = name.find(".experts.");
  if (at == std::string::npos) return -1;
  return std::stoll(name.substr(at + 9));
}

// The layer index of "model.layers.L....", or -1.
int64_t LayerOf(const std::string& name) {
  if (name.rfind("model.layers.", 0) != 0) return -1;
  return std::stoll(name.substr(13));
}

// Chunks as a trainer that sends each expert's tensors together, experts of
// a layer in random order, every tensor in chunks of random size, shuffled
// within the expert: other tensors in checkpoint order.
std::vector<PendingChunk> ExpertOrderChunks(const std::vector<OwnedTensor>& tensors,
                                            uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<const OwnedTensor*>> groups;
  std::map<std::pair<int64_t, int64_t>, size_t> group_of;
  for (const OwnedTensor& t : tensors) {
    const int64_t expert = ExpertOf(t.name);
    if (expert < 0) {
      groups.push_back({&t});
      continue;
    }
    auto key = std::make_pair(LayerOf(t.name), expert);
    auto it = group_of.find(key);
    if (it == group_of.end()) {
      it = group_of.emplace(key, groups.size()).first;
      groups.emplace_back();
    }
    groups[it->second].push_back(&t);
  }
  // Shuffle the experts of each layer among their own slots.
  std::map<int64_t, std::vector<size_t>> slots;
  for (const auto& [key, index] : group_of) slots[key.first].push_back(index);
  std::vector<std::vector<const OwnedTensor*>> ordered = groups;
  for (auto& [layer, indices] : slots) {
    std::vector<size_t> shuffled = indices;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    for (size_t i = 0; i < indices.size(); ++i) ordered[indices[i]] = groups[shuffled[i]];
  }
  std::vector<PendingChunk> chunks;
  for (const auto& group : ordered) {
    std::vector<PendingChunk> mine;
    for (const OwnedTensor* t : group) {
      const uint64_t elem = DTypeSize(t->dtype);
      for (uint64_t off = 0; off < t->bytes.size();) {
        uint64_t n = std::uniform_int_distribution<int64_t>(1, 9000)(rng) * elem;
        n = std::min<uint64_t>(n, t->bytes.size() - off);
        mine.push_back({t, off, n});
        off += n;
      }
    }
    std::shuffle(mine.begin(), mine.end(), rng);
    chunks.insert(chunks.end(), mine.begin(), mine.end());
  }
  return chunks;
}

absl::StatusOr<RefitResult> PushChunks(ShardStore& store, const std::vector<PendingChunk>& chunks,
                                       RefitOptions options = {}) {
  absl::StatusOr<std::unique_ptr<RefitSession>> session =
      RefitSession::Begin(&store, std::move(options));
  if (!session.ok()) return session.status();
  for (const PendingChunk& c : chunks) {
    if (absl::Status s = (*session)->Ingest(ToChunk(c)); !s.ok()) return s;
  }
  return (*session)->Commit();
}

const LayerSpec* FindLayer(const ModelLayout& layout, absl::string_view name) {
  const int l = layout.FindLayer(name);
  return l < 0 ? nullptr : &layout.layers()[l];
}

std::vector<int64_t> KernelShape(const LayerSpec& spec, absl::string_view suffix) {
  const int k = spec.KernelIndex(suffix);
  return k < 0 ? std::vector<int64_t>{} : spec.kernels[k].shape;
}

// --- config.json ---

TEST(MoeConfigTest, ParsesQwen3Moe) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["Qwen3MoeForCausalLM"],
      "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
      "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
      "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": true})",
                                 "qwen3moe.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kQwen3Moe);
  EXPECT_EQ(c->num_experts, 16);
  EXPECT_EQ(c->num_experts_per_tok, 4);
  EXPECT_EQ(c->moe_intermediate_size, 32);
  EXPECT_TRUE(c->norm_topk_prob);
  // step 2: layers 1 and 3 sparse, but 3 is mlp-only.
  EXPECT_FALSE(c->IsSparseLayer(0));
  EXPECT_TRUE(c->IsSparseLayer(1));
  EXPECT_FALSE(c->IsSparseLayer(2));
  EXPECT_FALSE(c->IsSparseLayer(3));
  auto back = ModelConfig::FromJson(c->ToJson(), "back.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->decoder_sparse_step, 2);
  EXPECT_THAT(back->mlp_only_layers, ElementsAre(3));
  EXPECT_TRUE(back->norm_topk_prob);
}

TEST(MoeConfigTest, ParsesMixtralWithIntermediateAsExpertSize) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["MixtralForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "num_local_experts": 8,
      "num_experts_per_tok": 2})",
                                 "mixtral/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Architecture::kMixtral);
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->moe_intermediate_size, 128);
  EXPECT_TRUE(c->IsSparseLayer(0));
  EXPECT_TRUE(c->IsSparseLayer(1));
}

TEST(MoeConfigTest, RefusesBadExpertFields) {
  auto no_topk = ModelConfig::FromJson(R"({"architectures": ["MixtralForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "num_local_experts": 8})",
                                       "m.json");
  EXPECT_EQ(no_topk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(no_topk.status()), HasSubstr("num_experts_per_tok"));
  auto topk = ModelConfig::FromJson(R"({"architectures": ["MixtralForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "num_local_experts": 8,
      "num_experts_per_tok": 9})",
                                    "m.json");
  EXPECT_EQ(topk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(topk.status()), HasSubstr("9 exceeds num_local_experts 8"));
  auto only = ModelConfig::FromJson(R"({"architectures": ["Qwen3MoeForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "num_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "mlp_only_layers": [2]})",
                                    "q.json");
  EXPECT_EQ(only.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(only.status()), HasSubstr("mlp_only_layers"));
  auto dense = ModelConfig::FromJson(R"({"architectures": ["Qwen3ForCausalLM"],
      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "vocab_size": 100, "num_experts": 128})",
                                     "moe.json");
  EXPECT_EQ(dense.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(Message(dense.status()), HasSubstr("128 experts"));
}

// --- layout and slicing ---

struct ArchCase {
  Architecture arch;
  const char* mlp;  // the sparse MLP's module name in a layer
  const char* names[3];
};
const ArchCase kArchCases[] = {
    {Architecture::kQwen3Moe, "mlp", {"gate_proj", "up_proj", "down_proj"}},
    {Architecture::kMixtral, "block_sparse_moe", {"w1", "w3", "w2"}},
};

TEST(MoeLayoutTest, KernelShapesAsVllmFusedMoeAtEveryTpAndEp) {
  for (const ArchCase& arch : kArchCases) {
    const ModelConfig c = FixtureConfig(arch.arch);
    const int64_t h = c.hidden_size, e = c.num_experts, full_i = c.moe_intermediate_size;
    for (int64_t tp : {1, 2, 4}) {
      for (int64_t ep : {1, 2, 4}) {
        SCOPED_TRACE(absl::StrCat(c.arch_name, " tp ", tp, " ep ", ep));
        const int64_t i_r = ep > 1 ? full_i : full_i / tp;
        const int64_t e_l = e / ep;
        for (QuantScheme quant : {QuantScheme::kPerTensor, QuantScheme::kBlock128,
                                  QuantScheme::kPerChannel, QuantScheme::kNone}) {
          auto layout = ModelLayout::Build(c, {tp - 1, tp, ep - 1, ep}, quant);
          ASSERT_TRUE(layout.ok()) << layout.status();
          const std::string mlp = absl::StrCat("model.layers.1.", arch.mlp, ".");
          const LayerSpec* experts = FindLayer(**layout, mlp + "experts");
          const LayerSpec* router = FindLayer(**layout, mlp + "gate");
          ASSERT_NE(experts, nullptr);
          ASSERT_NE(router, nullptr);
          EXPECT_EQ(experts->kind, LayerKind::kExperts);
          EXPECT_EQ(router->kind, LayerKind::kRouter);
          EXPECT_THAT(router->kernels[0].shape, ElementsAre(e, h));
          EXPECT_EQ(router->kernels[0].dtype, c.dtype);
          EXPECT_THAT(KernelShape(*experts, "w13_weight"), ElementsAre(e_l, 2 * i_r, h));
          EXPECT_THAT(KernelShape(*experts, "w2_weight"), ElementsAre(e_l, h, i_r));
          ASSERT_EQ(experts->parts.size(), static_cast<size_t>(2 * e_l));
          EXPECT_EQ(experts->parts[0].expert, (ep - 1) * e_l);
          EXPECT_EQ(experts->parts[0].name, absl::StrCat(mlp, "experts.", (ep - 1) * e_l, ".w13"));
          switch (quant) {
            case QuantScheme::kPerTensor:
              EXPECT_THAT(KernelShape(*experts, "w13_weight_scale"), ElementsAre(e_l));
              EXPECT_THAT(KernelShape(*experts, "w2_weight_scale"), ElementsAre(e_l));
              break;
            case QuantScheme::kBlock128:
              EXPECT_THAT(KernelShape(*experts, "w13_weight_scale_inv"),
                          ElementsAre(e_l, (2 * i_r + 127) / 128, (h + 127) / 128));
              EXPECT_THAT(KernelShape(*experts, "w2_weight_scale_inv"),
                          ElementsAre(e_l, (h + 127) / 128, (i_r + 127) / 128));
              break;
            case QuantScheme::kPerChannel:
              EXPECT_THAT(KernelShape(*experts, "w13_weight_scale"), ElementsAre(e_l, 2 * i_r, 1));
              break;
            case QuantScheme::kNone:
              EXPECT_EQ(experts->kernels.size(), 2u);
              EXPECT_EQ(experts->kernels[0].dtype, c.dtype);
              break;
          }
          // Every expert of the model is a checkpoint name on every rank.
          for (int64_t g = 0; g < e; ++g) {
            for (const char* n : arch.names) {
              EXPECT_TRUE(
                  (*layout)
                      ->FindCheckpointTensor(absl::StrCat(mlp, "experts.", g, ".", n, ".weight"))
                      .ok());
            }
          }
        }
      }
    }
  }
}

TEST(MoeLayoutTest, RefusesCombinationsThatDoNotFitNamingTheNumbers) {
  const ModelConfig c = FixtureConfig(Architecture::kQwen3Moe);  // 8 experts of 96
  auto ep = ModelLayout::Build(c, {0, 1, 0, 3}, QuantScheme::kPerTensor);
  EXPECT_EQ(ep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(ep.status()), HasSubstr("num_experts 8 is not divisible by ep_size 3"));
  ModelConfig odd = c;
  odd.moe_intermediate_size = 90;
  auto tp = ModelLayout::Build(odd, {0, 4, 0, 1}, QuantScheme::kPerTensor);
  EXPECT_EQ(tp.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(tp.status()),
              HasSubstr("tp_size 4 does not divide the expert intermediate size 90"));
  auto rank = ModelLayout::Build(c, {0, 1, 2, 2}, QuantScheme::kPerTensor);
  EXPECT_EQ(rank.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(rank.status()), HasSubstr("ep_rank 2 out of range for ep_size 2"));
  auto dense = ModelLayout::Build(FixtureConfig(), {0, 1, 0, 2}, QuantScheme::kPerTensor);
  EXPECT_EQ(dense.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(dense.status()), HasSubstr("ep_size 2 needs a mixture-of-experts model"));
}

TEST(MoeLayoutTest, DenseLayersOfQwen3MoeKeepTheDenseMlp) {
  ModelConfig c = FixtureConfig(Architecture::kQwen3Moe);
  c.num_layers = 3;
  c.mlp_only_layers = {0};
  auto layout = ModelLayout::Build(c, {0, 1}, QuantScheme::kPerTensor);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_NE(FindLayer(**layout, "model.layers.0.mlp.gate_up_proj"), nullptr);
  EXPECT_EQ(FindLayer(**layout, "model.layers.0.mlp.experts"), nullptr);
  EXPECT_NE(FindLayer(**layout, "model.layers.1.mlp.experts"), nullptr);
  EXPECT_NE(FindLayer(**layout, "model.layers.1.self_attn.q_norm"), nullptr);
  auto wrong = (*layout)->FindCheckpointTensor("model.layers.1.mlp.experts.8.up_proj.weight");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(wrong.status()), HasSubstr("8 experts"));
}

// Scatters every expert tensor through each rank's slices into that rank's
// param buffers, then reads them back from the buffers into full tensors:
// all ranks together give back the checkpoint, element for element.
TEST(MoeLayoutTest, ReassemblingAllRanksGivesTheCheckpoint) {
  for (const ArchCase& arch : kArchCases) {
    const ModelConfig c = FixtureConfig(arch.arch);
    auto full = ModelLayout::Build(c, {0, 1}, QuantScheme::kNone);
    ASSERT_TRUE(full.ok());
    for (int64_t tp : {1, 2, 4}) {
      for (int64_t ep : {1, 2, 4}) {
        SCOPED_TRACE(absl::StrCat(c.arch_name, " tp ", tp, " ep ", ep));
        // name -> reassembled values (-1: not covered), and the cover count.
        std::map<std::string, std::vector<double>> back;
        std::map<std::string, std::vector<int>> covered;
        for (int64_t t = 0; t < tp; ++t) {
          for (int64_t r = 0; r < ep; ++r) {
            auto layout = ModelLayout::Build(c, {t, tp, r, ep}, QuantScheme::kPerTensor);
            ASSERT_TRUE(layout.ok()) << layout.status();
            std::map<std::pair<int, int>, std::vector<double>> params;
            for (const CheckpointTensor& ct : (*layout)->checkpoint_tensors()) {
              if (ct.layer < 0 || (*layout)->layers()[ct.layer].kind != LayerKind::kExperts) {
                continue;
              }
              const ParamSpec& p = (*layout)->layers()[ct.layer].params[ct.param];
              auto& buf = params[{ct.layer, ct.param}];
              buf.resize(static_cast<size_t>(p.numel()), -1.0);
              const int64_t cols = ct.shape[1];
              const SliceSpec& s = ct.slice;
              const int64_t name_id = std::hash<std::string>()(ct.name) % 1000;
              for (int64_t i = 0; i < s.num_rows; ++i) {
                for (int64_t j = 0; j < s.num_cols; ++j) {
                  const int64_t src = (s.src_row + i) * cols + s.src_col + j;
                  const int64_t dst = (s.dst_row + i) * s.num_cols + j;
                  ASSERT_LT(dst, p.numel());
                  ASSERT_EQ(buf[dst], -1.0) << ct.name << " overlaps in the param";
                  buf[dst] = name_id * 1e7 + src;
                }
              }
            }
            // Read back from the buffers through the same slices.
            for (const CheckpointTensor& ct : (*layout)->checkpoint_tensors()) {
              if (ct.layer < 0 || (*layout)->layers()[ct.layer].kind != LayerKind::kExperts) {
                continue;
              }
              auto& out = back[ct.name];
              auto& count = covered[ct.name];
              out.resize(static_cast<size_t>(ct.numel()), -1.0);
              count.resize(static_cast<size_t>(ct.numel()), 0);
              const auto& buf = params[{ct.layer, ct.param}];
              const int64_t cols = ct.shape[1];
              const SliceSpec& s = ct.slice;
              for (int64_t i = 0; i < s.num_rows; ++i) {
                for (int64_t j = 0; j < s.num_cols; ++j) {
                  const int64_t src = (s.src_row + i) * cols + s.src_col + j;
                  out[src] = buf[(s.dst_row + i) * s.num_cols + j];
                  ++count[src];
                }
              }
            }
          }
        }
        // With ep > 1 each tp rank holds whole experts (replicated over tp).
        const int copies = ep > 1 ? static_cast<int>(tp) : 1;
        size_t tensors = 0;
        for (const CheckpointTensor& ct : (*full)->checkpoint_tensors()) {
          if (ExpertOf(ct.name) < 0) continue;
          ++tensors;
          const int64_t name_id = std::hash<std::string>()(ct.name) % 1000;
          const auto& out = back[ct.name];
          ASSERT_EQ(out.size(), static_cast<size_t>(ct.numel())) << ct.name;
          for (int64_t k = 0; k < ct.numel(); ++k) {
            ASSERT_EQ(covered[ct.name][k], copies) << ct.name << " element " << k;
            ASSERT_EQ(out[k], name_id * 1e7 + k) << ct.name << " element " << k;
          }
        }
        EXPECT_EQ(tensors, static_cast<size_t>(3 * c.num_experts * c.num_layers));
      }
    }
  }
}

// --- refits ---

struct RefitCase {
  Architecture arch;
  QuantScheme quant;
  ParallelConfig parallel;
};

TEST(MoeRefitTest, RefitInExpertOrderEqualsAFreshLoad) {
  const RefitCase cases[] = {
      {Architecture::kQwen3Moe, QuantScheme::kPerTensor, {0, 1, 0, 1}},
      {Architecture::kQwen3Moe, QuantScheme::kBlock128, {1, 2, 0, 1}},
      {Architecture::kMixtral, QuantScheme::kPerTensor, {0, 1, 1, 2}},
      {Architecture::kMixtral, QuantScheme::kPerChannel, {3, 4, 0, 1}},
      {Architecture::kMixtral, QuantScheme::kNone, {0, 2, 3, 4}},
  };
  for (const RefitCase& rc : cases) {
    const ModelConfig c = FixtureConfig(rc.arch);
    SCOPED_TRACE(absl::StrCat(c.arch_name, " ", QuantSchemeName(rc.quant), " tp ",
                              rc.parallel.tp_rank, "/", rc.parallel.tp_size, " ep ",
                              rc.parallel.ep_rank, "/", rc.parallel.ep_size));
    std::unique_ptr<ShardStore> refitted = MakeStore(c, rc.parallel, rc.quant);
    std::unique_ptr<ShardStore> fresh = MakeStore(c, rc.parallel, rc.quant);
    ASSERT_NE(refitted, nullptr);
    ASSERT_NE(fresh, nullptr);
    const std::vector<OwnedTensor> v1 = Weights(c, 1);
    const std::vector<OwnedTensor> v2 = Weights(c, 2);
    ASSERT_TRUE(PushAll(*refitted, v1).ok());
    for (bool overlap : {true, false}) {
      RefitOptions options;
      options.overlap_processing = overlap;
      absl::StatusOr<RefitResult> r = PushChunks(*refitted, ExpertOrderChunks(v2, 7), options);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->kept_layers.empty());
    }
    // v2's scales held over the last two refits: per-tensor weights and
    // experts are now read once (the bytes are compared below).
    absl::StatusOr<RefitResult> hinted = PushChunks(*refitted, ExpertOrderChunks(v2, 5));
    ASSERT_TRUE(hinted.ok()) << hinted.status();
    if (rc.quant == QuantScheme::kPerTensor) {
      int64_t scales = 0;  // dense weights' and experts' per-tensor scales
      for (const KernelView& k : refitted->Kernels()) {
        scales += absl::EndsWith(k.spec->name, ".weight_scale");
      }
      for (const LayerSpec& layer : refitted->layout().layers()) {
        for (const LayerPart& part : layer.parts) scales += part.scale >= 0;
      }
      EXPECT_EQ(hinted->scales_reused, scales);
    } else {
      EXPECT_EQ(hinted->scales_reused, 0);
    }
    absl::StatusOr<RefitResult> f = PushAll(*fresh, v2);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(Snapshot(*refitted), Snapshot(*fresh));
    EXPECT_EQ(refitted->fingerprint(), fresh->fingerprint());
  }
}

// vLLM's online Fp8MoEMethod: one scaled_fp8_quant per expert over its fused
// [gate; up] rows (this rank's slice), and one over its down_proj slice.
TEST(MoeRefitTest, PerExpertFp8EqualsLibTorchMathPerExpert) {
  const ModelConfig c = FixtureConfig(Architecture::kQwen3Moe);
  const ParallelConfig parallel{1, 2, 0, 1};
  std::unique_ptr<ShardStore> store = MakeStore(c, parallel, QuantScheme::kPerTensor);
  ASSERT_NE(store, nullptr);
  const std::vector<OwnedTensor> w = Weights(c, 5);
  ASSERT_TRUE(PushChunks(*store, ExpertOrderChunks(w, 3)).ok());
  std::map<std::string, const OwnedTensor*> by_name;
  for (const OwnedTensor& t : w) by_name[t.name] = &t;
  auto tensor = [&](const std::string& name) {
    const OwnedTensor& t = *by_name.at(name);
    return at::from_blob(const_cast<uint8_t*>(t.bytes.data()), {t.shape[0], t.shape[1]},
                         at::kBFloat16)
        .to(at::kFloat);
  };
  auto quant = [](const at::Tensor& x, std::string* q, float* scale) {
    at::Tensor s = x.abs().amax() / 448.0;
    at::Tensor inv = at::where(s == 0, at::zeros_like(s), s.reciprocal());
    at::Tensor fp8 = (x * inv).clamp(-448, 448).to(at::kFloat8_e4m3fn).view(at::kByte).contiguous();
    q->assign(reinterpret_cast<const char*>(fp8.data_ptr<uint8_t>()), fp8.numel());
    *scale = s.item<float>();
  };
  const int64_t i = c.moe_intermediate_size, i_r = i / 2;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const std::string ex = absl::StrCat("model.layers.", layer, ".mlp.experts.");
    std::string w13, w2, s13, s2;
    uint64_t version = 0;
    ASSERT_TRUE(store->ReadKernel(ex + "w13_weight", &w13, &version).ok());
    ASSERT_TRUE(store->ReadKernel(ex + "w2_weight", &w2, &version).ok());
    ASSERT_TRUE(store->ReadKernel(ex + "w13_weight_scale", &s13, &version).ok());
    ASSERT_TRUE(store->ReadKernel(ex + "w2_weight_scale", &s2, &version).ok());
    const int64_t n13 = 2 * i_r * c.hidden_size, n2 = c.hidden_size * i_r;
    for (int64_t e = 0; e < c.num_experts; ++e) {
      SCOPED_TRACE(absl::StrCat("layer ", layer, " expert ", e));
      const std::string p = absl::StrCat(ex, e, ".");
      at::Tensor gate = tensor(p + "gate_proj.weight").slice(0, i_r, 2 * i_r);
      at::Tensor up = tensor(p + "up_proj.weight").slice(0, i_r, 2 * i_r);
      at::Tensor down = tensor(p + "down_proj.weight").slice(1, i_r, 2 * i_r).contiguous();
      std::string q;
      float scale = 0;
      quant(at::cat({gate, up}, 0).contiguous(), &q, &scale);
      EXPECT_EQ(w13.substr(e * n13, n13), q);
      EXPECT_EQ(reinterpret_cast<const float*>(s13.data())[e], scale);
      quant(down, &q, &scale);
      EXPECT_EQ(w2.substr(e * n2, n2), q);
      EXPECT_EQ(reinterpret_cast<const float*>(s2.data())[e], scale);
    }
  }
}

// Peak high-precision staging (the session's own accounting) stays within
// the layout's documented bound (a part on the worker, an expert being
// assembled), whatever order the experts come in, far below a whole layer.
TEST(MoeRefitTest, PeakStagingIsBoundedByExpertsNotLayers) {
  for (Architecture arch : {Architecture::kQwen3Moe, Architecture::kMixtral}) {
    const ModelConfig c = BigExperts(arch);
    auto layout = ModelLayout::Build(c, {0, 1}, QuantScheme::kPerTensor);
    ASSERT_TRUE(layout.ok());
    int64_t moe_layer = 0;
    for (const LayerSpec& l : (*layout)->layers()) {
      if (l.kind == LayerKind::kExperts) moe_layer = std::max(moe_layer, l.param_bytes());
    }
    const int64_t bound = (*layout)->staging_bound_bytes();
    EXPECT_LT(bound, moe_layer / 4);
    std::unique_ptr<ShardStore> store = MakeStore(c);
    ASSERT_NE(store, nullptr);
    const std::vector<OwnedTensor> w = Weights(c, 2);
    for (uint64_t seed : {1, 2, 3}) {
      absl::StatusOr<RefitResult> r = PushChunks(*store, ExpertOrderChunks(w, seed));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_LE(r->peak_staging_bytes, bound);
    }
    // A budget of the bound is enough.
    RefitOptions tight;
    tight.staging_budget_bytes = bound;
    absl::StatusOr<RefitResult> r = PushChunks(*store, ExpertOrderChunks(w, 9), tight);
    ASSERT_TRUE(r.ok()) << r.status();
  }
}

TEST(MoeRefitTest, PartialRefitKeepsUntouchedExpertsAndListsThem) {
  const ModelConfig c = FixtureConfig(Architecture::kMixtral);
  for (const ParallelConfig parallel : {ParallelConfig{0, 1, 0, 1}, ParallelConfig{0, 1, 1, 2}}) {
    std::unique_ptr<ShardStore> store = MakeStore(c, parallel);
    std::unique_ptr<ShardStore> v2_store = MakeStore(c, parallel);
    ASSERT_NE(store, nullptr);
    const std::vector<OwnedTensor> v1 = Weights(c, 1);
    const std::vector<OwnedTensor> v2 = Weights(c, 2);
    ASSERT_TRUE(PushAll(*store, v1).ok());
    ASSERT_TRUE(PushAll(*v2_store, v2).ok());
    const std::map<std::string, std::string> before = Snapshot(*store);
    // Experts 5 and 6 of layer 0 only (on rank 1 of ep 2: local 1 and 2).
    std::vector<OwnedTensor> some;
    for (const OwnedTensor& t : v2) {
      if (LayerOf(t.name) == 0 && (ExpertOf(t.name) == 5 || ExpertOf(t.name) == 6)) {
        some.push_back(t);
      }
    }
    ASSERT_EQ(some.size(), 6u);
    absl::StatusOr<RefitResult> r = PushAll(*store, some);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::string ex = "model.layers.0.block_sparse_moe.experts";
    const int64_t e_l = c.num_experts / parallel.ep_size, e0 = parallel.ep_rank * e_l;
    for (int64_t e = e0; e < e0 + e_l; ++e) {
      const bool sent = e == 5 || e == 6;
      for (const char* w : {".w13", ".w2"}) {
        const std::string part = absl::StrCat(ex, ".", e, w);
        EXPECT_EQ(std::count(r->kept_layers.begin(), r->kept_layers.end(), part), sent ? 0 : 1)
            << part;
      }
    }
    EXPECT_EQ(std::count(r->kept_layers.begin(), r->kept_layers.end(),
                         "model.layers.1.block_sparse_moe.experts"),
              1);
    // Sent experts have the new bytes, the others the old ones, scales too.
    const std::map<std::string, std::string> after = Snapshot(*store);
    const std::map<std::string, std::string> want = Snapshot(*v2_store);
    const int64_t h = c.hidden_size, i = c.moe_intermediate_size;
    const std::pair<const char*, int64_t> kernels[] = {{".w13_weight", 2 * i * h},
                                                       {".w2_weight", h * i},
                                                       {".w13_weight_scale", 4},
                                                       {".w2_weight_scale", 4}};
    for (const auto& [suffix, per_expert] : kernels) {
      const std::string name = ex + suffix;
      for (int64_t j = 0; j < e_l; ++j) {
        const bool sent = e0 + j == 5 || e0 + j == 6;
        const std::string& source = sent ? want.at(name) : before.at(name);
        EXPECT_EQ(after.at(name).substr(j * per_expert, per_expert),
                  source.substr(j * per_expert, per_expert))
            << name << " expert " << e0 + j;
      }
    }
    EXPECT_EQ(after.at("model.layers.1.block_sparse_moe.experts.w13_weight"),
              before.at("model.layers.1.block_sparse_moe.experts.w13_weight"));
  }
}

TEST(MoeRefitTest, ANonFiniteExpertWeightIsNamedByItsCheckpointTensor) {
  // An expert's w13 is its gate rows, then its up rows: the error names the
  // up_proj the trainer sent and the element's row and column there.
  const ModelConfig c = FixtureConfig(Architecture::kQwen3Moe);
  std::unique_ptr<ShardStore> store = MakeStore(c);
  ASSERT_NE(store, nullptr);
  std::vector<OwnedTensor> w = Weights(c, 1);
  const std::string name = "model.layers.1.mlp.experts.2.up_proj.weight";
  bool found = false;
  for (OwnedTensor& t : w) {
    if (t.name != name) continue;
    const int64_t at = 2 * (3 * t.shape[1] + 5);  // bf16 [3][5]
    t.bytes[at] = 0xC0;
    t.bytes[at + 1] = 0x7F;
    found = true;
  }
  ASSERT_TRUE(found);
  absl::StatusOr<RefitResult> r = PushAll(*store, w);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(r.status()),
              HasSubstr(absl::StrCat("checkpoint tensor '", name, "' row 3, col 5: tensor '")));
  EXPECT_THAT(Message(r.status()),
              HasSubstr(absl::StrCat("(row ", c.moe_intermediate_size + 3, ", col 5) is nan")));
}

TEST(MoeRefitTest, ExpertMissingATensorFailsNamingIt) {
  const ModelConfig c = FixtureConfig(Architecture::kQwen3Moe);
  std::unique_ptr<ShardStore> store = MakeStore(c);
  ASSERT_NE(store, nullptr);
  const std::vector<OwnedTensor> v1 = Weights(c, 1);
  ASSERT_TRUE(PushAll(*store, v1).ok());
  const std::map<std::string, std::string> before = Snapshot(*store);
  std::vector<OwnedTensor> gate_only;
  for (const OwnedTensor& t : v1) {
    if (t.name == "model.layers.1.mlp.experts.2.gate_proj.weight") gate_only.push_back(t);
  }
  absl::StatusOr<RefitResult> r = PushAll(*store, gate_only);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(r.status()), HasSubstr("model.layers.1.mlp.experts.2.up_proj.weight"));
  EXPECT_EQ(Snapshot(*store), before);
  // Zero-filled on request, and listed as partial.
  RefitOptions partial;
  partial.allow_partial_layers = true;
  absl::StatusOr<RefitResult> z = PushAll(*store, gate_only, partial);
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_THAT(z->partial_layers, ElementsAre("model.layers.1.mlp.experts.2.w13"));
  // require_complete names the experts that got nothing.
  RefitOptions complete;
  complete.require_complete = true;
  std::vector<OwnedTensor> one_expert;
  for (const OwnedTensor& t : v1) {
    if (ExpertOf(t.name) != 3 || LayerOf(t.name) != 0) one_expert.push_back(t);
  }
  absl::StatusOr<RefitResult> rc = PushAll(*store, one_expert, complete);
  EXPECT_EQ(rc.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(rc.status()), HasSubstr("model.layers.0.mlp.experts.3.gate_proj.weight"));
}

}  // namespace
}  // namespace refit::core
