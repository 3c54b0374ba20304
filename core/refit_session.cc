#include "core/refit_session.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/log.h"

namespace refit::core {
namespace {

// Worker jobs are layers (id >= 0) or expert parts (id < 0, below).
constexpr int kPartsPerLayer = 1 << 16;
int PartJob(int layer, int part) { return -1 - (layer * kPartsPerLayer + part); }

std::string NewRefitId() {
  static std::atomic<uint64_t> counter{0};
  const uint64_t n = counter.fetch_add(1) + 1;
  const uint64_t t = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  return absl::StrFormat("r-%x-%d", t & 0xffffffffff, n);
}

}  // namespace

absl::string_view SessionStateName(SessionState state) {
  switch (state) {
    case SessionState::kReceiving:
      return "receiving";
    case SessionState::kPrepared:
      return "prepared";
    case SessionState::kCommitted:
      return "committed";
    case SessionState::kAborted:
      return "aborted";
  }
  return "unknown";
}

void RefitSession::Outbox::Deliver() {
  if (slot != nullptr) {
    if (release) {
      slot->ReleaseAndPublish(std::move(events));
    } else {
      for (StoreEvent& event : events) slot->Publish(std::move(event));
    }
  }
  events.clear();
  slot.reset();
}

absl::StatusOr<std::unique_ptr<RefitSession>> RefitSession::Begin(ShardStore* store,
                                                                  RefitOptions options) {
  if (store == nullptr) return absl::InvalidArgumentError("RefitSession needs a store");
  if (options.refit_id.empty()) options.refit_id = NewRefitId();
  if (options.staging_budget_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staging_budget_bytes must not be negative, got ", options.staging_budget_bytes));
  }
  absl::StatusOr<RefitSlot> slot = store->AcquireRefitSlot(options.refit_id);
  if (!slot.ok()) return slot.status();
  // Holding the slot, nothing else can commit: the check below stays true
  // for the whole refit.
  if (options.base_version.has_value() && *options.base_version != store->version()) {
    return absl::AbortedError(absl::StrCat(
        "refit expects base version ", *options.base_version, " but model group \"", store->group(),
        "\" serves version ", store->version(), "; read the live version and retry"));
  }
  LayerProcessorOptions processing;
  processing.non_finite = options.non_finite;
  processing.quantize_threads = options.quantize_threads;
  processing.host_staging = options.host_staging;
  processing.scale_hints = store->scale_hints();
  absl::StatusOr<std::unique_ptr<LayerProcessor>> processor =
      CreateLayerProcessor(*store, processing);
  if (!processor.ok()) {
    return absl::Status(processor.status().code(),
                        absl::StrCat("refit \"", options.refit_id, "\": cannot set up staging on ",
                                     store->device(), ": ", processor.status().message()));
  }
  auto shared_slot = std::make_shared<RefitSlot>(*std::move(slot));
  std::unique_ptr<RefitSession> session(
      new RefitSession(store, std::move(options), shared_slot, *std::move(processor)));
  REFIT_LOG(INFO)
          .Field("refit_id", session->refit_id())
          .Field("group", store->group())
          .Field("base_version", absl::StrCat(store->version()))
      << "staging started";
  if (session->options_.announce_start) session->AnnounceStart();
  return session;
}

void RefitSession::AnnounceStart() {
  Outbox out;
  {
    absl::MutexLock lock(&call_mu_);
    if (announced_ || StateNow() != SessionState::kReceiving) return;
    announced_ = true;
    QueueEventLocked(StoreEventType::kStagingStarted);
    out = EndCallLocked();
  }
  out.Deliver();
}

RefitSession::RefitSession(ShardStore* store, RefitOptions options, std::shared_ptr<RefitSlot> slot,
                           std::unique_ptr<LayerProcessor> processor)
    : store_(store),
      layout_(store->layout()),
      options_(std::move(options)),
      begin_time_(absl::Now()),
      slot_(std::move(slot)),
      processor_(std::move(processor)),
      assembler_(layout_,
                 LayerAssembler::Options{options_.allow_partial_layers, processor_->on_device()},
                 [this](const LayerSpec& layer, int64_t bytes) {
                   // Called from within assembler_.Ingest, under call_mu_.
                   call_mu_.AssertHeld();
                   return ReserveStagingLocked(layer, bytes);
                 }),
      worker_([this](int job, std::vector<StagingBuffer> params,
                     absl::Span<const UpcomingLayer> upcoming) {
        if (job >= 0) return processor_->Process(job, std::move(params), upcoming);
        const int unit = -1 - job;
        return processor_->ProcessPart(unit / kPartsPerLayer, unit % kPartsPerLayer,
                                       std::move(params[0]));
      }),
      processed_(layout_.layers().size()),
      last_ingest_(begin_time_) {
  for (ProcessedLayer& p : processed_) p.layer = -1;
}

RefitSession::~RefitSession() {
  Outbox out;
  {
    absl::MutexLock lock(&call_mu_);
    FailLocked(absl::AbortedError(absl::StrCat("refit \"", options_.refit_id,
                                               "\" aborted: session destroyed before commit")));
    out = EndCallLocked();
  }
  out.Deliver();
  worker_.Stop();
}

absl::Status RefitSession::Ingest(const Chunk& chunk) {
  Outbox out;
  absl::Status status;
  {
    absl::MutexLock lock(&call_mu_);
    status = IngestLocked(chunk);
    out = EndCallLocked();
  }
  out.Deliver();
  return status;
}

absl::StatusOr<RefitResult> RefitSession::Prepare() {
  Outbox out;
  absl::StatusOr<RefitResult> result;
  {
    absl::MutexLock lock(&call_mu_);
    result = PrepareLocked();
    out = EndCallLocked();
  }
  out.Deliver();
  return result;
}

absl::StatusOr<RefitResult> RefitSession::Commit() {
  Outbox out;
  absl::StatusOr<RefitResult> result;
  {
    absl::MutexLock lock(&call_mu_);
    result = CommitLocked();
    out = EndCallLocked();
  }
  out.Deliver();
  return result;
}

void RefitSession::Abort(absl::string_view reason) {
  // A Commit waiting for attached engines to quiesce holds call_mu_ until
  // they answer or --engine-quiesce-timeout passes. The wait ends first, so
  // that the refit aborts with nothing copied (instead of committing after
  // its abort, with this call blocked meanwhile).
  // A refit committed already has no wait to end (and a record of the
  // cancel would outlive it).
  if (StateNow() != SessionState::kCommitted) store_->CancelCommitWait(options_.refit_id, reason);
  {
    // Part of a linked commit: the other refits' waits end too (the engines
    // of every group are asked at once, and this refit's own wait may come
    // after theirs).
    absl::MutexLock lock(&linked_mu_);
    for (const auto& [store, refit_id] : linked_) {
      store->CancelLinkedCommitWait(
          refit_id, absl::StrCat("refit \"", options_.refit_id, "\" of model group \"",
                                 store_->group(), "\", linked to it, was aborted: ", reason));
    }
  }
  Outbox out;
  {
    absl::MutexLock lock(&call_mu_);
    FailLocked(
        absl::AbortedError(absl::StrCat("refit \"", options_.refit_id, "\" aborted: ", reason)));
    out = EndCallLocked();
  }
  out.Deliver();
}

SessionState RefitSession::state() const { return StateNow(); }

SessionProgress RefitSession::progress() const {
  absl::MutexLock lock(&mu_);
  return progress_;
}

absl::Status RefitSession::abort_status() const {
  absl::MutexLock lock(&mu_);
  return abort_status_;
}

SessionState RefitSession::StateNow() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

void RefitSession::SetState(SessionState state, absl::Status reason) {
  absl::MutexLock lock(&mu_);
  state_ = state;
  if (!reason.ok()) abort_status_ = std::move(reason);
}

absl::Status RefitSession::NotReceiving() const {
  absl::MutexLock lock(&mu_);
  return absl::FailedPreconditionError(
      absl::StrCat("refit \"", options_.refit_id, "\" is ", SessionStateName(state_),
                   abort_status_.ok() ? "" : absl::StrCat(" (", abort_status_.message(), ")")));
}

absl::Status RefitSession::IngestLocked(const Chunk& chunk) {
  const SessionState state = StateNow();
  if (state == SessionState::kAborted) return abort_status();
  if (state != SessionState::kReceiving) return NotReceiving();
  // A layer that failed on the worker fails the next call.
  absl::Status status = worker_.status();
  if (status.ok()) {
    absl::StatusOr<WorkUnit> completed = assembler_.IngestUnit(chunk);
    status = completed.status();
    if (status.ok() && completed->layer >= 0) {
      // Observers see the chunk counted while its layer is processed.
      RefreshProgressLocked();
      status = completed->part >= 0 ? ProcessPartLocked(completed->layer, completed->part)
                                    : ProcessCompleteLocked(completed->layer);
    }
  }
  last_ingest_ = absl::Now();
  if (!status.ok()) FailLocked(status);
  return status;
}

namespace {
// A complete layer holding at most this much staging of its own may wait
// for the worker behind another one (LayerWorker::Submit's `light`).
constexpr int64_t kLightLayerBytes = int64_t{1} << 20;
}  // namespace

absl::Status RefitSession::ProcessCompleteLocked(int layer) {
  if (!options_.overlap_processing) return ProcessHereLocked(layer);
  const int64_t bytes = layout_.layers()[layer].param_bytes();
  std::vector<StagingBuffer> params = assembler_.TakeParams(layer);
  // Light: the bytes the layer's staging holds itself (not aliases into a
  // trainer's region) are a sliver of it (norms, biases) or small.
  int64_t aliased = 0;
  for (const StagingBuffer& p : params) aliased += p.aliased_bytes();
  const bool light = bytes - aliased <= std::max<int64_t>(bytes / 16, kLightLayerBytes);
  absl::Status submitted = worker_.Submit(layer, std::move(params), bytes, light);
  CollectDoneLocked();
  return submitted;
}

absl::Status RefitSession::ProcessPartLocked(int layer, int part) {
  if (!options_.overlap_processing) return ProcessPartHereLocked(layer, part);
  const int64_t bytes = layout_.layers()[layer].part_bytes(part);
  std::vector<StagingBuffer> params;
  params.push_back(assembler_.TakePart(layer, part));
  absl::Status submitted = worker_.Submit(PartJob(layer, part), std::move(params), bytes);
  CollectDoneLocked();
  return submitted;
}

absl::Status RefitSession::ProcessPartHereLocked(int layer, int part) {
  if (absl::Status s = assembler_.EnsurePartStaging(layer, part); !s.ok()) return s;
  absl::StatusOr<ProcessedLayer> processed =
      processor_->ProcessPart(layer, part, assembler_.TakePart(layer, part));
  if (!processed.ok()) return processed.status();
  RecordLocked(*std::move(processed));
  return absl::OkStatus();
}

absl::Status RefitSession::FinishExpertsLocked(int layer) {
  const LayerSpec& spec = layout_.layers()[layer];
  std::vector<std::string> kept;
  for (size_t p = 0; p < spec.parts.size(); ++p) {
    const int part = static_cast<int>(p);
    if (assembler_.part_taken(layer, part)) continue;
    if (assembler_.part_loaded(layer, part) == 0) {
      kept.push_back(spec.parts[p].name);
      continue;
    }
    const std::vector<std::string> missing = assembler_.MissingPartTensors(layer, part);
    if (!options_.allow_partial_layers) {
      return absl::FailedPreconditionError(absl::StrCat(
          "expert \"", spec.parts[p].name, "\" is incomplete: no bytes for ",
          absl::StrJoin(missing, ", "), " (", assembler_.part_loaded(layer, part), " of ",
          spec.parts[p].numel(), " elements); send them or set allow_partial_layers to zero-fill"));
    }
    if (absl::Status s = ProcessPartHereLocked(layer, part); !s.ok()) return s;
    partial_layers_.push_back(spec.parts[p].name);
  }
  if (processed_[layer].layer < 0) {
    // Experts that got nothing keep their live bytes (the slot is held: no
    // commit can change them meanwhile).
    absl::StatusOr<ProcessedLayer> finished = processor_->FinishParts(
        layer, [this](const KernelSpec& kernel, int64_t offset, int64_t n, std::string* out) {
          uint64_t version = 0;
          return store_->ReadKernelRange(kernel.name, offset, n, out, &version);
        });
    if (!finished.ok()) return finished.status();
    RecordLocked(*std::move(finished));
  }
  if (!kept.empty()) {
    REFIT_LOG(WARNING)
            .Field("refit_id", options_.refit_id)
            .Field("layer", spec.name)
            .Field("kept_experts", absl::StrCat(kept.size()))
        << "experts received no weights; keeping their live values";
  }
  for (std::string& name : kept) kept_layers_.push_back(std::move(name));
  return absl::OkStatus();
}

absl::Status RefitSession::ProcessHereLocked(int layer) {
  if (absl::Status s = assembler_.EnsureStaging(layer); !s.ok()) return s;
  absl::StatusOr<ProcessedLayer> processed =
      processor_->Process(layer, assembler_.TakeParams(layer));
  if (!processed.ok()) return processed.status();
  RecordLocked(*std::move(processed));
  return absl::OkStatus();
}

void RefitSession::RecordLocked(ProcessedLayer processed) {
  // An expert part alone: its time is counted with its finished layer.
  if (processed.part >= 0) return;
  for (const StagingBuffer& kernel : processed.kernels) staged_kernel_bytes_ += kernel.size();
  timings_.quantize += processed.took;
  timings_.hashing += processed.hashing;
  scales_reused_ += processed.scales_reused;
  amax_ahead_ += processed.amax_ahead;
  ++layers_done_;
  const int layer = processed.layer;
  processed_[layer] = std::move(processed);
}

void RefitSession::CollectDoneLocked() {
  for (ProcessedLayer& processed : worker_.TakeDone()) RecordLocked(std::move(processed));
}

absl::Status RefitSession::ReserveStagingLocked(const LayerSpec& layer, int64_t bytes) {
  const int64_t budget = options_.staging_budget_bytes;
  int64_t held = assembler_.staging_bytes() + worker_.held_bytes();
  if (held + bytes > budget && worker_.held_bytes() > 0) {
    // Complete layers still hold staging until the worker is through with
    // them: wait for it (backpressure) rather than fail.
    absl::Status drained = worker_.Drain();
    CollectDoneLocked();
    if (!drained.ok()) return drained;
    held = assembler_.staging_bytes() + worker_.held_bytes();
  }
  if (held + bytes > budget) {
    return absl::ResourceExhaustedError(
        absl::StrCat("staging budget exceeded: layer \"", layer.name, "\" needs ", bytes,
                     " bytes of high-precision staging, ", held, " bytes are held by ",
                     assembler_.layers_in_flight(), " incomplete layer(s), budget ", budget,
                     " bytes; send tensors layer by layer or raise the budget"));
  }
  peak_staging_bytes_ = std::max(peak_staging_bytes_, held + bytes);
  return absl::OkStatus();
}

absl::StatusOr<RefitResult> RefitSession::PrepareLocked() {
  if (StateNow() != SessionState::kReceiving) return NotReceiving();
  if (absl::Status status = FinalizeLocked(); !status.ok()) {
    FailLocked(status);
    return status;
  }
  SetState(SessionState::kPrepared);
  REFIT_LOG(INFO)
          .Field("refit_id", options_.refit_id)
          .Field("group", store_->group())
          .Field("bytes", absl::StrCat(assembler_.bytes_received()))
          .Field("kept_layers", absl::StrCat(kept_layers_.size()))
          // Where the layer worker's time went.
          .Field("quantize_ms",
                 absl::StrFormat("%.1f", absl::ToDoubleMilliseconds(timings_.quantize)))
          .Field("hash_ms", absl::StrFormat("%.1f", absl::ToDoubleMilliseconds(timings_.hashing)))
          // Per-tensor weights read once: their scale came out as hinted.
          .Field("scales_reused", absl::StrCat(scales_reused_))
          // Per-tensor weights whose amax the weight before them took.
          .Field("amax_ahead", absl::StrCat(amax_ahead_))
      << "prepared";
  QueueEventLocked(StoreEventType::kPrepared);
  return ResultLocked(store_->version(), store_->fingerprint());
}

absl::Status RefitSession::FinalizeLocked() {
  const absl::Time start = absl::Now();
  timings_.receive = last_ingest_ - begin_time_;
  absl::Status drained = worker_.Drain();
  CollectDoneLocked();
  if (!drained.ok()) return drained;
  if (absl::Status complete = assembler_.CheckTensorsComplete(); !complete.ok()) return complete;
  for (size_t l = 0; l < layout_.layers().size(); ++l) {
    const LayerSpec& spec = layout_.layers()[l];
    const int layer = static_cast<int>(l);
    if (processed_[l].layer >= 0) continue;
    if (spec.kind == LayerKind::kAttention) {
      if (absl::Status s = ProcessHereLocked(layer); !s.ok()) return s;
      continue;
    }
    if (spec.expected_numel == 0) continue;  // nothing of it lives on this rank
    if (spec.kind == LayerKind::kExperts && assembler_.loaded(layer) > 0) {
      if (absl::Status s = FinishExpertsLocked(layer); !s.ok()) return s;
      continue;
    }
    if (assembler_.loaded(layer) == 0) {
      kept_layers_.push_back(spec.name);
      REFIT_LOG(WARNING).Field("refit_id", options_.refit_id).Field("layer", spec.name)
          << "received no weights; keeping the live values";
      continue;
    }
    const std::vector<std::string> missing = assembler_.MissingTensors(layer);
    if (!options_.allow_partial_layers) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer \"", spec.name, "\" is incomplete: no bytes for ", absl::StrJoin(missing, ", "),
          " (", assembler_.loaded(layer), " of ", spec.expected_numel,
          " elements); send them or set allow_partial_layers to zero-fill"));
    }
    if (absl::Status s = ProcessHereLocked(layer); !s.ok()) return s;
    partial_layers_.push_back(spec.name);
    REFIT_LOG(WARNING).Field("refit_id", options_.refit_id).Field("layer", spec.name)
        << "zero-filled missing tensors: " << absl::StrJoin(missing, ", ");
  }
  // After the loop, so that a layer received in part is named as such first.
  if (options_.require_complete && assembler_.bytes_received() > 0) {
    if (absl::Status complete = CheckAllLayersLocked(); !complete.ok()) return complete;
  }
  // Nothing reads the refit's inputs after this.
  if (options_.input_check) {
    if (absl::Status intact = options_.input_check(); !intact.ok()) return intact;
  }
  timings_.finalize = absl::Now() - start;
  return absl::OkStatus();
}

