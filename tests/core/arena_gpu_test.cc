// The device arena of a GPU store: one allocation with a CUDA IPC handle,
// every kernel at its offset in it, commits in place with the bytes of a host
// store. Skips cleanly on machines without a CUDA device (ctest label "gpu").
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/fixture_model.h"
#include "core/runtime_info.h"
#include "core/shard_store.h"
#include "gtest/gtest.h"
#include "tests/testing/refit_helpers.h"

#ifdef REFIT_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace refit::core {
namespace {

std::shared_ptr<const ModelLayout> FixtureLayout() {
  return ModelLayout::Build(FixtureConfig(), {}, QuantScheme::kPerTensor).value();
}

ShardStoreOptions OnCuda0() {
  ShardStoreOptions options;
  options.device = "cuda:0";
  return options;
}

TEST(ArenaGpuTest, KernelsLieInOneExportedAllocationAndCommitInPlace) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::shared_ptr<const ModelLayout> layout = FixtureLayout();
  std::unique_ptr<ShardStore> store = ShardStore::Create(layout, OnCuda0()).value();
  const ArenaInfo arena = store->arena();
  EXPECT_TRUE(arena.on_device);
  EXPECT_EQ(arena.device_index, 0);
  EXPECT_EQ(arena.ipc_handle.size(), 64u);
  EXPECT_EQ(arena.host_bytes, kArenaHeaderBytes);  // the memfd holds only the header
  // The UUID other processes find the device by, whatever their ordinals.
  ASSERT_EQ(arena.device_uuid.size(), 16u);
  EXPECT_NE(arena.device_uuid, std::string(16, '\0'));
  const std::vector<KernelView> kernels = store->Kernels();
  const char* base = static_cast<const char*>(kernels[0].data) - kernels[0].arena_offset;
  for (const KernelView& k : kernels) {
    EXPECT_EQ(k.arena_offset % kArenaAlign, 0) << k.spec->name;
    EXPECT_EQ(static_cast<const char*>(k.data), base + k.arena_offset) << k.spec->name;
  }
  std::vector<OwnedTensor> w = MakeFixtureWeights(FixtureConfig(), 1).value();
  ASSERT_TRUE(testing::PushAll(*store, w).ok());
  absl::StatusOr<std::unique_ptr<ShardStore>> cpu = ShardStore::Create(layout, {});
  ASSERT_TRUE(cpu.ok());
  ASSERT_TRUE(testing::PushAll(**cpu, w).ok());
  EXPECT_EQ(store->fingerprint(), (*cpu)->fingerprint());
  EXPECT_TRUE(testing::Snapshot(*store) == testing::Snapshot(**cpu));
  EXPECT_EQ(store->Kernels()[0].data, kernels[0].data);
}

#ifdef REFIT_WITH_CUDA
// A driver entry point, through the runtime (the tests do not link libcuda).
template <typename Fn>
Fn Driver(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(p);
}
#endif

// --cuda-arena=vmm: the store's kernels lie in one virtual-memory allocation
// (no CUDA IPC handle) that exports descriptors; importing one and mapping it
// with read-only access, as an engine does, reads the committed bytes.
TEST(ArenaGpuTest, AVmmArenaExportsDescriptorsThatMapItsBytesReadOnly) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
#ifdef REFIT_WITH_CUDA
  DeviceArena::SetDefaultSharing(DeviceArenaSharing::kVmmFd);
  std::shared_ptr<const ModelLayout> layout = FixtureLayout();
  absl::StatusOr<std::unique_ptr<ShardStore>> created = ShardStore::Create(layout, OnCuda0());
  DeviceArena::SetDefaultSharing(DeviceArenaSharing::kCudaIpc);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<ShardStore> store = *std::move(created);
  const ArenaInfo arena = store->arena();
  EXPECT_TRUE(arena.on_device);
  EXPECT_TRUE(arena.device_vmm);
  EXPECT_TRUE(arena.ipc_handle.empty());
  EXPECT_GE(arena.device_mapped_bytes, arena.data_bytes);
  std::vector<OwnedTensor> w = MakeFixtureWeights(FixtureConfig(), 1).value();
  ASSERT_TRUE(testing::PushAll(*store, w).ok());
  absl::StatusOr<std::unique_ptr<ShardStore>> cpu = ShardStore::Create(layout, {});
  ASSERT_TRUE(cpu.ok());
  ASSERT_TRUE(testing::PushAll(**cpu, w).ok());
  EXPECT_EQ(store->fingerprint(), (*cpu)->fingerprint());

  absl::StatusOr<int> fd = store->ExportDeviceArenaFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  absl::StatusOr<int> again = store->ExportDeviceArenaFd();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(*fd, *again);
  ::close(*again);
  auto import =
      Driver<CUresult (*)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType)>(
          "cuMemImportFromShareableHandle");
  auto reserve =
      Driver<CUresult (*)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long)>(
          "cuMemAddressReserve");
  auto map = Driver<CUresult (*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                                 unsigned long long)>("cuMemMap");
  auto set_access =
      Driver<CUresult (*)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t)>("cuMemSetAccess");
  auto unmap = Driver<CUresult (*)(CUdeviceptr, size_t)>("cuMemUnmap");
  auto address_free = Driver<CUresult (*)(CUdeviceptr, size_t)>("cuMemAddressFree");
  auto release = Driver<CUresult (*)(CUmemGenericAllocationHandle)>("cuMemRelease");
  ASSERT_TRUE(import && reserve && map && set_access && unmap && address_free && release);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const size_t size = static_cast<size_t>(arena.device_mapped_bytes);
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_EQ(import(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(*fd)),
                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            CUDA_SUCCESS);
  ::close(*fd);
  CUdeviceptr ptr = 0;
  ASSERT_EQ(reserve(&ptr, size, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(map(ptr, size, 0, handle, 0), CUDA_SUCCESS);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
  ASSERT_EQ(set_access(ptr, size, &access, 1), CUDA_SUCCESS);
  const std::vector<KernelView> kernels = store->Kernels();
  for (const KernelView& k : kernels) {
    std::vector<uint8_t> bytes(static_cast<size_t>(k.nbytes));
    ASSERT_EQ(cudaMemcpy(bytes.data(), reinterpret_cast<const void*>(ptr + k.arena_offset),
                         bytes.size(), cudaMemcpyDeviceToHost),
              cudaSuccess)
        << k.spec->name;
    std::vector<uint8_t> live(bytes.size());
    ASSERT_EQ(cudaMemcpy(live.data(), k.data, live.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(bytes, live) << k.spec->name;
  }
  EXPECT_EQ(unmap(ptr, size), CUDA_SUCCESS);
  EXPECT_EQ(address_free(ptr, size), CUDA_SUCCESS);
  EXPECT_EQ(release(handle), CUDA_SUCCESS);
#endif
}

// A store in a CUDA IPC arena has no descriptor to export.
TEST(ArenaGpuTest, AnIpcArenaExportsNoDescriptor) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::shared_ptr<const ModelLayout> layout = FixtureLayout();
  std::unique_ptr<ShardStore> store = ShardStore::Create(layout, OnCuda0()).value();
  EXPECT_FALSE(store->arena().device_vmm);
  EXPECT_EQ(store->ExportDeviceArenaFd().status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace refit::core
