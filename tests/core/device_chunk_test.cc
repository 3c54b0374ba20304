// Chunks whose bytes lie in device memory (Chunk::device: a colocated
// trainer's CUDA allocation, opened from its IPC handle), on a machine
// without a GPU: a fake DeviceSource hands out addresses with the top bit
// flipped, which no host access can dereference (it would fault), and reads
// them back only through CopyToHost. Checked: the rows of quantized weights
// are aliased as device rows when the processor reads staging on the device
// (Options::device_aliases) and copied to the host through the source
// otherwise; every layer's kernels are those of the same chunks ingested
// from host memory; kept tensors always come through the source; a
// checksum on a device chunk and a failing read are specific errors; the
// source's owner is held exactly as long as staging refers to it. And
// CudaIpcAllocation's refusals on this GPU-less machine.
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/device_source.h"
#include "core/dtype.h"
#include "core/fixture_model.h"
#include "core/layer_assembler.h"
#include "core/layer_processor.h"
#include "core/model_config.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"
#include "core/staging_buffer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

namespace refit::core {
namespace {

using ::testing::HasSubstr;

constexpr uintptr_t kDeviceBit = uintptr_t{1} << 63;

// Device addresses over host memory: the host address with its top bit
// flipped (non-canonical on x86-64, kernel space elsewhere: a host read of
// one faults). CopyToHost translates, checks the range and counts.
class FakeDevice final : public DeviceSource {
 public:
  FakeDevice(const uint8_t* base, size_t size) : base_(base), size_(size) {}

  static const uint8_t* On(const uint8_t* host) {
    return reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(host) ^ kDeviceBit);
  }

  absl::Status CopyToHost(const uint8_t* src, int64_t n, uint8_t* dst) const override {
    const uint8_t* host =
        reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) ^ kDeviceBit);
    if (host < base_ || host + n > base_ + size_) {
      return absl::InternalError("read outside the fake allocation");
    }
    if (fail_) return absl::InternalError("CUDA error 700: an illegal memory access");
    std::memcpy(dst, host, static_cast<size_t>(n));
    copied_ += n;
    return absl::OkStatus();
  }

  int64_t copied() const { return copied_; }
  void set_fail(bool fail) { fail_ = fail; }

 private:
  const uint8_t* base_;
  size_t size_;
  mutable int64_t copied_ = 0;
  bool fail_ = false;
};

std::shared_ptr<const ModelLayout> Layout(QuantScheme scheme, ParallelConfig parallel = {},
                                          Architecture arch = Architecture::kLlama) {
  absl::StatusOr<std::shared_ptr<const ModelLayout>> layout =
      ModelLayout::Build(FixtureConfig(arch), parallel, scheme);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return layout.ok() ? *std::move(layout) : nullptr;
}

// The fixture's weights, one after another in one allocation (as a
// trainer's caching allocator would hold them), 256-byte aligned.
struct Allocation {
  std::vector<OwnedTensor> tensors;
  std::vector<uint8_t> bytes;
  std::vector<size_t> offsets;
};

Allocation Weights(uint64_t seed, Architecture arch = Architecture::kLlama) {
  Allocation a;
  absl::StatusOr<std::vector<OwnedTensor>> w = MakeFixtureWeights(FixtureConfig(arch), seed);
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return a;
  a.tensors = *std::move(w);
  size_t total = 0;
  for (const OwnedTensor& t : a.tensors) {
    a.offsets.push_back(total);
    total += (t.bytes.size() + 255) / 256 * 256;
  }
  a.bytes.resize(total + 256);
  // 256-aligned base inside the vector.
  const size_t shift = (256 - reinterpret_cast<uintptr_t>(a.bytes.data()) % 256) % 256;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    a.offsets[i] += shift;
    std::memcpy(a.bytes.data() + a.offsets[i], a.tensors[i].bytes.data(),
                a.tensors[i].bytes.size());
  }
  return a;
}

