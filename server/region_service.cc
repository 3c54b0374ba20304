#include "server/region_service.h"

#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"
#include "core/text.h"
#include "server/attach_service.h"
#include "server/grpc_convert.h"
#include "server/reactor_util.h"

namespace refit::server {
namespace {

std::string RandomRegionTicket() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  std::string out(AttachFdServer::kRegionTicketPrefix);
  for (unsigned char b : bytes) absl::StrAppendFormat(&out, "%02x", b);
  return out;
}

const char* AccessName(Region::Access access) {
  switch (access) {
    case Region::Access::kMapped:
      return "mapped";
    case Region::Access::kPread:
      return "pread";
    case Region::Access::kCudaIpc:
      return "cuda_ipc";
  }
  return "?";
}

v1::RegionRegistered::Access ToProtoAccess(Region::Access access) {
  switch (access) {
    case Region::Access::kMapped:
      return v1::RegionRegistered::ACCESS_MAPPED;
    case Region::Access::kPread:
      return v1::RegionRegistered::ACCESS_PREAD;
    case Region::Access::kCudaIpc:
      return v1::RegionRegistered::ACCESS_CUDA_IPC;
  }
  return v1::RegionRegistered::ACCESS_UNSPECIFIED;
}

}  // namespace

absl::Status IngestRegionChunk(const RegionRegistry* regions, const std::string& caller,
                               core::RefitSession* session, const v1::Chunk& chunk,
                               int64_t max_chunk_bytes, RegionReads* reads) {
  const std::string prefix = absl::StrCat("refit \"", session->refit_id(), "\": tensor ",
                                          core::QuoteText(chunk.tensor_name()), ": ");
  if (regions == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(prefix, "shared-memory regions need a local Unix socket"));
  }
  if (!chunk.data().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "a chunk carries either data or a region, not both"));
  }
  const v1::RegionRef& ref = chunk.region();
  if (ref.length() > static_cast<uint64_t>(max_chunk_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "region chunk of ", ref.length(),
                                                   " bytes exceeds --max-chunk-bytes ",
                                                   max_chunk_bytes));
  }
  absl::StatusOr<std::shared_ptr<const Region>> region = regions->Find(caller, ref.region_id());
  if (!region.ok()) {
    return absl::Status(region.status().code(), absl::StrCat(prefix, region.status().message()));
  }
  // One buffer per ingest thread (a Push stream's), reused chunk after
  // chunk; only pread regions use it.
  thread_local std::vector<uint8_t> scratch;
  absl::StatusOr<absl::Span<const uint8_t>> bytes =
      (*region)->Read(chunk.tensor_name(), ref.offset(), ref.length(), &scratch);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(), absl::StrCat("refit \"", session->refit_id(),
                                                            "\": ", bytes.status().message()));
  }
  absl::StatusOr<core::DType> dtype = FromProtoDType(chunk.dtype(), chunk.tensor_name());
  if (!dtype.ok()) return dtype.status();
  core::Chunk c;
  c.name = chunk.tensor_name();
  c.dtype = *dtype;
  c.shape = absl::MakeConstSpan(chunk.shape().data(), chunk.shape().size());
  c.offset = chunk.byte_offset();
  c.data = *bytes;
  if (chunk.has_xxh3()) c.xxh3 = chunk.xxh3();
  // A mapped region (or an opened CUDA allocation) stays so while the
  // session holds it: the rows of quantized weights are read in place when
  // their layer is processed.
  if ((*region)->access() != Region::Access::kPread) c.keep = *region;
  c.device = (*region)->device();
  // Rows read in place later are checked with the refit's other reads.
  if (reads != nullptr) reads->Add(*region, chunk.tensor_name());
  absl::Status ingested = session->Ingest(c);
  // What Ingest copied out of a guarded mapping: zeros if its file shrank
  // (the cause of whatever else Ingest may have found wrong with them).
  if (absl::Status intact = (*region)->CheckIntact(chunk.tensor_name()); !intact.ok()) {
    return absl::Status(intact.code(),
                        absl::StrCat("refit \"", session->refit_id(), "\": ", intact.message()));
  }
  return ingested;
}

