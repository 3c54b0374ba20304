#include "client/refit_client.h"

#include <grpcpp/grpcpp.h>

#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/safetensors_view.h"
#include "core/xxh3.h"

namespace refit::client {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    std::string message = absl::StrCat("cannot read ", what, " file ", path);
    if (err != 0) absl::StrAppend(&message, ": ", std::strerror(err));
    // An unreadable file is a fix-the-permissions problem, not a wrong path.
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
    return absl::NotFoundError(message);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::chrono::system_clock::time_point Deadline(absl::Duration timeout) {
  return absl::ToChronoTime(absl::Now() + timeout);
}

// One "host", "host:port" or "[v6]:port" of a target.
absl::Status CheckHostPort(absl::string_view target, absl::string_view address) {
  absl::string_view port;
  if (absl::StartsWith(target, "[")) {
    const size_t close = target.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("daemon address \"", address, "\": unclosed '['"));
    }
    if (close + 1 == target.size()) return absl::OkStatus();  // default port
    if (target[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat("daemon address \"", address, "\": expected [ipv6]:port"));
    }
    port = target.substr(close + 2);
  } else {
    const size_t colon = target.find(':');
    // No port (the default), or a bare IPv6 address.
    if (colon == absl::string_view::npos || target.rfind(':') != colon) return absl::OkStatus();
    port = target.substr(colon + 1);
  }
  int value = -1;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(port, &value) || value > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("daemon address \"", address, "\": port \"",
                                                   port, "\" is not a number in 0..65535"));
  }
  return absl::OkStatus();
}

// gRPC takes "host:500510" as port 500510 mod 65536; refuse it instead.
absl::Status ValidateAddress(absl::string_view address) {
  if (absl::string_view path = address; absl::ConsumePrefix(&path, "unix:")) {
    // unix:PATH or unix:///ABSOLUTE (one "/" kept).
    if (absl::StartsWith(path, "//")) path.remove_prefix(2);
    if (path.size() >= sizeof(sockaddr_un::sun_path)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "address \"", address, "\": its socket path is ", path.size(),
          " bytes; a Unix socket path holds at most ", sizeof(sockaddr_un::sun_path) - 1,
          " (connect from its directory with a relative unix: path)"));
    }
    return absl::OkStatus();
  }
  if (absl::StartsWith(address, "unix-abstract:") || absl::StartsWith(address, "vsock:")) {
    return absl::OkStatus();
  }
  absl::string_view rest = address;
  if (absl::ConsumePrefix(&rest, "dns:")) {
    // dns:host:port, dns:///host:port, dns://authority/host:port
    if (absl::ConsumePrefix(&rest, "//")) {
      const size_t slash = rest.find('/');
      rest = slash == absl::string_view::npos ? absl::string_view() : rest.substr(slash + 1);
    }
    return CheckHostPort(rest, address);
  }
  if (absl::ConsumePrefix(&rest, "ipv4:") || absl::ConsumePrefix(&rest, "ipv6:")) {
    for (absl::string_view one : absl::StrSplit(rest, ',')) {
      if (absl::Status s = CheckHostPort(one, address); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  return CheckHostPort(rest, address);
}

size_t SizeOf(const TensorRef& t) { return t.read ? t.size : t.data.size(); }

// A refit id for a push over several streams: "push-" and 16 hex digits.
std::string NewRefitId() {
  static std::atomic<uint64_t> counter{0};
  const uint64_t mixed =
      XXH3_64bits_withSeed(&counter, sizeof(counter),
                           static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())) ^
                               (counter.fetch_add(1) << 48) ^ static_cast<uint64_t>(getpid()));
  return absl::StrCat("push-", absl::Hex(mixed, absl::kZeroPad16));
}