absl::Status RefitSession::CheckAllLayersLocked() const {
  constexpr size_t kNamed = 5;
  std::vector<std::string> missing;
  size_t count = 0;
  for (size_t l = 0; l < layout_.layers().size(); ++l) {
    const LayerSpec& spec = layout_.layers()[l];
    if (spec.kind == LayerKind::kAttention || spec.expected_numel == 0) continue;
    if (spec.kind == LayerKind::kExperts && assembler_.loaded(static_cast<int>(l)) > 0) {
      // Experts kept while others of the layer came.
      for (size_t p = 0; p < spec.parts.size(); ++p) {
        if (assembler_.part_loaded(static_cast<int>(l), static_cast<int>(p)) > 0) continue;
        for (std::string& name :
             assembler_.MissingPartTensors(static_cast<int>(l), static_cast<int>(p))) {
          ++count;
          if (missing.size() < kNamed) missing.push_back(std::move(name));
        }
      }
      continue;
    }
    if (assembler_.loaded(static_cast<int>(l)) > 0) continue;  // partial ones fail below
    for (std::string& name : assembler_.MissingTensors(static_cast<int>(l))) {
      ++count;
      if (missing.size() < kNamed) missing.push_back(std::move(name));
    }
  }
  if (count == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "refit \"", options_.refit_id, "\" is incomplete (require_complete): ", count,
      " checkpoint tensor(s) got no bytes: ", absl::StrJoin(missing, ", "),
      count > missing.size() ? absl::StrCat(" and ", count - missing.size(), " more") : "",
      "; send the whole model, or turn require_complete off for a partial refit (refitctl push "
      "--partial)"));
}

