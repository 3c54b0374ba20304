#include "server/attach_service.h"

#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/arena.h"
#include "core/log.h"
#include "core/text.h"
#include "server/grpc_convert.h"
#include "server/reactor_util.h"

namespace refit::server {

v1::EngineLayout ToProtoLayout(const core::ModelLayout& layout) {
  const core::LayoutIdentity id = core::IdentifyLayout(layout);
  v1::EngineLayout out;
  out.set_architecture(id.architecture);
  out.set_tp_rank(static_cast<uint32_t>(id.tp_rank));
  out.set_tp_size(static_cast<uint32_t>(id.tp_size));
  out.set_checkpoint_dtype(id.checkpoint_dtype);
  out.set_quantization(id.quantization);
  out.set_quant_config_hash(id.quant_config_hash);
  out.set_tensors_hash(id.tensors_hash);
  out.set_checkpoint_id(id.checkpoint_id);
  out.set_fingerprint(id.fingerprint);
  return out;
}

absl::Status CompareLayouts(const v1::EngineLayout& expect, const v1::EngineLayout& actual) {
  std::vector<std::string> diffs;
  auto text = [&](absl::string_view field, const std::string& want, const std::string& have) {
    if (!want.empty() && want != have) {
      diffs.push_back(absl::StrCat(field, " (engine expects ", core::QuoteText(want),
                                   ", daemon serves ", core::QuoteText(have), ")"));
    }
  };
  text("architecture", expect.architecture(), actual.architecture());
  // tp_size 0 means "not set". tp_rank 0 cannot be told from "not set"
  // unless tp_size is given; any other rank is always compared.
  if (expect.tp_size() != 0 && expect.tp_size() != actual.tp_size()) {
    diffs.push_back(absl::StrCat("tp_size (engine expects ", expect.tp_size(), ", daemon serves ",
                                 actual.tp_size(), ")"));
  }
  if ((expect.tp_size() != 0 || expect.tp_rank() != 0) && expect.tp_rank() != actual.tp_rank()) {
    diffs.push_back(absl::StrCat("tp_rank (engine expects ", expect.tp_rank(), ", daemon serves ",
                                 actual.tp_rank(), ")"));
  }
  text("checkpoint_dtype", expect.checkpoint_dtype(), actual.checkpoint_dtype());
  text("quantization", expect.quantization(), actual.quantization());
  text("quant_config_hash", expect.quant_config_hash(), actual.quant_config_hash());
  text("tensors_hash", expect.tensors_hash(), actual.tensors_hash());
  text("checkpoint_id", expect.checkpoint_id(), actual.checkpoint_id());
  text("fingerprint", expect.fingerprint(), actual.fingerprint());
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("layout mismatch: ", absl::StrJoin(diffs, ", ")));
}

bool IsUnixPeer(absl::string_view peer) {
  return absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:");
}

namespace {

std::string RandomTicket() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  std::string out;
  for (unsigned char b : bytes) absl::StrAppendFormat(&out, "%02x", b);
  return out;
}

// In the refusal of an attach before the first version; the Python client
// retries on it until its timeout.
constexpr absl::string_view kNoVersionYet = "serves no version yet";

}  // namespace