// One Push stream: `begin` (a Begin that opens or joins the refit), the
// tensors in buckets, End. `on_begun`, when set, runs once the daemon has
// accepted the Begin (its initial metadata carries "refit-id"); if the
// daemon refuses it, the stream's error is returned without calling it.
absl::StatusOr<refit::v1::RefitResult> PushOneStream(
    refit::v1::RefitService::Stub* stub,
    const std::function<void(grpc::ClientContext*)>& prepare_context,
    const refit::v1::PushRequest& begin, const std::vector<const TensorRef*>& tensors,
    const PushOptions& options,
    const std::function<void(uint64_t bytes, size_t tensors_done, bool message)>& report,
    const std::function<void()>& on_begun) {
  grpc::ClientContext context;
  prepare_context(&context);
  refit::v1::PushResponse response;
  std::unique_ptr<grpc::ClientWriter<refit::v1::PushRequest>> writer =
      stub->Push(&context, &response);

  // A failed Write means the stream is broken (the daemon refused or went
  // away); Finish then tells why. Nothing is resent: see the file comment.
  auto finish = [&]() -> absl::StatusOr<refit::v1::RefitResult> {
    grpc::Status status = writer->Finish();
    if (!status.ok()) return FromGrpcStatus(status);
    return response.result();
  };

  if (!writer->Write(begin)) return finish();
  if (on_begun) {
    writer->WaitForInitialMetadata();
    if (context.GetServerInitialMetadata().count("refit-id") == 0) {
      // Refused: the daemon ends the stream; Finish says why.
      context.TryCancel();
      absl::StatusOr<refit::v1::RefitResult> refused = finish();
      if (!refused.ok()) return refused.status();
      return absl::InternalError("push: the daemon did not acknowledge the refit's Begin");
    }
    on_begun();
  }

  refit::v1::PushRequest bucket;
  size_t bucket_fill = 0;
  auto flush = [&]() -> bool {
    if (bucket.chunks().chunks_size() == 0) return true;
    if (!writer->Write(bucket)) return false;
    report(bucket_fill, 0, true);
    bucket.Clear();
    bucket_fill = 0;
    return true;
  };

  for (const TensorRef* tp : tensors) {
    const TensorRef& t = *tp;
    const size_t elem = DTypeBytes(t.dtype);
    const size_t nbytes = SizeOf(t);
    // Chunks are element-aligned and hold at least one element.
    const size_t cap = std::max<size_t>(options.max_chunk_bytes / elem, 1) * elem;
    size_t offset = 0;
    // Zero-sized tensors still send one (empty) chunk so the daemon sees them.
    do {
      size_t room = options.bucket_bytes > bucket_fill ? options.bucket_bytes - bucket_fill : 0;
      if (bucket_fill == 0) room = std::max(room, elem);
      size_t piece = std::min({nbytes - offset, cap, room});
      piece -= piece % elem;
      if (piece == 0 && offset < nbytes) {
        // Not even one element fits in this bucket: send it and start anew.
        if (!flush()) return finish();
        continue;
      }
      refit::v1::Chunk* chunk = bucket.mutable_chunks()->add_chunks();
      chunk->set_tensor_name(t.name);
      chunk->set_dtype(t.dtype);
      for (int64_t d : t.shape) chunk->add_shape(d);
      chunk->set_byte_offset(offset);
      absl::Span<const uint8_t> data;
      if (t.read) {
        std::string* bytes = chunk->mutable_data();
        bytes->resize(piece);
        absl::Span<uint8_t> out(reinterpret_cast<uint8_t*>(bytes->data()), piece);
        if (absl::Status read = t.read(offset, out); !read.ok()) {
          // Nothing half-read is sent; the daemon aborts the refit.
          context.TryCancel();
          grpc::Status ignored = writer->Finish();
          (void)ignored;
          return read;
        }
        data = out;
      } else {
        data = t.data.subspan(offset, piece);
        chunk->set_data(data.data(), data.size());
      }
      if (options.checksums) chunk->set_xxh3(ChunkChecksum(data));
      offset += piece;
      bucket_fill += piece;
      if (bucket_fill >= options.bucket_bytes && !flush()) return finish();
    } while (offset < nbytes);
    report(0, 1, false);
  }
  if (!flush()) return finish();

  refit::v1::PushRequest end_request;
  end_request.mutable_end();
  if (!writer->Write(end_request)) return finish();
  writer->WritesDone();
  return finish();
}

}  // namespace