absl::StatusOr<RefitResult> RefitSession::CommitLocked() {
  const bool was_prepared = StateNow() == SessionState::kPrepared;
  if (StateNow() == SessionState::kReceiving) {
    absl::StatusOr<RefitResult> prepared = PrepareLocked();
    if (!prepared.ok()) return prepared.status();
  }
  if (StateNow() != SessionState::kPrepared) return NotReceiving();
  if (assembler_.bytes_received() == 0) return CommitUnchangedLocked();

  std::vector<StagedKernel> staged = StagedKernelsLocked();
  absl::StatusOr<CommitStats> stats = slot_->Commit(staged);
  if (!stats.ok() && IsNotQuiesced(stats.status())) {
    // Attached engines did not reach their safe point: nothing was copied.
    // A refit prepared before this call stays PREPARED, so that whoever
    // decides (a fleet's two-phase commit) can still commit it later or
    // abort it; a one-phase refit has no later, so it ends here.
    if (was_prepared) {
      return absl::DeadlineExceededError(absl::StrCat(
          "refit \"", options_.refit_id, "\" not committed: ", stats.status().message(),
          "; it stays PREPARED: commit it again or abort it"));
    }
    absl::Status aborted = absl::AbortedError(
        absl::StrCat("refit \"", options_.refit_id, "\" aborted: ", stats.status().message()));
    FailLocked(aborted);
    return aborted;
  }
  if (!stats.ok()) {
    FailLocked(stats.status());
    return stats.status();
  }
  return CommittedLocked(*stats);
}