// One RegisterRegion stream: the region's lease. Watched (IdleWatchdog)
// from its ticket until its descriptor arrives: a registration whose
// descriptor does not come within --push-idle-timeout ends, and its
// reservation (counted against the caller's limits) with it.
class RegionService::Reactor final : public grpc::ServerWriteReactor<v1::RegionEvent>,
                                     public IdleWatchdog::Target {
 public:
  Reactor(RegionService* service, grpc::CallbackServerContext* context,
          const v1::RegisterRegionRequest& request)
      : service_(service) {
    if (!IsUnixPeer(context->peer())) {
      End(ToGrpcStatus(absl::FailedPreconditionError(
          absl::StrCat("shared-memory regions need a local Unix socket; this call came over ",
                       context->peer(), ": connect to the daemon's unix: listen address"))));
      return;
    }
    absl::StatusOr<Principal> caller =
        service_->refit_->Authorize(context, Action::kPush, "RegisterRegion");
    if (!caller.ok()) {
      End(ToGrpcStatus(caller.status()));
      return;
    }
    if (service_->fd_socket_.empty()) {
      End(ToGrpcStatus(absl::FailedPreconditionError(
          "shared-memory regions need a local Unix socket: the daemon listens on none (add a "
          "unix: address to --listen)")));
      return;
    }
    absl::StatusOr<std::string> id = service_->registry_.Reserve(caller->name, request.size());
    if (!id.ok()) {
      REFIT_LOG(WARNING).Field("caller", caller->name)
          << "RegisterRegion refused: " << std::string(id.status().message());
      End(ToGrpcStatus(id.status()));
      return;
    }
    const std::string ticket = RandomRegionTicket();
    {
      absl::MutexLock lock(&mu_);
      region_id_ = *id;
      owner_ = caller->name;
      name_ = request.name();
      size_ = request.size();
    }
    if (!service_->AddLease(*id, ticket, this)) {
      End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"));
      return;
    }
    if (!request.cuda_ipc_handle().empty() || !request.cuda_device_uuid().empty()) {
      // A CUDA allocation: the handle came in the request, no descriptor.
      service_->ForgetTicket(ticket);
      absl::StatusOr<std::shared_ptr<const Region>> region = service_->registry_.ActivateCudaIpc(
          *id, request.cuda_ipc_handle(), request.cuda_device_uuid());
      if (!region.ok()) {
        REFIT_LOG(WARNING).Field("region", *id).Field("caller", caller->name)
            << "region refused: " << std::string(region.status().message());
        End(ToGrpcStatus(region.status()));
        return;
      }
      Registered(**region, -1, 0);
      return;
    }
    v1::RegionEvent event;
    v1::RegionTicket* t = event.mutable_ticket();
    t->set_region_id(*id);
    t->set_ticket(ticket);
    t->set_fd_socket(service_->fd_socket_);
    deposit_deadline_ns_.store(absl::ToUnixNanos(service_->refit_->clock()->Now() +
                                                 service_->refit_->options().push_idle_timeout));
    Ref();  // the watchdog's, until End
    watched_.store(true);
    service_->refit_->watchdog()->Add(this);
    Send(std::move(event));
  }

  // IdleWatchdog::Target
  absl::Time IdleDeadline() const override {
    return absl::FromUnixNanos(deposit_deadline_ns_.load(std::memory_order_relaxed));
  }
  void OnIdle() override {
    deposit_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    const std::string why =
        absl::StrCat("no descriptor arrived at the descriptor socket within ",
                     absl::FormatDuration(service_->refit_->options().push_idle_timeout),
                     " of the ticket (--push-idle-timeout)");
    {
      absl::MutexLock lock(&mu_);
      if (active_) return;
    }
    REFIT_LOG(WARNING).Field("region", RegionId()) << "RegisterRegion ended: " << why;
    End(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, why), why);
  }

  // The descriptor was checked and mapped.
  void Registered(const Region& region, int pid, uint32_t uid) {
    deposit_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    const Region::Access access = region.access();
    std::string id;
    std::string owner;
    std::string name;
    uint64_t size = 0;
    {
      absl::MutexLock lock(&mu_);
      active_ = true;
      id = region_id_;
      owner = owner_;
      name = name_;
      size = size_;
    }
    core::LogRecord log(core::LogSeverity::kInfo);
    log.Field("region", id)
        .Field("caller", owner)
        .Field("name", name)
        .Field("bytes", absl::StrCat(size))
        .Field("access", AccessName(access));
    // Page-locked for a GPU store's DMA (in a daemon with one).
    if (region.pinned()) log.Field("pinned", "true");
    if (!region.pin_declined().empty()) {
      log.Field("pinned", "false").Field("why", region.pin_declined());
    }
    // A descriptor's sender (the descriptor socket's peer credentials).
    if (pid >= 0) log.Field("pid", absl::StrCat(pid)).Field("uid", absl::StrCat(uid));
    log << "region registered";
    v1::RegionEvent event;
    v1::RegionRegistered* r = event.mutable_registered();
    r->set_region_id(id);
    r->set_size(size);
    r->set_access(ToProtoAccess(access));
    Send(std::move(event));
  }

  // Ends the lease with `status` (first call wins) and releases the region.
  void End(grpc::Status status, absl::string_view why = "") {
    std::string id;
    bool active = false;
    {
      absl::MutexLock lock(&mu_);
      if (!out_.Close(std::move(status), /*drop_queue=*/true)) return;
      id = region_id_;
      active = active_;
    }
    if (!id.empty()) {
      service_->RemoveLease(id);
      service_->registry_.Release(id);
      if (active) {
        REFIT_LOG(INFO).Field("region", id).Field("why", why.empty() ? "lease ended" : why)
            << "region released";
      }
    }
    deposit_deadline_ns_.store(absl::ToUnixNanos(absl::InfiniteFuture()));
    if (watched_.exchange(false)) {
      service_->refit_->watchdog()->Remove(this);
      Unref();
    }
    MaybeFinish();
  }

  void OnWriteDone(bool ok) override {
    v1::RegionEvent* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      next = out_.WriteDone(ok);
    }
    if (next != nullptr) {
      StartWrite(next);
    } else {
      if (!ok) End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "region stream broke"));
      MaybeFinish();
    }
  }

  void OnCancel() override {
    End(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"),
        "the client cancelled the lease or went away");
  }

  void OnDone() override {
    End(grpc::Status::OK);
    Unref();
  }

  void Ref() override { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() override {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  ~Reactor() override = default;

  void Send(v1::RegionEvent event) {
    v1::RegionEvent* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      start = out_.Push(std::move(event));
    }
    if (start != nullptr) StartWrite(start);
  }

  void MaybeFinish() {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      finish = out_.TakeFinish();
    }
    if (finish.has_value()) Finish(*finish);
  }

  std::string RegionId() {
    absl::MutexLock lock(&mu_);
    return region_id_;
  }

  RegionService* const service_;
  std::atomic<int> refs_{1};  // gRPC's, until OnDone
  std::atomic<int64_t> deposit_deadline_ns_{absl::ToUnixNanos(absl::InfiniteFuture())};
  std::atomic<bool> watched_{false};
  absl::Mutex mu_;
  std::string region_id_ ABSL_GUARDED_BY(mu_);
  std::string owner_ ABSL_GUARDED_BY(mu_);
  std::string name_ ABSL_GUARDED_BY(mu_);
  uint64_t size_ ABSL_GUARDED_BY(mu_) = 0;
  bool active_ ABSL_GUARDED_BY(mu_) = false;
  WriteQueue<v1::RegionEvent> out_ ABSL_GUARDED_BY(mu_);
};

