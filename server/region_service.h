// RegionService: refit.v1.RegionService — trainers on the daemon's host
// register shared-memory regions, and Push chunks reference them
// (Chunk.region) instead of carrying their bytes (the shared-memory lane).
//
// Pipeline position: beside RefitService. RegisterRegion is a stream that is
// the region's lease: it answers a RegionTicket; the trainer hands the
// region's descriptor to the descriptor socket (server/attach_fd_server.h,
// `<grpc socket>.fd`: the ticket line with the fd attached, SCM_RIGHTS),
// which calls Deposit; the region is checked and mapped
// (server/region_registry.h) and the stream sends RegionRegistered. The
// region is released when the stream ends: UnregisterRegion ends it with OK;
// a cancel, a disconnect or the trainer's death ends it too, so a trainer
// that goes away leaves nothing mapped. A Push stream reads the region's
// bytes through IngestRegionChunk.
//
// Only local callers: a call that did not come over a Unix socket is
// FAILED_PRECONDITION ("shared-memory regions need a local Unix socket").
// Authorization is the Push rule (trainer or operator tokens); a region is
// its caller's (the principal's name).
//
// Lifecycle: created by RefitServer with the registry's limits; its
// Deposit goes to the descriptor socket; Shutdown ends every lease
// (UNAVAILABLE). Must outlive the grpc::Server.
//
// Thread-safety: thread-safe.
#ifndef REFIT_SERVER_REGION_SERVICE_H_
#define REFIT_SERVER_REGION_SERVICE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/refit_session.h"
#include "refit/v1/refit.pb.h"
#include "refit/v1/region.grpc.pb.h"
#include "server/refit_service.h"
#include "server/region_registry.h"

namespace refit::server {

// Ingests one Push chunk whose bytes lie in a region of `caller`
// (chunk.region): RegionRegistry::Find's errors (NOT_FOUND unknown id,
// PERMISSION_DENIED another caller's), INVALID_ARGUMENT for a chunk that
// carries data too or is longer than `max_chunk_bytes`, Region::Read's
// (OUT_OF_RANGE, FAILED_PRECONDITION), FAILED_PRECONDITION when the daemon
// has no RegionService (`regions` null), then RefitSession::Ingest's, and
// Region::CheckIntact's after it. The region goes into `reads` (the refit's,
// checked once its last byte is read; may be null).
absl::Status IngestRegionChunk(const RegionRegistry* regions, const std::string& caller,
                               core::RefitSession* session, const v1::Chunk& chunk,
                               int64_t max_chunk_bytes, RegionReads* reads);

class RegionService final : public v1::RegionService::CallbackService {
 public:
  // `refit` (authorization) must outlive the service.
  // `pin`: RegionRegistry's.
  RegionService(RefitServiceImpl* refit, RegionRegistry::Limits limits, bool pin = false);
  ~RegionService() override;
  RegionService(const RegionService&) = delete;
  RegionService& operator=(const RegionService&) = delete;

  // The descriptor socket's path (set before serving; "" without a unix:
  // listen address, where RegisterRegion is FAILED_PRECONDITION).
  void SetFdSocket(std::string path) { fd_socket_ = std::move(path); }

  grpc::ServerWriteReactor<v1::RegionEvent>* RegisterRegion(
      grpc::CallbackServerContext* context, const v1::RegisterRegionRequest* request) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* context,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionResponse* response) override;

  // The descriptor socket received `fd` (owned from here on; or why none
  // came) with `ticket` from the peer `pid`/`uid`: activates the region of
  // that ticket. The refusal's message goes back to the peer, and the lease
  // ends with it.
  absl::Status Deposit(absl::string_view ticket, absl::StatusOr<int> fd, int pid, uint32_t uid);

  const RegionRegistry* registry() const { return &registry_; }
  void Shutdown();

  class Reactor;

 private:
  friend class Reactor;
  // False once shutting down.
  bool AddLease(const std::string& id, const std::string& ticket, Reactor* reactor);
  void RemoveLease(const std::string& id);
  void ForgetTicket(const std::string& ticket);

  RefitServiceImpl* const refit_;
  RegionRegistry registry_;
  std::string fd_socket_;

  absl::Mutex mu_;
  // Leases by region id, and their tickets while the descriptor is awaited.
  std::map<std::string, Reactor*> leases_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> tickets_ ABSL_GUARDED_BY(mu_);  // ticket -> region id
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit::server

#endif  // REFIT_SERVER_REGION_SERVICE_H_