uint64_t ChunkChecksum(absl::Span<const uint8_t> data) {
  return XXH3_64bits(data.data(), data.size());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::unique_ptr<RefitClient>> RefitClient::Create(ClientOptions options) {
  if (options.address.empty()) return absl::InvalidArgumentError("empty daemon address");
  if (absl::Status s = ValidateAddress(options.address); !s.ok()) return s;
  std::shared_ptr<grpc::ChannelCredentials> creds;
  const bool tls = options.tls || !options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
                   !options.tls_key_file.empty();
  if (tls) {
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca_file.empty()) {
      absl::StatusOr<std::string> ca = ReadFile(options.tls_ca_file, "TLS CA");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *std::move(ca);
    }
    if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("a client certificate needs both --tls-cert and --tls-key");
    }
    if (!options.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadFile(options.tls_cert_file, "TLS certificate");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadFile(options.tls_key_file, "TLS key");
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *std::move(cert);
      ssl.pem_private_key = *std::move(key);
    }
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (!options.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name);
  }
  // Fail fast on a dead daemon, and find a restarted one quickly.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(options.address, creds, args);
  return std::unique_ptr<RefitClient>(new RefitClient(std::move(channel), std::move(options)));
}

RefitClient::RefitClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(refit::v1::RefitService::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

void RefitClient::PrepareContext(grpc::ClientContext* context, bool with_token, bool read_only,
                                 absl::Time deadline) const {
  if (read_only && options_.wait_for_ready) context->set_wait_for_ready(true);
  if (with_token && !options_.token.empty()) {
    context->AddMetadata("authorization", absl::StrCat("Bearer ", options_.token));
  }
  if (deadline != absl::InfiniteFuture()) {
    context->set_deadline(absl::ToChronoTime(deadline));
  } else if (options_.timeout != absl::InfiniteDuration()) {
    context->set_deadline(Deadline(options_.timeout));
  }
}

absl::Time RefitClient::CallDeadline() const {
  return options_.timeout == absl::InfiniteDuration() ? absl::InfiniteFuture()
                                                      : absl::Now() + options_.timeout;
}

absl::Status RefitClient::UnaryReadOnly(
    bool with_token, const std::function<grpc::Status(grpc::ClientContext*)>& rpc) const {
  return RetryReadOnly(
      [&](absl::Time deadline) {
        grpc::ClientContext context;
        PrepareContext(&context, with_token, /*read_only=*/true, deadline);
        return FromGrpcStatus(rpc(&context));
      },
      CallDeadline());
}

absl::Status RefitClient::RetryReadOnly(const std::function<absl::Status(absl::Time)>& call,
                                        absl::Time deadline) const {
  absl::Duration backoff = options_.retry.initial_backoff;
  const int attempts = std::max(1, options_.retry.max_attempts);
  absl::Status status;
  for (int attempt = 1; attempt <= attempts; ++attempt) {
    status = call(deadline);
    if (status.code() != absl::StatusCode::kUnavailable || attempt == attempts) break;
    // No attempt could start before the deadline: the last error stands.
    if (absl::Now() + backoff >= deadline) break;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.retry.max_backoff);
  }
  return status;
}