RefitResult RefitSession::CommittedLocked(const CommitStats& stats) {
  timings_.commit = stats.pause;
  RefitResult result = ResultLocked(stats.version, stats.fingerprint);
  EndCommittedLocked();
  REFIT_LOG(INFO)
          .Field("refit_id", options_.refit_id)
          .Field("group", store_->group())
          .Field("version", absl::StrCat(stats.version))
          .Field("fingerprint", stats.fingerprint)
          .Field("pause_us", absl::StrCat(absl::ToInt64Microseconds(stats.pause)))
      << "committed";
  QueueEventLocked(StoreEventType::kCommitted);
  return result;
}

std::vector<StagedKernel> RefitSession::StagedKernelsLocked() const {
  // A zero-byte kernel has no storage; give the copy a valid pointer.
  static const uint8_t kEmpty = 0;
  std::vector<StagedKernel> staged;
  for (const ProcessedLayer& processed : processed_) {
    if (processed.layer < 0) continue;
    const LayerSpec& spec = layout_.layers()[processed.layer];
    for (size_t k = 0; k < processed.kernels.size(); ++k) {
      StagedKernel s;
      s.kernel = spec.first_kernel + static_cast<int>(k);
      s.data = processed.kernels[k].empty() ? &kEmpty : processed.kernels[k].data();
      s.on_device = processed.kernels[k].on_device();
      s.hash = processed.hashes[k];
      staged.push_back(s);
    }
  }
  return staged;
}