struct Ingested {
  std::vector<std::vector<std::string>> kernels;
  int64_t in_place = 0;
  absl::Status status;
};

// Ingests every tensor in chunks of random element-aligned sizes, from host
// memory (`device` null) or as device chunks of `device`, processing each
// layer on the host as it completes.
Ingested IngestAll(const ModelLayout& layout, const Allocation& a, uint64_t seed,
                   const FakeDevice* device, bool device_aliases,
                   std::shared_ptr<const void> keep) {
  Ingested run;
  run.kernels.resize(layout.layers().size());
  LayerAssembler::Options options;
  options.device_aliases = device_aliases;
  LayerAssembler assembler(layout, options, nullptr);
  std::unique_ptr<LayerProcessor> processor = CreateHostLayerProcessor(layout, {});
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const OwnedTensor& t = a.tensors[i];
    const uint8_t* host = a.bytes.data() + a.offsets[i];
    const uint64_t elem = DTypeSize(t.dtype);
    for (uint64_t at = 0; at < t.bytes.size();) {
      const uint64_t n = std::min<uint64_t>(t.bytes.size() - at, (1 + rng() % 20000) * elem);
      Chunk chunk;
      chunk.name = t.name;
      chunk.dtype = t.dtype;
      chunk.shape = t.shape;
      chunk.offset = at;
      chunk.data = absl::MakeConstSpan((device != nullptr ? FakeDevice::On(host) : host) + at, n);
      if (device != nullptr) {
        chunk.device = device;
        chunk.keep = keep;
      }
      absl::StatusOr<WorkUnit> done = assembler.IngestUnit(chunk);
      if (!done.ok()) {
        run.status = done.status();
        return run;
      }
      at += n;
      if (done->layer < 0) continue;
      absl::StatusOr<ProcessedLayer> processed =
          done->part >= 0 ? processor->ProcessPart(done->layer, done->part,
                                                   assembler.TakePart(done->layer, done->part))
                          : processor->Process(done->layer, assembler.TakeParams(done->layer));
      if (!processed.ok()) {
        run.status = processed.status();
        return run;
      }
      for (const StagingBuffer& k : processed->kernels) {
        run.kernels[done->layer].emplace_back(reinterpret_cast<const char*>(k.data()),
                                              static_cast<size_t>(k.size()));
      }
    }
  }
  run.in_place = assembler.bytes_in_place();
  return run;
}

int64_t TotalBytes(const Allocation& a) {
  int64_t n = 0;
  for (const OwnedTensor& t : a.tensors) n += static_cast<int64_t>(t.bytes.size());
  return n;
}

class DeviceChunkArchTest : public ::testing::TestWithParam<Architecture> {};