absl::StatusOr<refit::v1::RefitResult> RefitClient::Push(absl::Span<const TensorRef> tensors,
                                                         const PushOptions& options) {
  if (tensors.empty()) return absl::InvalidArgumentError("push: no tensors");
  if (options.bucket_bytes == 0 || options.max_chunk_bytes == 0) {
    return absl::InvalidArgumentError("push: bucket and chunk sizes must be positive");
  }
  PushProgress progress;
  progress.tensors_total = tensors.size();
  for (const TensorRef& t : tensors) {
    const size_t elem = DTypeBytes(t.dtype);
    if (elem == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("push: tensor '", t.name, "' has an unspecified dtype"));
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("push: tensor '", t.name, "' has a negative dimension"));
      }
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * elem != SizeOf(t)) {
      return absl::InvalidArgumentError(absl::StrCat("push: tensor '", t.name, "' has ", SizeOf(t),
                                                     " bytes, its shape needs ", numel * elem));
    }
    progress.bytes_total += SizeOf(t);
  }

  if (options.streams < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("push: streams must be at least 1, got ", options.streams));
  }
  // More streams than tensors would leave some with nothing to send.
  const int streams = static_cast<int>(std::min<size_t>(options.streams, tensors.size()));

  refit::v1::PushRequest begin_request;
  refit::v1::Begin* begin = begin_request.mutable_begin();
  begin->set_model_group(options.model_group);
  refit::v1::RefitOptions* refit_options = begin->mutable_options();
  refit_options->set_completion(options.completion);
  if (options.base_version.has_value()) refit_options->set_base_version(*options.base_version);
  refit_options->set_non_finite(options.non_finite);
  refit_options->set_allow_partial_layers(options.allow_partial_layers);
  refit_options->set_require_complete(options.require_complete);
  refit_options->set_label(options.label);
  refit_options->set_fleet_refit_id(options.fleet_refit_id);
  std::string refit_id = options.refit_id;
  if (streams > 1 && refit_id.empty()) refit_id = NewRefitId();
  begin->set_refit_id(refit_id);
  if (streams > 1) begin->set_streams(static_cast<uint32_t>(streams));

  absl::Mutex progress_mu;
  const absl::Time start = absl::Now();
  auto report = [&](uint64_t bytes, size_t tensors_done, bool message) {
    absl::MutexLock lock(&progress_mu);
    progress.bytes_sent += bytes;
    progress.tensors_done += tensors_done;
    if (message) ++progress.messages_sent;
    progress.elapsed = absl::Now() - start;
    if (message && options.on_progress) options.on_progress(progress);
  };

  if (streams == 1) {
    std::vector<const TensorRef*> all;
    all.reserve(tensors.size());
    for (const TensorRef& t : tensors) all.push_back(&t);
    return PushOneStream(
        stub_.get(), [this](grpc::ClientContext* c) { PrepareContext(c, true); }, begin_request,
        all, options, report, nullptr);
  }

  // By tensor, balanced by bytes: each tensor goes to the stream with the
  // fewest bytes so far, so every stream sends in checkpoint order and the
  // streams move through the layers together (the daemon stages few
  // partial layers at a time).
  std::vector<std::vector<const TensorRef*>> parts(streams);
  std::vector<uint64_t> part_bytes(streams, 0);
  for (const TensorRef& t : tensors) {
    const int k = static_cast<int>(std::min_element(part_bytes.begin(), part_bytes.end()) -
                                   part_bytes.begin());
    parts[k].push_back(&t);
    part_bytes[k] += SizeOf(t);
  }
  refit::v1::PushRequest join_request;
  join_request.mutable_begin()->set_join_refit_id(refit_id);

  std::vector<absl::StatusOr<refit::v1::RefitResult>> results(
      streams, absl::UnknownError("push: stream not run"));
  auto prepare = [this](grpc::ClientContext* c) { PrepareContext(c, true); };
  // The opener runs here; the others start once the daemon has accepted its
  // Begin (its initial metadata names the refit), so that they find the
  // refit to join.
  std::vector<std::thread> joiners;
  auto start_joiners = [&] {
    for (int k = 1; k < streams; ++k) {
      joiners.emplace_back([&, k] {
        results[k] =
            PushOneStream(stub_.get(), prepare, join_request, parts[k], options, report, nullptr);
      });
    }
  };
  results[0] =
      PushOneStream(stub_.get(), prepare, begin_request, parts[0], options, report, start_joiners);
  for (std::thread& t : joiners) t.join();
  // The cause, rather than the ABORTED of the streams it took down.
  for (const absl::StatusOr<refit::v1::RefitResult>& r : results) {
    if (!r.ok() && r.status().code() != absl::StatusCode::kAborted) return r.status();
  }
  for (const absl::StatusOr<refit::v1::RefitResult>& r : results) {
    if (!r.ok()) return r.status();
  }
  return results[0];
}