absl::StatusOr<std::vector<RefitResult>> RefitSession::CommitLinked(
    absl::Span<RefitSession* const> sessions) {
  if (sessions.empty()) return absl::InvalidArgumentError("linked commit of no refits");
  std::vector<size_t> order(sessions.size());
  for (size_t i = 0; i < sessions.size(); ++i) {
    if (sessions[i] == nullptr) return absl::InvalidArgumentError("linked commit of a null refit");
    order[i] = i;
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return sessions[a]->store_->group() < sessions[b]->store_->group();
  });
  for (size_t k = 1; k < order.size(); ++k) {
    if (sessions[order[k]]->store_->group() == sessions[order[k - 1]]->store_->group()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "linked commit names model group \"", sessions[order[k]]->store_->group(), "\" twice"));
    }
  }
  // Each session learns the others, for an Abort that comes while the
  // commit waits for attached engines.
  auto set_linked = [&](bool on) {
    for (RefitSession* session : sessions) {
      absl::MutexLock lock(&session->linked_mu_);
      session->linked_.clear();
      if (!on) continue;
      for (RefitSession* other : sessions) {
        if (other != session)
          session->linked_.emplace_back(other->store_, other->options_.refit_id);
      }
    }
  };
  set_linked(true);
  std::vector<Outbox> outboxes(sessions.size());
  absl::StatusOr<std::vector<RefitResult>> results = CommitLinkedLocked(sessions, order, outboxes);
  set_linked(false);
  for (size_t i : order) outboxes[i].Deliver();
  return results;
}