TEST_P(DeviceChunkArchTest, DeviceChunksGiveTheKernelsOfHostChunksAliasedOrCopied) {
  const Allocation a = Weights(5, GetParam());
  ASSERT_FALSE(a.tensors.empty());
  for (QuantScheme scheme : {QuantScheme::kPerTensor, QuantScheme::kBlock128}) {
    for (bool tp : {false, true}) {
      SCOPED_TRACE(absl::StrCat(QuantSchemeName(scheme), tp ? " tp 2 rank 0" : " tp 1"));
      const std::shared_ptr<const ModelLayout> layout = Layout(
          scheme, tp ? ParallelConfig{/*tp_rank=*/0, /*tp_size=*/2} : ParallelConfig{}, GetParam());
      ASSERT_NE(layout, nullptr);
      const Ingested host = IngestAll(*layout, a, 9, nullptr, false, nullptr);
      ASSERT_TRUE(host.status.ok()) << host.status;

      // A processor on the device: quantized weights' rows are aliased as
      // device rows (the host processor here brings them over through the
      // source before it quantizes, as a GPU one would copy them on the
      // device); the rest is copied to the host at ingest.
      FakeDevice aliased(a.bytes.data(), a.bytes.size());
      auto keep = std::make_shared<int>(0);
      const Ingested on_device = IngestAll(*layout, a, 9, &aliased, true, keep);
      ASSERT_TRUE(on_device.status.ok()) << on_device.status;
      EXPECT_GT(on_device.in_place, 0);
      // What this rank needs crossed once: at ingest, or (the aliased
      // rows) when its layer was processed.
      EXPECT_GT(aliased.copied(), on_device.in_place);
      EXPECT_LE(aliased.copied(), TotalBytes(a));

      // A host processor: everything is copied at ingest, nothing aliased.
      FakeDevice copied(a.bytes.data(), a.bytes.size());
      const Ingested to_host = IngestAll(*layout, a, 9, &copied, false, keep);
      ASSERT_TRUE(to_host.status.ok()) << to_host.status;
      EXPECT_EQ(to_host.in_place, 0);
      EXPECT_LE(copied.copied(), TotalBytes(a));
      if (!tp) {
        EXPECT_EQ(copied.copied(), aliased.copied());
      }

      for (size_t l = 0; l < host.kernels.size(); ++l) {
        EXPECT_EQ(on_device.kernels[l], host.kernels[l]) << layout->layers()[l].name;
        EXPECT_EQ(to_host.kernels[l], host.kernels[l]) << layout->layers()[l].name;
      }
      // Everything processed and the assemblers gone: nothing holds the
      // trainer's allocation.
      EXPECT_EQ(keep.use_count(), 1);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, DeviceChunkArchTest,
                         ::testing::Values(Architecture::kLlama, Architecture::kQwen3Moe),
                         [](const ::testing::TestParamInfo<Architecture>& info) {
                           return info.param == Architecture::kLlama ? std::string("Llama")
                                                                     : std::string("Qwen3Moe");
                         });

const OwnedTensor& Find(const Allocation& a, absl::string_view name, size_t* index) {
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (a.tensors[i].name == name) {
      *index = i;
      return a.tensors[i];
    }
  }
  ADD_FAILURE() << name;
  *index = 0;
  return a.tensors.front();
}

Chunk DeviceChunk(const Allocation& a, size_t i, const FakeDevice* device) {
  const OwnedTensor& t = a.tensors[i];
  Chunk chunk;
  chunk.name = t.name;
  chunk.dtype = t.dtype;
  chunk.shape = t.shape;
  chunk.data = absl::MakeConstSpan(FakeDevice::On(a.bytes.data() + a.offsets[i]), t.bytes.size());
  chunk.device = device;
  chunk.keep = std::make_shared<int>(0);  // the region, in the daemon
  return chunk;
}

TEST(DeviceChunkTest, AQuantizedWeightIsADeviceAliasAndAKeptTensorIsCopiedToTheHost) {
  const std::shared_ptr<const ModelLayout> layout = Layout(QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const Allocation a = Weights(6);
  FakeDevice device(a.bytes.data(), a.bytes.size());
  LayerAssembler::Options options;
  options.device_aliases = true;
  LayerAssembler assembler(*layout, options, nullptr);
  size_t o = 0;
  const OwnedTensor& o_proj = Find(a, "model.layers.1.self_attn.o_proj.weight", &o);
  absl::StatusOr<int> done = assembler.Ingest(DeviceChunk(a, o, &device));
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(device.copied(), 0);  // aliased, not read
  EXPECT_EQ(assembler.bytes_in_place(), static_cast<int64_t>(o_proj.bytes.size()));
  ASSERT_GE(*done, 0);
  std::vector<StagingBuffer> params = assembler.TakeParams(*done);
  ASSERT_EQ(params.size(), 1u);
  ASSERT_TRUE(params[0].has_device_aliases());
  const std::vector<StagingBuffer::Segment> segments = params[0].Segments();
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0].device, &device);
  EXPECT_EQ(segments[0].data, FakeDevice::On(a.bytes.data() + a.offsets[o]));
  // Read through the source: the weight's bytes.
  std::vector<uint8_t> out(o_proj.bytes.size());
  ASSERT_TRUE(params[0].CopyOut(0, out.data(), static_cast<int64_t>(out.size())).ok());
  EXPECT_EQ(out, o_proj.bytes);
  ASSERT_TRUE(params[0].MaterializeAliases().ok());
  EXPECT_FALSE(params[0].has_aliases());
  EXPECT_EQ(std::memcmp(params[0].data(), o_proj.bytes.data(), o_proj.bytes.size()), 0);

  size_t n = 0;
  const OwnedTensor& norm = Find(a, "model.layers.0.input_layernorm.weight", &n);
  const int64_t before = device.copied();
  ASSERT_TRUE(assembler.Ingest(DeviceChunk(a, n, &device)).ok());
  EXPECT_EQ(device.copied() - before, static_cast<int64_t>(norm.bytes.size()));
  EXPECT_EQ(assembler.bytes_in_place(), static_cast<int64_t>(o_proj.bytes.size()));
}