absl::StatusOr<refit::v1::RefitResult> RefitClient::PushFiles(const std::vector<std::string>& files,
                                                              const PushOptions& options) {
  std::vector<std::unique_ptr<SafetensorsView>> views;
  std::vector<TensorRef> tensors;
  for (const std::string& file : files) {
    absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(file);
    if (!view.ok()) return view.status();
    const SafetensorsView* v = view->get();
    for (const SafetensorsTensor& t : v->tensors()) {
      TensorRef ref{t.name, t.dtype, t.shape, {}};
      ref.size = t.nbytes;
      ref.read = [v, &t](uint64_t offset, absl::Span<uint8_t> out) {
        return v->Read(t, offset, out);
      };
      tensors.push_back(std::move(ref));
    }
    views.push_back(*std::move(view));
  }
  return Push(tensors, options);
}

absl::StatusOr<refit::v1::RefitResult> RefitClient::Reload(
    const refit::v1::ReloadRequest& request,
    const std::function<void(const refit::v1::Progress&)>& on_progress) {
  grpc::ClientContext context;
  PrepareContext(&context, /*with_token=*/true);
  std::unique_ptr<grpc::ClientReader<refit::v1::ReloadProgress>> reader =
      stub_->Reload(&context, request);
  refit::v1::ReloadProgress message;
  std::optional<refit::v1::RefitResult> result;
  while (reader->Read(&message)) {
    if (message.has_progress()) {
      if (on_progress) on_progress(message.progress());
    } else if (message.has_result()) {
      result = message.result();
    }
  }
  grpc::Status status = reader->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!result.has_value()) {
    return absl::DataLossError("reload: the stream ended without a result");
  }
  return *result;
}