absl::StatusOr<std::vector<RefitResult>> RefitSession::CommitLinkedLocked(
    absl::Span<RefitSession* const> sessions, const std::vector<size_t>& order,
    std::vector<Outbox>& outboxes) {
  for (size_t i : order) sessions[i]->call_mu_.Lock();
  absl::Status refused = absl::OkStatus();
  for (size_t i : order) {
    RefitSession* session = sessions[i];
    const SessionState state = session->StateNow();
    if (state == SessionState::kPrepared) continue;
    refused = absl::FailedPreconditionError(
        absl::StrCat("refit \"", session->options_.refit_id, "\" of model group \"",
                     session->store_->group(), "\" is ", SessionStateName(state),
                     ", not prepared; a linked commit needs every refit PREPARED"));
    break;
  }
  std::vector<RefitResult> results(sessions.size());
  if (refused.ok()) {
    // Sessions that received nothing commit unchanged, outside the copy.
    std::vector<std::vector<StagedKernel>> staged(sessions.size());
    std::vector<RefitSlot::LinkedPart> parts;
    std::vector<size_t> part_of;
    for (size_t i = 0; i < sessions.size(); ++i) {
      if (sessions[i]->assembler_.bytes_received() == 0) continue;
      staged[i] = sessions[i]->StagedKernelsLocked();
      parts.push_back({sessions[i]->slot_.get(), &staged[i]});
      part_of.push_back(i);
    }
    absl::StatusOr<std::vector<CommitStats>> stats = std::vector<CommitStats>();
    if (!parts.empty()) stats = RefitSlot::CommitLinked(parts);
    if (!stats.ok() && IsNotQuiesced(stats.status())) {
      // Attached engines did not quiesce: nothing was copied, and every
      // refit (all PREPARED) stays PREPARED, as for one refit.
      refused = absl::DeadlineExceededError(
          absl::StrCat("linked commit not done: ", stats.status().message(),
                       "; the refits stay PREPARED: commit them again or abort them"));
    } else if (!stats.ok()) {
      // As for one refit: a commit that failed aborts, here all of them.
      for (size_t i : order) sessions[i]->FailLocked(stats.status());
      refused = stats.status();
    } else {
      for (size_t p = 0; p < part_of.size(); ++p) {
        results[part_of[p]] = sessions[part_of[p]]->CommittedLocked((*stats)[p]);
      }
      for (size_t i = 0; i < sessions.size(); ++i) {
        if (sessions[i]->assembler_.bytes_received() == 0) {
          results[i] = *sessions[i]->CommitUnchangedLocked();
        }
      }
    }
  }
  for (size_t i : order) outboxes[i] = sessions[i]->EndCallLocked();
  for (auto it = order.rbegin(); it != order.rend(); ++it) sessions[*it]->call_mu_.Unlock();
  if (!refused.ok()) return refused;
  return results;
}