RegionService::RegionService(RefitServiceImpl* refit, RegionRegistry::Limits limits, bool pin)
    : refit_(refit), registry_(limits, pin) {}

RegionService::~RegionService() { Shutdown(); }

grpc::ServerWriteReactor<v1::RegionEvent>* RegionService::RegisterRegion(
    grpc::CallbackServerContext* context, const v1::RegisterRegionRequest* request) {
  return new Reactor(this, context, *request);
}

grpc::ServerUnaryReactor* RegionService::UnregisterRegion(
    grpc::CallbackServerContext* context, const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse* /*response*/) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<Principal> caller = refit_->Authorize(context, Action::kPush, "UnregisterRegion");
  if (!caller.ok()) {
    reactor->Finish(ToGrpcStatus(caller.status()));
    return reactor;
  }
  if (absl::Status s = registry_.CheckOwner(caller->name, request->region_id()); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  Reactor* lease = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = leases_.find(request->region_id());
    if (it != leases_.end()) {
      lease = it->second;
      lease->Ref();
    }
  }
  if (lease != nullptr) {
    lease->End(grpc::Status::OK, "UnregisterRegion");
    lease->Unref();
  } else {
    registry_.Release(request->region_id());
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

absl::Status RegionService::Deposit(absl::string_view ticket, absl::StatusOr<int> fd, int pid,
                                    uint32_t uid) {
  Reactor* lease = nullptr;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    auto t = tickets_.find(std::string(ticket));
    if (t != tickets_.end()) {
      id = t->second;
      tickets_.erase(t);
      auto it = leases_.find(id);
      if (it != leases_.end()) {
        lease = it->second;
        lease->Ref();
      }
    }
  }
  if (lease == nullptr) {
    if (fd.ok()) ::close(*fd);
    return absl::PermissionDeniedError(
        "unknown region ticket (used already, or its RegisterRegion stream ended)");
  }
  absl::StatusOr<std::shared_ptr<const Region>> region =
      fd.ok()
          ? registry_.Activate(id, *fd)
          : absl::StatusOr<std::shared_ptr<const Region>>(absl::Status(
                fd.status().code(), absl::StrCat("region \"", id, "\": ", fd.status().message())));
  if (!region.ok()) {
    REFIT_LOG(WARNING).Field("region", id).Field("pid", absl::StrCat(pid))
        << "region refused: " << std::string(region.status().message());
    lease->End(ToGrpcStatus(region.status()));
    lease->Unref();
    return region.status();
  }
  lease->Registered(**region, pid, uid);
  lease->Unref();
  return absl::OkStatus();
}

bool RegionService::AddLease(const std::string& id, const std::string& ticket, Reactor* reactor) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return false;
  leases_[id] = reactor;
  tickets_[ticket] = id;
  return true;
}

void RegionService::ForgetTicket(const std::string& ticket) {
  absl::MutexLock lock(&mu_);
  tickets_.erase(ticket);
}

void RegionService::RemoveLease(const std::string& id) {
  absl::MutexLock lock(&mu_);
  leases_.erase(id);
  for (auto it = tickets_.begin(); it != tickets_.end(); ++it) {
    if (it->second == id) {
      tickets_.erase(it);
      break;
    }
  }
}

void RegionService::Shutdown() {
  std::vector<Reactor*> leases;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    for (auto& [id, r] : leases_) {
      r->Ref();
      leases.push_back(r);
    }
  }
  for (Reactor* r : leases) {
    r->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"), "shutdown");
    r->Unref();
  }
}

}  // namespace refit::server
