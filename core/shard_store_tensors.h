// core-internal: the LibTorch side of ShardStore. The live at::Tensor objects,
// the reader/writer lock that gives readers one version at a time, and the
// in-place commit. Included by core .cc files, tests and benchmarks only.
//
// Thread-safety: `mu` is held shared by readers and exclusively by
// CommitStaged for exactly the copy into the live tensors.
#ifndef REFIT_CORE_SHARD_STORE_TENSORS_H_
#define REFIT_CORE_SHARD_STORE_TENSORS_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/arena.h"
#include "core/model_layout.h"
#include "core/shard_store.h"

namespace refit::core {

#ifdef REFIT_WITH_CUDA
namespace cuda {
class DeviceEvent;  // core/cuda/device_commit.h
}  // namespace cuda
#endif

class ShardStoreImpl {
 public:
  ShardStoreImpl(std::shared_ptr<const ModelLayout> layout, c10::Device device);
  ~ShardStoreImpl();

  // Allocates zeroed kernels and hashes them. RESOURCE_EXHAUSTED if they do not fit.
  // Host kernels live in one shareable arena (a sealed memfd: zero pages,
  // populated at once unless prefault_host is off), GPU kernels in one
  // exportable device allocation; never LibTorch's allocator.
  absl::Status Allocate();

  // Copies `staged` into the live tensors in place under the writer lock.
  // Every entry must match its kernel's byte size (checked before the lock;
  // INTERNAL otherwise, nothing copied). On a GPU store, entries staged on
  // the device (on_device) are copied device-to-device on the store's commit
  // stream; an event recorded after the last copy marks the new version
  // complete, and the writer lock is released only once it has completed, so
  // readers under the reader lock never see a mix.
  // `set_version` > 0: publish exactly that version (recovery) instead of
  // the next one. `refit_id` (empty for a restore) goes into the arena's
  // header with the version.
  absl::StatusOr<CommitStats> CommitStaged(const std::vector<StagedKernel>& staged,
                                           uint64_t set_version = 0,
                                           absl::string_view refit_id = {});
  // CommitStaged in three steps, for a commit that spans several stores
  // (RefitSlot::CommitLinked): CheckStaged before any lock; with `mu` held,
  // PrepareCommitLocked (what can still fail: the GPU commit stream), then
  // CopyStagedLocked, which cannot fail (a failed copy aborts the process,
  // since a mixed version must never be served).
  absl::Status CheckStaged(const std::vector<StagedKernel>& staged) const;
  absl::Status PrepareCommitLocked(const std::vector<StagedKernel>& staged)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  CommitStats CopyStagedLocked(const std::vector<StagedKernel>& staged, uint64_t set_version,
                               absl::string_view refit_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // RefitSlot::RestoreInPlace's body: `fill` under the writer lock, then
  // publishes `set_version`, or zeroes the kernels again if `fill` fails.
  absl::StatusOr<CommitStats> RestoreInPlace(uint64_t set_version, RefitSlot::RestoreFill fill);
  // Zeroes every kernel (host memset, or a device memset and a sync).
  absl::Status ZeroKernelsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The version the next commit publishes.
  uint64_t NextVersionLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu);

  const ModelLayout& layout;
  const c10::Device device;
  bool prefault_host = true;             // ShardStoreOptions::prefault_host, read by Allocate
  std::vector<const KernelSpec*> specs;  // flattened, layout order
  std::vector<int> kernel_layer;
  absl::flat_hash_map<std::string, int> kernel_index;

  // The arena every kernel lives in (core/arena.h): the memfd with the
  // header (and, on the host, the kernels); on a GPU the device allocation.
  // Each kernel tensor keeps them alive. Set by Allocate, then fixed.
  std::shared_ptr<HostArena> host_arena;
  std::shared_ptr<DeviceArena> device_arena;
  std::vector<int64_t> arena_offsets;  // per kernel, from the data start
  int64_t arena_data_bytes = 0;
  uint64_t layout_hash = 0;

  mutable absl::Mutex mu;
  // The tensors themselves never change identity; their bytes change under mu.
  std::vector<at::Tensor> kernels;
  uint64_t version ABSL_GUARDED_BY(mu) = 0;
  uint64_t next_version_floor ABSL_GUARDED_BY(mu) = 0;
  std::vector<uint64_t> hashes ABSL_GUARDED_BY(mu);
  std::string fingerprint ABSL_GUARDED_BY(mu);
  absl::Time last_commit ABSL_GUARDED_BY(mu) = absl::InfinitePast();

#ifdef REFIT_WITH_CUDA
  // GPU stores: the commit stream (a cudaStream_t) and the event recorded
  // after a commit's last copy. Created by the first device commit.
  void* commit_stream ABSL_GUARDED_BY(mu) = nullptr;
  std::unique_ptr<cuda::DeviceEvent> commit_event ABSL_GUARDED_BY(mu);
  absl::Status CreateCommitResourcesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
#endif

  // XXH3-64 over layout descriptors and per-kernel hashes, 16 hex digits.
  std::string ComputeFingerprint(const std::vector<uint64_t>& kernel_hashes) const;
};

}  // namespace refit::core

#endif  // REFIT_CORE_SHARD_STORE_TENSORS_H_