absl::StatusOr<RefitResult> RefitSession::CommitUnchangedLocked() {
  const LiveVersion live = store_->live_version();
  RefitResult result = ResultLocked(live.version, live.fingerprint);
  EndCommittedLocked();
  REFIT_LOG(INFO)
          .Field("refit_id", options_.refit_id)
          .Field("group", store_->group())
          .Field("version", absl::StrCat(live.version))
      << "committed unchanged: no chunk arrived, no new version";
  QueueEventLocked(StoreEventType::kCommitted, "unchanged");
  return result;
}

void RefitSession::EndCommittedLocked() {
  SetState(SessionState::kCommitted);
  worker_.Stop();
  assembler_.Clear();
  processed_.clear();
  staged_kernel_bytes_ = 0;
  outbox_.release = true;
}

void RefitSession::FailLocked(absl::Status reason) {
  const SessionState state = StateNow();
  if (state == SessionState::kAborted || state == SessionState::kCommitted) return;
  SetState(SessionState::kAborted, reason);
  worker_.Stop();
  assembler_.Clear();
  processed_.clear();
  staged_kernel_bytes_ = 0;
  REFIT_LOG(WARNING)
          .Field("refit_id", options_.refit_id)
          .Field("group", store_->group())
          .Field("version", absl::StrCat(store_->version()))
      << "aborted: " << std::string(reason.message());
  QueueEventLocked(StoreEventType::kAborted, std::string(reason.message()));
  outbox_.release = true;
}