absl::StatusOr<refit::v1::RefitResult> RefitClient::Commit(const std::string& model_group,
                                                           const std::string& refit_id) {
  grpc::ClientContext context;
  PrepareContext(&context, /*with_token=*/true);
  refit::v1::CommitRequest request;
  request.set_model_group(model_group);
  request.set_refit_id(refit_id);
  refit::v1::CommitResponse response;
  grpc::Status status = stub_->Commit(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response.result();
}

absl::StatusOr<refit::v1::CommitResponse> RefitClient::CommitLinked(
    const std::string& model_group, const std::string& refit_id,
    const std::vector<RefitRef>& linked) {
  grpc::ClientContext context;
  PrepareContext(&context, /*with_token=*/true);
  refit::v1::CommitRequest request;
  request.set_model_group(model_group);
  request.set_refit_id(refit_id);
  for (const RefitRef& ref : linked) {
    refit::v1::RefitRef* out = request.add_linked();
    out->set_model_group(ref.model_group);
    out->set_refit_id(ref.refit_id);
  }
  refit::v1::CommitResponse response;
  grpc::Status status = stub_->Commit(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<refit::v1::AbortResponse> RefitClient::Abort(const std::string& model_group,
                                                            const std::string& refit_id,
                                                            const std::string& reason) {
  grpc::ClientContext context;
  PrepareContext(&context, /*with_token=*/true);
  refit::v1::AbortRequest request;
  request.set_model_group(model_group);
  request.set_refit_id(refit_id);
  request.set_reason(reason);
  refit::v1::AbortResponse response;
  grpc::Status status = stub_->Abort(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<refit::v1::GetStatusResponse> RefitClient::GetStatus(
    const std::string& model_group) {
  return GetStatusOf(model_group, /*all_groups=*/false);
}

absl::StatusOr<refit::v1::GetStatusResponse> RefitClient::GetStatusAllGroups(
    const std::string& model_group) {
  return GetStatusOf(model_group, /*all_groups=*/true);
}

absl::StatusOr<refit::v1::GetStatusResponse> RefitClient::GetStatusOf(
    const std::string& model_group, bool all_groups) {
  refit::v1::GetStatusRequest request;
  request.set_model_group(model_group);
  request.set_all_groups(all_groups);
  refit::v1::GetStatusResponse response;
  absl::Status status = UnaryReadOnly(/*with_token=*/true, [&](grpc::ClientContext* context) {
    response.Clear();
    return stub_->GetStatus(context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<refit::v1::ListTensorsResponse> RefitClient::ListTensors(
    const std::string& model_group, refit::v1::ListTensorsRequest::Layout layout) {
  refit::v1::ListTensorsRequest request;
  request.set_model_group(model_group);
  request.set_layout(layout);
  refit::v1::ListTensorsResponse response;
  absl::Status status = UnaryReadOnly(/*with_token=*/true, [&](grpc::ClientContext* context) {
    response.Clear();
    return stub_->ListTensors(context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<ReadTensorResult> RefitClient::ReadTensor(const std::string& model_group,
                                                         const std::string& name,
                                                         uint32_t max_chunk_bytes,
                                                         std::optional<uint64_t> version,
                                                         std::optional<std::string> fingerprint) {
  refit::v1::ReadTensorRequest request;
  request.set_model_group(model_group);
  request.set_name(name);
  request.set_max_chunk_bytes(max_chunk_bytes);
  if (version.has_value()) request.set_version(*version);
  if (fingerprint.has_value()) request.set_fingerprint(*fingerprint);
  const bool pinned = version.has_value() || fingerprint.has_value();
  ReadTensorResult result;
  auto read_once = [&](absl::Time deadline) -> absl::Status {
    grpc::ClientContext context;
    PrepareContext(&context, /*with_token=*/true, /*read_only=*/true, deadline);
    result = ReadTensorResult();
    std::unique_ptr<grpc::ClientReader<refit::v1::ReadTensorResponse>> reader =
        stub_->ReadTensor(&context, request);
    refit::v1::ReadTensorResponse message;
    bool first = true;
    absl::Status consistency;
    while (reader->Read(&message)) {
      if (!consistency.ok()) continue;  // drain, then report
      if (first) {
        result.info = message.info();
        result.version = message.version();
        result.fingerprint = message.fingerprint();
        result.data.reserve(result.info.nbytes());
        first = false;
      } else if (message.version() != result.version) {
        consistency = absl::DataLossError(absl::StrCat("read ", name, ": stream mixes versions ",
                                                       result.version, " and ", message.version()));
        continue;
      }
      if (message.byte_offset() != result.data.size()) {
        consistency = absl::DataLossError(absl::StrCat("read ", name, ": piece at offset ",
                                                       message.byte_offset(), ", expected ",
                                                       result.data.size()));
        continue;
      }
      result.data.append(message.data());
    }
    absl::Status rpc = FromGrpcStatus(reader->Finish());
    if (!rpc.ok()) return rpc;
    if (!consistency.ok()) return consistency;
    if (first) return absl::DataLossError(absl::StrCat("read ", name, ": empty stream"));
    if (result.data.size() != result.info.nbytes()) {
      return absl::DataLossError(absl::StrCat("read ", name, ": got ", result.data.size(),
                                              " bytes, expected ", result.info.nbytes()));
    }
    // The daemon checks the pin; this catches one that does not know it
    // (it would serve whatever is live).
    if (fingerprint.has_value() && result.fingerprint != *fingerprint) {
      if (result.fingerprint.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "read ", name, ": the daemon does not answer fingerprint pins (an older refitd)"));
      }
      return absl::AbortedError(absl::StrCat("read ", name, ": pinned to fingerprint ",
                                             *fingerprint, " but version ", result.version,
                                             " has fingerprint ", result.fingerprint));
    }
    return absl::OkStatus();
  };
  // One deadline for every attempt: options().timeout bounds the whole read.
  const absl::Time deadline = CallDeadline();
  absl::Status status = RetryReadOnly(read_once, deadline);
  // Unpinned, any one version will do: a commit that landed mid-read only
  // means reading it again.
  for (int attempt = 1; !pinned && attempt < kUnpinnedReadAttempts && absl::IsAborted(status);
       ++attempt) {
    status = RetryReadOnly(read_once, deadline);
  }
  if (!status.ok()) return status;
  return result;
}

absl::Status RefitClient::Watch(const std::string& model_group,
                                const std::function<bool(const refit::v1::WatchEvent&)>& on_event,
                                absl::Time deadline) {
  grpc::ClientContext context;
  PrepareContext(&context, /*with_token=*/true, /*read_only=*/true);
  // A watch runs until stopped or `deadline`; the call timeout does not apply.
  context.set_deadline(deadline == absl::InfiniteFuture()
                           ? std::chrono::system_clock::time_point::max()
                           : absl::ToChronoTime(deadline));
  refit::v1::WatchRequest request;
  request.set_model_group(model_group);
  std::unique_ptr<grpc::ClientReader<refit::v1::WatchEvent>> reader =
      stub_->Watch(&context, request);
  refit::v1::WatchEvent event;
  bool got_event = false;
  while (reader->Read(&event)) {
    got_event = true;
    if (!on_event(event)) {
      context.TryCancel();
      reader->Finish();
      return absl::OkStatus();
    }
  }
  absl::Status status = FromGrpcStatus(reader->Finish());
  // A bounded watch that ends at its deadline is a watch that saw nothing
  // more, if it ever reached the daemon: one that never connected (a
  // read-only call waits for the daemon until its deadline) is unreachable.
  if (absl::IsDeadlineExceeded(status) && !got_event &&
      channel_->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY) {
    return absl::UnavailableError(
        absl::StrCat("no refitd answered at ", options_.address, " before the watch's deadline"));
  }
  return status;
}

absl::StatusOr<HealthCheckResponse::ServingStatus> RefitClient::HealthCheck(
    const std::string& service) {
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  absl::Status status = UnaryReadOnly(/*with_token=*/false, [&](grpc::ClientContext* context) {
    response.Clear();
    return health_stub_->Check(context, request, &response);
  });
  if (!status.ok()) return status;
  return response.status();
}

absl::Status RefitClient::WaitUntilServing(absl::Time deadline, const std::string& readiness) {
  std::string last = "unreachable";
  for (;;) {
    HealthCheckRequest request;
    request.set_service(readiness);
    bool ready = false;
    grpc::Status status;
    {
      grpc::ClientContext context;
      context.set_wait_for_ready(true);
      context.set_deadline(absl::ToChronoTime(deadline));
      std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader =
          health_stub_->Watch(&context, request);
      HealthCheckResponse response;
      while (reader->Read(&response)) {
        last = HealthCheckResponse::ServingStatus_Name(response.status());
        if (response.status() == HealthCheckResponse::SERVING) {
          ready = true;
          context.TryCancel();
          break;
        }
      }
      status = reader->Finish();
    }
    if (ready) {
      grpc::ClientContext context;
      context.set_wait_for_ready(true);
      context.set_deadline(absl::ToChronoTime(deadline));
      request.set_service("");
      HealthCheckResponse response;
      status = health_stub_->Check(&context, request, &response);
      if (status.ok() && response.status() == HealthCheckResponse::SERVING) {
        return absl::OkStatus();
      }
      if (status.ok()) last = "live " + HealthCheckResponse::ServingStatus_Name(response.status());
    }
    const grpc::StatusCode code = status.error_code();
    if (code == grpc::StatusCode::NOT_FOUND || code == grpc::StatusCode::UNIMPLEMENTED) {
      return FromGrpcStatus(status);
    }
    // The stream ended without SERVING: the daemon went away (it is
    // restarting, or shutting down) or the deadline passed. Look again a
    // little later, until the deadline.
    const absl::Time now = absl::Now();
    if (code == grpc::StatusCode::DEADLINE_EXCEEDED || now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          options_.address, " was not SERVING by the deadline (last seen: ", last, ")"));
    }
    absl::SleepFor(std::min(absl::Milliseconds(100), deadline - now));
  }
}

absl::Status RefitClient::HealthWatch(
    const std::string& service,
    const std::function<bool(HealthCheckResponse::ServingStatus)>& on_status) {
  grpc::ClientContext context;
  PrepareContext(&context, /*with_token=*/false);
  context.set_deadline(std::chrono::system_clock::time_point::max());
  HealthCheckRequest request;
  request.set_service(service);
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader =
      health_stub_->Watch(&context, request);
  HealthCheckResponse response;
  while (reader->Read(&response)) {
    if (!on_status(response.status())) {
      context.TryCancel();
      reader->Finish();
      return absl::OkStatus();
    }
  }
  return FromGrpcStatus(reader->Finish());
}

}  // namespace refit::client
