// A hand-written fake of refit.v1.RefitService for the client library's
// tests: it records what clients send and answers from scripted values, and
// can inject errors. Runs in-process on 127.0.0.1 port 0, with gRPC's built-in
// health service switched on.
//
// Thread-safety: handlers run on gRPC threads; every recorded field is
// guarded by mu_ and read by tests through the accessor copies.
#ifndef REFIT_TESTS_CLIENT_FAKE_REFIT_SERVICE_H_
#define REFIT_TESTS_CLIENT_FAKE_REFIT_SERVICE_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "refit/v1/refit.grpc.pb.h"

namespace refit::client::testing {

class FakeRefitService final : public refit::v1::RefitService::Service {
 public:
  // Everything one Push stream carried.
  struct PushRecord {
    std::vector<refit::v1::PushRequest> messages;
    std::string authorization;
  };

  grpc::Status Push(grpc::ServerContext* context,
                    grpc::ServerReader<refit::v1::PushRequest>* reader,
                    refit::v1::PushResponse* response) override {
    PushRecord record;
    record.authorization = Authorization(context);
    refit::v1::PushRequest message;
    bool acknowledged = false;
    while (reader->Read(&message)) {
      if (!acknowledged && message.has_begin()) {
        // As refitd: initial metadata "refit-id" once Begin is accepted.
        const refit::v1::Begin& begin = message.begin();
        context->AddInitialMetadata(
            "refit-id", begin.join_refit_id().empty() ? begin.refit_id() : begin.join_refit_id());
        reader->SendInitialMetadata();
        acknowledged = true;
      }
      record.messages.push_back(message);
    }
    absl::MutexLock lock(&mu_);
    pushes_.push_back(std::move(record));
    if (!push_status_.ok()) return push_status_;
    *response->mutable_result() = push_result_;
    return grpc::Status::OK;
  }

  grpc::Status Reload(grpc::ServerContext* context, const refit::v1::ReloadRequest* request,
                      grpc::ServerWriter<refit::v1::ReloadProgress>* writer) override {
    if (std::optional<grpc::Status> failure = Failure("Reload")) return *failure;
    {
      absl::MutexLock lock(&mu_);
      last_reload_ = *request;
    }
    refit::v1::ReloadProgress progress;
    for (uint32_t i = 1; i <= 3; ++i) {
      progress.mutable_progress()->set_layers_done(i);
      progress.mutable_progress()->set_layers_total(3);
      writer->Write(progress);
    }
    if (reload_without_result()) return grpc::Status::OK;
    refit::v1::ReloadProgress last;
    *last.mutable_result() = push_result_;
    last.mutable_result()->set_refit_id(absl::StrCat("reload-of-", request->path()));
    writer->Write(last);
    return grpc::Status::OK;
  }