RefitResult RefitSession::ResultLocked(uint64_t version, std::string fingerprint) const {
  RefitResult result;
  result.refit_id = options_.refit_id;
  result.version = version;
  result.fingerprint = std::move(fingerprint);
  result.kept_layers = kept_layers_;
  result.partial_layers = partial_layers_;
  result.timings = timings_;
  result.bytes_received = assembler_.bytes_received();
  result.bytes_read_in_place = assembler_.bytes_in_place();
  result.peak_staging_bytes = peak_staging_bytes_;
  result.scales_reused = scales_reused_;
  result.amax_ahead = amax_ahead_;
  result.unchanged = assembler_.bytes_received() == 0;
  return result;
}

void RefitSession::QueueEventLocked(StoreEventType type, std::string message) {
  StoreEvent event;
  event.type = type;
  event.refit_id = options_.refit_id;
  event.version = store_->version();
  event.fingerprint = store_->fingerprint();
  event.message = std::move(message);
  event.label = options_.label;
  event.time = absl::Now();
  outbox_.events.push_back(std::move(event));
}

RefitSession::Outbox RefitSession::EndCallLocked() {
  RefreshProgressLocked();
  Outbox out = std::move(outbox_);
  outbox_ = Outbox();
  out.slot = slot_;
  if (out.release) slot_.reset();
  return out;
}

void RefitSession::RefreshProgressLocked() {
  SessionProgress p;
  p.refit_id = options_.refit_id;
  p.layers_total = static_cast<int64_t>(layout_.layers().size());
  p.layers_done = layers_done_;
  p.bytes_received = assembler_.bytes_received();
  p.elements_loaded = assembler_.elements_loaded();
  p.elements_expected = assembler_.elements_expected();
  p.staging_bytes = assembler_.staging_bytes() + worker_.held_bytes();
  p.peak_staging_bytes = peak_staging_bytes_;
  p.staged_kernel_bytes = staged_kernel_bytes_;
  {
    absl::MutexLock lock(&mu_);
    p.state = state_;
    progress_ = std::move(p);
  }
}

}  // namespace refit::core