// One Attach stream: the engine's lease.
class AttachService::Reactor final
    : public grpc::ServerBidiReactor<v1::EngineMessage, v1::DaemonMessage>,
      public EngineSink {
 public:
  Reactor(AttachService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    if (!service_->Track(this)) {
      End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"));
      return;
    }
    if (!IsUnixPeer(context->peer())) {
      End(ToGrpcStatus(absl::FailedPreconditionError(
          absl::StrCat("attach needs a local Unix socket; this call came over ", context->peer(),
                       ": connect to the daemon's unix: listen address"))));
      return;
    }
    absl::StatusOr<Principal> caller =
        service_->refit()->Authorize(context, Action::kRead, "Attach");
    if (!caller.ok()) {
      End(ToGrpcStatus(caller.status()));
      return;
    }
    StartRead(&in_);
  }

  // Called by the registry with its lock held: queue only.
  bool Send(v1::DaemonMessage message) override {
    v1::DaemonMessage* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (out_.full()) return false;
      start = out_.Push(std::move(message));
    }
    if (start != nullptr) StartWrite(start);
    return true;
  }

  // Ends the lease with `status` (first call wins).
  void End(grpc::Status status) {
    std::string engine_id;
    std::string ticket;
    EngineRegistry* registry = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (!out_.Close(std::move(status), /*drop_queue=*/true)) return;
      engine_id = engine_id_;
      ticket = ticket_;
      registry = registry_;
    }
    if (registry != nullptr && !engine_id.empty()) {
      registry->Remove(engine_id);
      REFIT_LOG(INFO).Field("engine", engine_id).Field("group", group_) << "engine detached";
    }
    if (!ticket.empty()) service_->DropTicket(ticket);
    MaybeFinish();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The engine closed the stream or went away: the lease ends. Before
      // an attach message it never began: an engine that half-closed, or
      // whose first message did not parse, is told so.
      End(attached_ || context_->IsCancelled()
              ? grpc::Status::OK
              : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                             "Attach ended before an attach message: the stream was "
                             "closed, or its first message is not a valid EngineMessage"));
      return;
    }
    absl::Status handled = attached_ ? HandleAck() : HandleAttach();
    if (!handled.ok()) {
      End(ToGrpcStatus(handled));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (out_.closed()) return;
    }
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    v1::DaemonMessage* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      next = out_.WriteDone(ok);
    }
    if (next != nullptr) {
      StartWrite(next);
    } else {
      if (!ok) End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "engine stream broke"));
      MaybeFinish();
    }
  }

  void OnCancel() override { End(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")); }

  void OnDone() override {
    End(grpc::Status::OK);  // releases, if not yet
    service_->Untrack(this);
    Unref();
  }

  void EndLease(const absl::Status& status) override { End(ToGrpcStatus(status)); }
  void Ref() override { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() override {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  void MaybeFinish() {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      finish = out_.TakeFinish();
    }
    if (finish.has_value()) Finish(*finish);
  }

  absl::Status HandleAttach() {
    if (!in_.has_attach()) {
      return absl::FailedPreconditionError("the first message of Attach must be attach");
    }
    const v1::AttachRequest& request = in_.attach();
    if (request.engine_name().size() > kMaxEngineNameBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine_name is ", request.engine_name().size(), " bytes; at most ",
                       kMaxEngineNameBytes, " (it is shown in status and logs)"));
    }
    // A coordinated engine holds up every commit until it acks (or the
    // quiesce timeout passes): more than reading.
    if (request.coordinate()) {
      absl::StatusOr<Principal> caller =
          service_->refit()->Authorize(context_, Action::kCoordinate, "Attach");
      if (!caller.ok()) return caller.status();
    }
    absl::StatusOr<ModelGroup*> group = service_->refit()->FindGroup(request.model_group());
    if (!group.ok()) return group.status();
    core::ShardStore* store = (*group)->store();
    if (store->version() == 0) {
      // Its arena holds no weights before the first load ends (zeros; an
      // engine that does not check the version would serve them).
      return absl::UnavailableError(absl::StrCat(
          "model group ", core::QuoteText((*group)->name()), " ", kNoVersionYet,
          " (its first load is under way): attach once refitd is ready (refitctl health --wait)"));
    }
    const v1::EngineLayout layout = ToProtoLayout(store->layout());
    if (absl::Status s = CompareLayouts(request.expect(), layout); !s.ok()) return s;
    if (service_->fd_socket().empty()) {
      return absl::FailedPreconditionError(
          "attach needs a local Unix socket: the daemon listens on none (add a unix: address to "
          "--listen)");
    }
    EngineRegistry* registry = service_->RegistryFor(*group);
    group_ = (*group)->name();
    const core::ArenaInfo arena = store->arena();
    const std::vector<core::KernelView> kernels = store->Kernels();
    const bool coordinated = request.coordinate();
    std::string ticket;
    // The engine's first message, its manifest: sent under the registry's
    // lock (EngineRegistry::Add), so that no commit's Committed can be sent
    // between the version read here and this message.
    auto send_manifest = [&](const std::string& id, const v1::CommitPending* pending) -> uint64_t {
      ticket = service_->IssueTicket(group_, id);
      v1::DaemonMessage message;
      v1::Attached* a = message.mutable_attached();
      a->set_engine_id(id);
      a->set_model_group(group_);
      const core::LiveVersion live = store->live_version();
      a->set_version(live.version);
      a->set_fingerprint(live.fingerprint);
      *a->mutable_layout() = layout;
      v1::ArenaRegion* host = a->add_regions();
      host->set_kind(v1::ArenaRegion::KIND_HOST_MEMFD);
      host->set_bytes(static_cast<uint64_t>(arena.host_bytes));
      host->set_data_offset(static_cast<uint64_t>(core::kArenaDataOffset));
      uint32_t data_region = 0;
      if (arena.on_device) {
        v1::ArenaRegion* dev = a->add_regions();
        dev->set_cuda_device(arena.device_index);
        dev->set_cuda_device_uuid(arena.device_uuid);
        if (arena.device_vmm) {
          // The allocation's descriptor comes second from fd_socket.
          dev->set_kind(v1::ArenaRegion::KIND_CUDA_VMM);
          dev->set_bytes(static_cast<uint64_t>(arena.device_mapped_bytes));
          dev->set_fd_index(1);
        } else {
          dev->set_kind(v1::ArenaRegion::KIND_CUDA_IPC);
          dev->set_bytes(static_cast<uint64_t>(arena.data_bytes));
          dev->set_cuda_ipc_handle(arena.ipc_handle);
        }
        data_region = 1;
      }
      for (const core::KernelView& k : kernels) {
        v1::ArenaTensor* t = a->add_tensors();
        t->set_name(k.spec->name);
        t->set_dtype(std::string(core::TorchDTypeName(k.spec->dtype)));
        int64_t stride = 1;
        std::vector<int64_t> strides(k.spec->shape.size());
        for (size_t d = k.spec->shape.size(); d-- > 0;) {
          strides[d] = stride;
          stride *= k.spec->shape[d];
        }
        for (int64_t d : k.spec->shape) t->add_shape(d);
        for (int64_t s : strides) t->add_strides(s);
        t->set_region(data_region);
        t->set_byte_offset(static_cast<uint64_t>(k.arena_offset));
        t->set_nbytes(static_cast<uint64_t>(k.nbytes));
      }
      a->set_fd_socket(service_->fd_socket());
      a->set_ticket(ticket);
      a->set_coordinated(coordinated);
      if (pending != nullptr) *a->mutable_pending() = *pending;
      Send(std::move(message));
      return live.version;
    };
    absl::StatusOr<std::string> added =
        registry->Add(request.engine_name(), coordinated, this, send_manifest);
    if (!added.ok()) {
      REFIT_LOG(WARNING).Field("group", (*group)->name())
          << "attach refused: " << added.status().message();
      return added.status();
    }
    const std::string engine_id = *std::move(added);
    bool ended = false;
    {
      absl::MutexLock lock(&mu_);
      engine_id_ = engine_id;
      ticket_ = ticket;
      registry_ = registry;
      ended = out_.closed();
    }
    attached_ = true;
    if (ended) {
      // Cancelled meanwhile: End ran without the id.
      registry->Remove(engine_id);
      service_->DropTicket(ticket);
      return absl::OkStatus();
    }
    REFIT_LOG(INFO)
            .Field("engine", engine_id)
            .Field("group", group_)
            .Field("name", request.engine_name())
            .Field("coordinated", coordinated ? "true" : "false")
        << "engine attached";
    return absl::OkStatus();
  }

  absl::Status HandleAck() {
    if (!in_.has_quiesced()) {
      return absl::FailedPreconditionError("an attached engine sends only quiesced");
    }
    registry_->OnQuiesced(engine_id_, in_.quiesced().refit_id(), in_.quiesced().version(),
                          in_.quiesced().attempt());
    return absl::OkStatus();
  }

  std::atomic<int> refs_{1};  // gRPC's, until OnDone
  AttachService* const service_;
  grpc::CallbackServerContext* const context_;
  v1::EngineMessage in_;                // touched by the reading side only
  bool attached_ = false;               // reading side only
  std::string group_;                   // set before attached_
  EngineRegistry* registry_ = nullptr;  // set with engine_id_, read by the reading side

  absl::Mutex mu_;
  WriteQueue<v1::DaemonMessage> out_ ABSL_GUARDED_BY(mu_);
  std::string engine_id_;
  std::string ticket_;

 public:
  void ShutdownLease() {
    End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "refitd is shutting down"));
  }
};