TEST(DeviceChunkTest, AChecksumOnADeviceChunkAndAFailingReadAreSpecificErrors) {
  const std::shared_ptr<const ModelLayout> layout = Layout(QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const Allocation a = Weights(7);
  FakeDevice device(a.bytes.data(), a.bytes.size());
  size_t n = 0;
  Find(a, "model.layers.0.input_layernorm.weight", &n);
  {
    LayerAssembler assembler(*layout, {}, nullptr);
    Chunk chunk = DeviceChunk(a, n, &device);
    chunk.xxh3 = 1234;
    absl::StatusOr<int> done = assembler.Ingest(chunk);
    ASSERT_EQ(done.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(done.status().message(), HasSubstr("model.layers.0.input_layernorm.weight"));
    EXPECT_THAT(done.status().message(), HasSubstr("without xxh3"));
  }
  {
    LayerAssembler assembler(*layout, {}, nullptr);
    device.set_fail(true);
    absl::StatusOr<int> done = assembler.Ingest(DeviceChunk(a, n, &device));
    ASSERT_EQ(done.status().code(), absl::StatusCode::kInternal);
    EXPECT_THAT(done.status().message(), HasSubstr("model.layers.0.input_layernorm.weight"));
    EXPECT_THAT(done.status().message(), HasSubstr("illegal memory access"));
  }
  // A failing read of an aliased row: CopyOut and MaterializeAliases say so
  // and keep the alias.
  {
    device.set_fail(false);
    LayerAssembler::Options options;
    options.device_aliases = true;
    LayerAssembler assembler(*layout, options, nullptr);
    size_t o = 0;
    Find(a, "model.layers.1.self_attn.o_proj.weight", &o);
    absl::StatusOr<int> done = assembler.Ingest(DeviceChunk(a, o, &device));
    ASSERT_TRUE(done.ok()) << done.status();
    std::vector<StagingBuffer> params = assembler.TakeParams(*done);
    device.set_fail(true);
    uint8_t byte = 0;
    EXPECT_EQ(params[0].CopyOut(0, &byte, 1).code(), absl::StatusCode::kInternal);
    EXPECT_EQ(params[0].MaterializeAliases().code(), absl::StatusCode::kInternal);
    EXPECT_TRUE(params[0].has_device_aliases());
  }
}

// A whole refit of a host store from device chunks: the session reads them
// through host memory (its processor is not on a device, so nothing is
// aliased) and commits the fingerprint and bytes of host chunks; a read that
// fails midway aborts the refit and the live version stays.
TEST(DeviceChunkTest, AHostStoreRefitsFromDeviceChunksAndAFailedReadChangesNothing) {
  const std::shared_ptr<const ModelLayout> layout = Layout(QuantScheme::kPerTensor);
  ASSERT_NE(layout, nullptr);
  const Allocation a = Weights(8);
  std::unique_ptr<ShardStore> expected = ShardStore::Create(layout, {}).value();
  ASSERT_TRUE(::refit::testing::PushAll(*expected, a.tensors).ok());
  std::unique_ptr<ShardStore> store = ShardStore::Create(layout, {}).value();
  FakeDevice device(a.bytes.data(), a.bytes.size());
  auto refit = [&]() -> absl::StatusOr<RefitResult> {
    std::unique_ptr<RefitSession> session = RefitSession::Begin(store.get(), {}).value();
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      if (absl::Status s = session->Ingest(DeviceChunk(a, i, &device)); !s.ok()) return s;
    }
    return session->Commit();
  };
  absl::StatusOr<RefitResult> result = refit();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->fingerprint, expected->fingerprint());
  EXPECT_EQ(result->bytes_read_in_place, 0);
  EXPECT_TRUE(::refit::testing::Snapshot(*store) == ::refit::testing::Snapshot(*expected));
  EXPECT_EQ(device.copied(), TotalBytes(a));

  const uint64_t version = store->version();
  const std::string fingerprint = store->fingerprint();
  device.set_fail(true);
  absl::StatusOr<RefitResult> failed = refit();
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_EQ(store->version(), version);
  EXPECT_EQ(store->fingerprint(), fingerprint);
  EXPECT_EQ(store->active_session(), "");
}