  grpc::Status Commit(grpc::ServerContext* context, const refit::v1::CommitRequest* request,
                      refit::v1::CommitResponse* response) override {
    if (std::optional<grpc::Status> failure = Failure("Commit")) return *failure;
    if (hang_commit()) {
      // The sync API has no cancellation callback to wait on, and the client
      // sees its own deadline whatever the handler does: hold the call until
      // the server stops (Stop).
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&stopping_));
      return grpc::Status(grpc::StatusCode::CANCELLED, "Commit: the server is stopping");
    }
    *response->mutable_result() = push_result_;
    response->mutable_result()->set_refit_id(request->refit_id());
    response->mutable_result()->set_state(refit::v1::REFIT_STATE_COMMITTED);
    return grpc::Status::OK;
  }

  grpc::Status Abort(grpc::ServerContext* context, const refit::v1::AbortRequest* request,
                     refit::v1::AbortResponse* response) override {
    if (std::optional<grpc::Status> failure = Failure("Abort")) return *failure;
    if (request->refit_id() == "unknown") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no refit 'unknown'");
    }
    response->set_refit_id(request->refit_id());
    response->set_version(7);
    return grpc::Status::OK;
  }

  grpc::Status GetStatus(grpc::ServerContext* context, const refit::v1::GetStatusRequest* request,
                         refit::v1::GetStatusResponse* response) override {
    Delay();
    absl::MutexLock lock(&mu_);
    ++status_calls_;
    last_authorization_ = Authorization(context);
    if (!status_failures_.empty()) {
      grpc::Status failure = status_failures_.front();
      status_failures_.pop_front();
      return failure;
    }
    response->set_model_group(request->model_group());
    response->set_version(7);
    response->set_fingerprint("00112233aabbccdd");
    response->set_ready(true);
    for (const refit::v1::AttachedEngine& engine : engines_) *response->add_engines() = engine;
    return grpc::Status::OK;
  }

  grpc::Status ListTensors(grpc::ServerContext* context,
                           const refit::v1::ListTensorsRequest* request,
                           refit::v1::ListTensorsResponse* response) override {
    if (std::optional<grpc::Status> failure = Failure("ListTensors")) return *failure;
    response->set_version(7);
    refit::v1::TensorInfo* info = response->add_tensors();
    info->set_name(request->layout() == refit::v1::ListTensorsRequest::LAYOUT_KERNEL
                       ? "model.norm.weight"
                       : "model.norm.weight(ckpt)");
    return grpc::Status::OK;
  }

  grpc::Status ReadTensor(grpc::ServerContext* context, const refit::v1::ReadTensorRequest* request,
                          grpc::ServerWriter<refit::v1::ReadTensorResponse>* writer) override {
    Delay();
    absl::MutexLock lock(&mu_);
    if (request->name() != tensor_name_) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor " + request->name());
    }
    ++read_calls_;
    if (interrupted_reads_ > 0) {
      --interrupted_reads_;
      return grpc::Status(grpc::StatusCode::ABORTED,
                          "version 8 was committed while version 7 was being read");
    }
    if (read_fault_ == ReadFault::kEmptyStream) return grpc::Status::OK;
    const size_t piece = 5;
    for (size_t off = 0; off < tensor_bytes_.size(); off += piece) {
      if (read_fault_ == ReadFault::kGap && off == piece) continue;
      refit::v1::ReadTensorResponse r;
      if (off == 0) {
        r.mutable_info()->set_name(tensor_name_);
        r.mutable_info()->set_nbytes(tensor_bytes_.size() +
                                     (read_fault_ == ReadFault::kShort ? 1 : 0));
        r.mutable_info()->set_dtype(refit::v1::DTYPE_U8);
      }
      r.set_version(off > 0 && read_fault_ == ReadFault::kMixVersions ? 8 : 7);
      r.set_byte_offset(off);
      r.set_data(tensor_bytes_.substr(off, piece));
      writer->Write(r);
    }
    return grpc::Status::OK;
  }

  grpc::Status Watch(grpc::ServerContext* context, const refit::v1::WatchRequest* request,
                     grpc::ServerWriter<refit::v1::WatchEvent>* writer) override {
    if (std::optional<grpc::Status> failure = Failure("Watch")) return *failure;
    refit::v1::WatchEvent event;
    event.set_type(refit::v1::WatchEvent::TYPE_SNAPSHOT);
    event.set_version(7);
    if (!writer->Write(event)) return grpc::Status::OK;
    // Then versions 8, 9 and 10 committed. The stream stays open, like the
    // daemon's, until the server stops (Stop); a client that cancels has its
    // call ended by gRPC at once.
    for (uint64_t v = 8; v <= 10; ++v) {
      event.set_type(refit::v1::WatchEvent::TYPE_COMMITTED);
      event.set_version(v);
      if (!writer->Write(event)) return grpc::Status::OK;
    }
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&stopping_));
    return grpc::Status::OK;
  }

  // Ends the calls that are held until the server stops (Watch, a hanging
  // Commit). Called before grpc::Server::Shutdown, which waits for every
  // handler to return.
  void Stop() {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }

  // How ReadTensor breaks its stream: versions 7 then 8, a missing second
  // piece, one byte fewer than info.nbytes, or no message at all.
  enum class ReadFault { kNone, kMixVersions, kGap, kShort, kEmptyStream };

  // Scripting.
  // Makes every call of `rpc` ("Reload", "Commit", "Abort", "ListTensors",
  // "Watch") fail with `status`.
  void Fail(const std::string& rpc, grpc::Status status) {
    absl::MutexLock lock(&mu_);
    failures_[rpc] = std::move(status);
  }
  // Commit answers only when the client gives up (deadline, cancel).
  void HangCommit() {
    absl::MutexLock lock(&mu_);
    hang_commit_ = true;
  }
  // Reload streams its progress and ends OK without a result.
  void SetReloadWithoutResult() {
    absl::MutexLock lock(&mu_);
    reload_without_result_ = true;
  }
  void SetReadFault(ReadFault fault) {
    absl::MutexLock lock(&mu_);
    read_fault_ = fault;
  }
  // GetStatus lists `engines` as attached.
  void SetEngines(std::vector<refit::v1::AttachedEngine> engines) {
    absl::MutexLock lock(&mu_);
    engines_ = std::move(engines);
  }
  // GetStatus and ReadTensor answer `delay` late.
  void SetDelay(absl::Duration delay) {
    absl::MutexLock lock(&mu_);
    delay_ = delay;
  }
  // The next `n` ReadTensor calls end ABORTED, as a commit landing mid-read.
  void InterruptReads(int n) {
    absl::MutexLock lock(&mu_);
    interrupted_reads_ = n;
  }
  refit::v1::ReloadRequest last_reload() const {
    absl::MutexLock lock(&mu_);
    return last_reload_;
  }
  int read_calls() const {
    absl::MutexLock lock(&mu_);
    return read_calls_;
  }
  void SetPushStatus(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    push_status_ = std::move(status);
  }
  void SetPushResult(refit::v1::RefitResult result) { push_result_ = std::move(result); }
  void FailGetStatus(std::vector<grpc::Status> failures) {
    absl::MutexLock lock(&mu_);
    status_failures_.assign(failures.begin(), failures.end());
  }
  void SetTensor(std::string name, std::string bytes, bool mix_versions = false) {
    absl::MutexLock lock(&mu_);
    tensor_name_ = std::move(name);
    tensor_bytes_ = std::move(bytes);
    read_fault_ = mix_versions ? ReadFault::kMixVersions : ReadFault::kNone;
  }

  // Observations.
  std::vector<PushRecord> pushes() const {
    absl::MutexLock lock(&mu_);
    return pushes_;
  }
  int status_calls() const {
    absl::MutexLock lock(&mu_);
    return status_calls_;
  }
  std::string last_authorization() const {
    absl::MutexLock lock(&mu_);
    return last_authorization_;
  }

 private:
  void Delay() const {
    absl::Duration delay;
    {
      absl::MutexLock lock(&mu_);
      delay = delay_;
    }
    absl::SleepFor(delay);
  }

  std::optional<grpc::Status> Failure(const std::string& rpc) const {
    absl::MutexLock lock(&mu_);
    auto it = failures_.find(rpc);
    if (it == failures_.end()) return std::nullopt;
    return it->second;
  }
  bool hang_commit() const {
    absl::MutexLock lock(&mu_);
    return hang_commit_;
  }
  bool reload_without_result() const {
    absl::MutexLock lock(&mu_);
    return reload_without_result_;
  }

  static std::string Authorization(grpc::ServerContext* context) {
    auto it = context->client_metadata().find("authorization");
    if (it == context->client_metadata().end()) return "";
    return std::string(it->second.data(), it->second.size());
  }

  mutable absl::Mutex mu_;
  std::vector<PushRecord> pushes_ ABSL_GUARDED_BY(mu_);
  grpc::Status push_status_ ABSL_GUARDED_BY(mu_);
  refit::v1::RefitResult push_result_;  // set before the server starts
  std::deque<grpc::Status> status_failures_ ABSL_GUARDED_BY(mu_);
  int status_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_authorization_ ABSL_GUARDED_BY(mu_);
  std::string tensor_name_ ABSL_GUARDED_BY(mu_);
  std::string tensor_bytes_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  ReadFault read_fault_ ABSL_GUARDED_BY(mu_) = ReadFault::kNone;
  int interrupted_reads_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration delay_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  std::vector<refit::v1::AttachedEngine> engines_ ABSL_GUARDED_BY(mu_);
  refit::v1::ReloadRequest last_reload_ ABSL_GUARDED_BY(mu_);
  int read_calls_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, grpc::Status> failures_ ABSL_GUARDED_BY(mu_);
  bool reload_without_result_ ABSL_GUARDED_BY(mu_) = false;
  bool hang_commit_ ABSL_GUARDED_BY(mu_) = false;
};

// The fake on 127.0.0.1:<port 0>, with the standard health service.
class FakeServer {
 public:
  FakeServer() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~FakeServer() {
    service_.Stop();
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }

  FakeRefitService& service() { return service_; }
  grpc::Server& server() { return *server_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  FakeRefitService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace refit::client::testing

#endif  // REFIT_TESTS_CLIENT_FAKE_REFIT_SERVICE_H_