AttachService::AttachService(RefitServiceImpl* refit, absl::Duration quiesce_timeout,
                             Metrics* metrics, int max_engines)
    : refit_(refit),
      quiesce_timeout_(quiesce_timeout),
      metrics_(metrics),
      max_engines_(max_engines) {}

AttachService::~AttachService() {
  Shutdown();
  absl::MutexLock lock(&mu_);
  registries_.clear();
}

absl::Status AttachService::StartFdSocket(std::string path, AttachFdServer::Deposit deposit) {
  AttachService* self = this;
  absl::StatusOr<std::unique_ptr<AttachFdServer>> server = AttachFdServer::Start(
      path,
      [self](absl::string_view ticket, int pid, uint32_t uid) {
        return self->Redeem(ticket, pid, uid);
      },
      std::move(deposit));
  if (!server.ok()) return server.status();
  fd_server_ = std::move(*server);
  fd_socket_ = std::move(path);
  return absl::OkStatus();
}

grpc::ServerBidiReactor<v1::EngineMessage, v1::DaemonMessage>* AttachService::Attach(
    grpc::CallbackServerContext* context) {
  return new Reactor(this, context);
}

std::vector<EngineInfo> AttachService::Engines(absl::string_view group) const {
  EngineRegistry* registry = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = registries_.find(std::string(group));
    if (it == registries_.end()) return {};
    registry = it->second.get();
  }
  return registry->List();
}

