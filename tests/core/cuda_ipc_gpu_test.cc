// The trainer lane's CUDA form on a GPU (label gpu; skips without one): a
// child process (the trainer) puts the fixture's weights in one CUDA
// allocation and hands its IPC handle over a pipe; this process opens it
// (CudaIpcAllocation) and refits from device chunks. A store on the GPU
// reads the quantized weights' rows device to device (bytes read in place)
// and commits the fingerprint and bytes of the same weights from host
// memory; a host store reads everything through host memory and commits the
// same; an allocation smaller than the declared size is refused.
//
// The child is forked before this process touches CUDA (a CUDA context does
// not survive fork), so every test forks first.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/device_source.h"
#include "core/fixture_model.h"
#include "core/model_layout.h"
#include "core/refit_session.h"
#include "core/shard_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

#ifdef REFIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace refit::core {
namespace {

using ::refit::testing::PushAll;
using ::refit::testing::Snapshot;
using ::testing::HasSubstr;

// The fixture's weights laid out one after another, 256-byte aligned.
struct Packed {
  std::vector<OwnedTensor> tensors;
  std::vector<size_t> offsets;
  std::vector<uint8_t> bytes;
};

Packed Pack(uint64_t seed) {
  Packed p;
  p.tensors = MakeFixtureWeights(FixtureConfig(), seed).value();
  size_t total = 0;
  for (const OwnedTensor& t : p.tensors) {
    p.offsets.push_back(total);
    total += (t.bytes.size() + 255) / 256 * 256;
  }
  p.bytes.resize(total);
  for (size_t i = 0; i < p.tensors.size(); ++i) {
    std::memcpy(p.bytes.data() + p.offsets[i], p.tensors[i].bytes.data(),
                p.tensors[i].bytes.size());
  }
  return p;
}

bool ReadAll(int fd, void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// The trainer: a child holding `bytes` in a CUDA allocation on device 0
// until this object goes.
class Trainer {
 public:
  explicit Trainer(const std::vector<uint8_t>& bytes) {
    int to_parent[2];
    int to_child[2];
    if (::pipe(to_parent) != 0 || ::pipe(to_child) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(to_parent[0]);
      ::close(to_child[1]);
      Export(bytes, to_parent[1], to_child[0]);
      ::_exit(0);
    }
    ::close(to_parent[1]);
    ::close(to_child[0]);
    release_ = to_child[1];
    char ok = 0;
    if (!ReadAll(to_parent[0], &ok, 1) || ok != 1) {
      ::close(to_parent[0]);
      return;
    }
    handle_.resize(CudaIpcAllocation::kHandleBytes);
    uuid_.resize(CudaIpcAllocation::kUuidBytes);
    exported_ = ReadAll(to_parent[0], handle_.data(), handle_.size()) &&
                ReadAll(to_parent[0], uuid_.data(), uuid_.size());
    ::close(to_parent[0]);
  }
  ~Trainer() {
    if (release_ >= 0) ::close(release_);  // the child frees and exits
    if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
  }

  bool exported() const { return exported_; }
  const std::string& handle() const { return handle_; }
  const std::string& uuid() const { return uuid_; }

 private:
  static void Export(const std::vector<uint8_t>& bytes, int out, int wait) {
    char ok = 0;
#ifdef REFIT_WITH_CUDA
    int count = 0;
    void* p = nullptr;
    cudaIpcMemHandle_t handle;
    cudaDeviceProp prop{};
    if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0 && cudaSetDevice(0) == cudaSuccess &&
        cudaMalloc(&p, bytes.size()) == cudaSuccess &&
        cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice) == cudaSuccess &&
        cudaIpcGetMemHandle(&handle, p) == cudaSuccess &&
        cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
      ok = 1;
    }
    (void)!::write(out, &ok, 1);
    if (ok == 1) {
      (void)!::write(out, &handle, sizeof(handle));
      (void)!::write(out, prop.uuid.bytes, sizeof(prop.uuid.bytes));
      char byte;
      while (::read(wait, &byte, 1) > 0) {
      }
      cudaFree(p);
    }
#else
    (void)bytes;
    (void)wait;
    (void)!::write(out, &ok, 1);
#endif
    ::close(out);
  }

  pid_t pid_ = -1;
  int release_ = -1;
  bool exported_ = false;
  std::string handle_;
  std::string uuid_;
};