TEST(DeviceChunkTest, HostAndDeviceAliasesWithTheSameOwnerAreNotMerged) {
  std::vector<uint8_t> host(64, 7);
  FakeDevice device(host.data(), host.size());
  absl::StatusOr<StagingBuffer> buffer = StagingBuffer::HostZeroed(64, "test");
  ASSERT_TRUE(buffer.ok());
  auto keep = std::make_shared<int>(0);
  // Contiguous in the buffer, and the second continues the first's
  // (translated) source, but one is host memory and one device memory.
  buffer->AddAlias(0, host.data(), 16, keep);
  buffer->AddAlias(16, host.data() + 16, 16, keep, &device);
  const std::vector<StagingBuffer::Segment> segments = buffer->Segments();
  ASSERT_EQ(segments.size(), 3u);
  EXPECT_EQ(segments[0].device, nullptr);
  EXPECT_EQ(segments[1].device, &device);
  EXPECT_EQ(segments[2].offset, 32);
  EXPECT_EQ(segments[2].size, 32);
}

TEST(CudaIpcAllocationTest, MalformedHandlesAndAMissingGpuAreRefusedClearly) {
  const std::string handle(CudaIpcAllocation::kHandleBytes, '\x01');
  const std::string uuid(CudaIpcAllocation::kUuidBytes, '\x02');
  absl::StatusOr<std::unique_ptr<CudaIpcAllocation>> short_handle =
      CudaIpcAllocation::Open(handle.substr(1), uuid, 4096);
  ASSERT_EQ(short_handle.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_handle.status().message(), HasSubstr("64 bytes"));
  absl::StatusOr<std::unique_ptr<CudaIpcAllocation>> short_uuid =
      CudaIpcAllocation::Open(handle, uuid.substr(2), 4096);
  ASSERT_EQ(short_uuid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_uuid.status().message(), HasSubstr("16 bytes"));
  // Well-formed, but no visible GPU has that UUID (or there is no GPU, or
  // no CUDA in this build).
  absl::StatusOr<std::unique_ptr<CudaIpcAllocation>> opened =
      CudaIpcAllocation::Open(handle, uuid, 4096);
  ASSERT_FALSE(opened.ok());
  EXPECT_TRUE(opened.status().code() == absl::StatusCode::kFailedPrecondition ||
              opened.status().code() == absl::StatusCode::kUnimplemented)
      << opened.status();
}

}  // namespace
}  // namespace refit::core