void AttachService::FillEngines(absl::string_view group, v1::GetStatusResponse* response) const {
  for (const EngineInfo& e : Engines(group)) {
    v1::AttachedEngine* out = response->add_engines();
    out->set_engine_id(e.engine_id);
    out->set_name(e.name);
    out->set_pid(e.pid);
    out->set_uid(e.uid);
    out->set_coordinated(e.coordinated);
    out->set_attached_unix_seconds(UnixSecondsOf(e.attached));
    out->set_version(e.version);
  }
}

void AttachService::Shutdown() {
  std::vector<Reactor*> reactors;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    // Each reference keeps its reactor alive until it has been ended here.
    for (Reactor* r : reactors_) {
      r->Ref();
      reactors.push_back(r);
    }
  }
  for (Reactor* r : reactors) {
    r->ShutdownLease();
    r->Unref();
  }
  if (fd_server_ != nullptr) fd_server_->Stop();
}

EngineRegistry* AttachService::RegistryFor(ModelGroup* group) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<EngineRegistry>& registry = registries_[group->name()];
  if (registry == nullptr) {
    registry =
        std::make_unique<EngineRegistry>(group->store(), quiesce_timeout_, metrics_, max_engines_);
  }
  return registry.get();
}

std::string AttachService::IssueTicket(absl::string_view group, absl::string_view engine_id) {
  std::string ticket = RandomTicket();
  absl::MutexLock lock(&mu_);
  tickets_[ticket] = Ticket{std::string(group), std::string(engine_id)};
  return ticket;
}

void AttachService::DropTicket(absl::string_view ticket) {
  absl::MutexLock lock(&mu_);
  tickets_.erase(std::string(ticket));
}

bool AttachService::Track(Reactor* reactor) {
  absl::MutexLock lock(&mu_);
  reactors_.insert(reactor);
  return !shut_down_;
}

void AttachService::Untrack(Reactor* reactor) {
  absl::MutexLock lock(&mu_);
  reactors_.erase(reactor);
}

absl::StatusOr<std::vector<int>> AttachService::Redeem(absl::string_view ticket, int pid,
                                                       uint32_t uid) {
  Ticket t;
  EngineRegistry* registry = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(std::string(ticket));
    if (it == tickets_.end()) {
      return absl::PermissionDeniedError(
          "unknown attach ticket (used already, or its Attach stream ended)");
    }
    t = it->second;
    tickets_.erase(it);
    auto r = registries_.find(t.group);
    if (r != registries_.end()) registry = r->second.get();
  }
  absl::StatusOr<ModelGroup*> group = refit_->FindGroup(t.group);
  if (!group.ok()) return group.status();
  if (registry != nullptr) registry->SetPeer(t.engine_id, pid, uid);
  REFIT_LOG(INFO)
          .Field("engine", t.engine_id)
          .Field("pid", absl::StrCat(pid))
          .Field("uid", absl::StrCat(uid))
      << "engine mapped the arena";
  const core::ShardStore* store = (*group)->store();
  absl::StatusOr<int> host = store->OpenArenaReadOnly();
  if (!host.ok()) return host.status();
  std::vector<int> fds = {*host};
  if (store->arena().device_vmm) {
    absl::StatusOr<int> device = store->ExportDeviceArenaFd();
    if (!device.ok()) {
      ::close(*host);
      return device.status();
    }
    fds.push_back(*device);
  }
  return fds;
}

}  // namespace refit::server