// Refits `store` from chunks of the opened allocation (one per tensor).
absl::StatusOr<RefitResult> PushFromDevice(ShardStore& store, const Packed& p,
                                           const std::shared_ptr<CudaIpcAllocation>& alloc) {
  absl::StatusOr<std::unique_ptr<RefitSession>> session = RefitSession::Begin(&store, {});
  if (!session.ok()) return session.status();
  for (size_t i = 0; i < p.tensors.size(); ++i) {
    const OwnedTensor& t = p.tensors[i];
    Chunk chunk;
    chunk.name = t.name;
    chunk.dtype = t.dtype;
    chunk.shape = t.shape;
    chunk.data = absl::MakeConstSpan(alloc->base() + p.offsets[i], t.bytes.size());
    chunk.device = alloc.get();
    chunk.keep = alloc;
    if (absl::Status s = (*session)->Ingest(chunk); !s.ok()) return s;
  }
  return (*session)->Commit();
}

TEST(CudaIpcGpuTest, ATrainersAllocationRefitsGpuAndHostStoresToTheBytesOfHostChunks) {
  const Packed p = Pack(5);
  Trainer trainer(p.bytes);  // forks before this process touches CUDA
  if (!trainer.exported()) GTEST_SKIP() << "no CUDA device";
  absl::StatusOr<std::unique_ptr<CudaIpcAllocation>> opened =
      CudaIpcAllocation::Open(trainer.handle(), trainer.uuid(), p.bytes.size());
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::shared_ptr<CudaIpcAllocation> alloc = *std::move(opened);
  EXPECT_GE(alloc->allocation_bytes(), p.bytes.size());
  std::vector<uint8_t> head(4096);
  ASSERT_TRUE(alloc->CopyToHost(alloc->base(), 4096, head.data()).ok());
  EXPECT_EQ(std::memcmp(head.data(), p.bytes.data(), 4096), 0);

  std::shared_ptr<const ModelLayout> layout =
      ModelLayout::Build(FixtureConfig(), {}, QuantScheme::kPerTensor).value();
  std::unique_ptr<ShardStore> expected = ShardStore::Create(layout, {}).value();
  ASSERT_TRUE(PushAll(*expected, p.tensors).ok());

  ShardStoreOptions gpu_options;
  gpu_options.device = "cuda:0";
  std::unique_ptr<ShardStore> gpu = ShardStore::Create(layout, gpu_options).value();
  absl::StatusOr<RefitResult> on_gpu = PushFromDevice(*gpu, p, alloc);
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status();
  EXPECT_EQ(on_gpu->fingerprint, expected->fingerprint());
  EXPECT_GT(on_gpu->bytes_read_in_place, 0);  // device to device
  EXPECT_TRUE(Snapshot(*gpu) == Snapshot(*expected));

  std::unique_ptr<ShardStore> host = ShardStore::Create(layout, {}).value();
  absl::StatusOr<RefitResult> on_host = PushFromDevice(*host, p, alloc);
  ASSERT_TRUE(on_host.ok()) << on_host.status();
  EXPECT_EQ(on_host->fingerprint, expected->fingerprint());
  EXPECT_EQ(on_host->bytes_read_in_place, 0);  // through host memory
  EXPECT_TRUE(Snapshot(*host) == Snapshot(*expected));
}

TEST(CudaIpcGpuTest, AnAllocationSmallerThanTheDeclaredSizeIsInvalidArgument) {
  const std::vector<uint8_t> bytes(1 << 20, 0x3c);
  Trainer trainer(bytes);
  if (!trainer.exported()) GTEST_SKIP() << "no CUDA device";
  // cudaMalloc rounds up, never to 1 GiB for 1 MiB.
  absl::StatusOr<std::unique_ptr<CudaIpcAllocation>> opened =
      CudaIpcAllocation::Open(trainer.handle(), trainer.uuid(), uint64_t{1} << 30);
  ASSERT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument) << opened.status();
  EXPECT_THAT(opened.status().message(), HasSubstr("smaller than the region's declared size"));
  std::string other_uuid = trainer.uuid();
  other_uuid[0] = static_cast<char>(other_uuid[0] ^ 0xff);
  opened = CudaIpcAllocation::Open(trainer.handle(), other_uuid, 4096);
  ASSERT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
}

}  // namespace
}  // namespace refit::core
