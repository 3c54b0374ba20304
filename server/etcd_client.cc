#include "server/etcd_client.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace refit::server {
namespace {

absl::Status FromGrpc(const grpc::Status& status, absl::string_view endpoint,
                      absl::string_view method) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("etcd ", endpoint, " ", method, ": ", status.error_message()));
}

EtcdKeyValue FromProto(const etcdserverpb::KeyValue& kv) {
  EtcdKeyValue out;
  out.key = kv.key();
  out.value = kv.value();
  out.create_revision = kv.create_revision();
  out.mod_revision = kv.mod_revision();
  out.lease = kv.lease();
  return out;
}

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    std::string message = absl::StrCat(flag, ": cannot read ", path);
    if (err != 0) absl::StrAppend(&message, ": ", std::strerror(err));
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
    return absl::NotFoundError(message);
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

}  // namespace

std::string EtcdPrefixEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    unsigned char last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdClientOptions options) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "an etcd client certificate needs both the certificate and its key (--etcd-cert, "
        "--etcd-key)");
  }
  const bool tls_files = !options.tls_ca_file.empty() || !options.tls_cert_file.empty();
  std::shared_ptr<grpc::ChannelCredentials> tls;
  auto tls_credentials = [&]() -> absl::Status {
    if (tls != nullptr) return absl::OkStatus();
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca_file.empty()) {
      absl::StatusOr<std::string> ca = ReadPem(options.tls_ca_file, "etcd CA");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *std::move(ca);
    }
    if (!options.tls_cert_file.empty()) {
      absl::StatusOr<std::string> cert = ReadPem(options.tls_cert_file, "etcd client certificate");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadPem(options.tls_key_file, "etcd client key");
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *std::move(cert);
      ssl.pem_private_key = *std::move(key);
    }
    tls = grpc::SslCredentials(ssl);
    return absl::OkStatus();
  };
  std::vector<std::string> endpoints;
  std::vector<std::shared_ptr<grpc::ChannelCredentials>> credentials;
  for (const std::string& entry : options.endpoints) {
    for (absl::string_view part : absl::StrSplit(entry, ',', absl::SkipWhitespace())) {
      absl::string_view endpoint = absl::StripAsciiWhitespace(part);
      const bool https = absl::ConsumePrefix(&endpoint, "https://");
      const bool http = !https && absl::ConsumePrefix(&endpoint, "http://");
      absl::ConsumeSuffix(&endpoint, "/");
      if (endpoint.empty() || !absl::StrContains(endpoint, ':')) {
        return absl::InvalidArgumentError(
            absl::StrCat("etcd endpoint \"", part, "\" is not host:port"));
      }
      if (https || (!http && tls_files)) {
        if (absl::Status s = tls_credentials(); !s.ok()) return s;
        credentials.push_back(tls);
      } else {
        credentials.push_back(grpc::InsecureChannelCredentials());
      }
      endpoints.emplace_back(endpoint);
    }
  }
  if (endpoints.empty()) return absl::InvalidArgumentError("no etcd endpoint given");
  return std::unique_ptr<EtcdClient>(
      new EtcdClient(std::move(options), std::move(endpoints), credentials));
}

EtcdClient::EtcdClient(EtcdClientOptions options, std::vector<std::string> endpoints,
                       const std::vector<std::shared_ptr<grpc::ChannelCredentials>>& credentials)
    : options_(std::move(options)), endpoints_(std::move(endpoints)) {
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    const std::string& endpoint = endpoints_[i];
    auto stubs = std::make_unique<Stubs>();
    stubs->endpoint = endpoint;
    grpc::ChannelArguments args;
    // A restarted etcd is found again quickly, not after gRPC's default
    // reconnect backoff (up to 2 minutes).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // A failed connection re-resolves the name; gRPC's default spaces
    // resolutions 30 s apart, which held every call that long.
    args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 100);
    stubs->channel = grpc::CreateCustomChannel(endpoint, credentials[i], args);
    stubs->kv = etcdserverpb::KV::NewStub(stubs->channel);
    stubs->lease = etcdserverpb::Lease::NewStub(stubs->channel);
    stubs->watch = etcdserverpb::Watch::NewStub(stubs->channel);
    stubs_.push_back(std::move(stubs));
  }
}

EtcdClient::~EtcdClient() = default;

void EtcdClient::SetDeadline(grpc::ClientContext* context) const {
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(options_.timeout));
}

absl::Status EtcdClient::Call(
    absl::string_view method,
    const std::function<grpc::Status(Stubs&, grpc::ClientContext*)>& call) {
  size_t start;
  {
    absl::MutexLock lock(&mu_);
    start = current_;
  }
  std::vector<std::string> failures;
  for (size_t i = 0; i < stubs_.size(); ++i) {
    const size_t index = (start + i) % stubs_.size();
    grpc::ClientContext context;
    SetDeadline(&context);
    grpc::Status status = call(*stubs_[index], &context);
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      current_ = index;
      return absl::OkStatus();
    }
    absl::Status failed = FromGrpc(status, stubs_[index]->endpoint, method);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE) return failed;
    failures.push_back(std::string(failed.message()));
  }
  // Every endpoint is unreachable: each one's reason.
  return absl::UnavailableError(absl::StrJoin(failures, "; "));
}

absl::StatusOr<std::optional<EtcdKeyValue>> EtcdClient::Get(absl::string_view key) {
  etcdserverpb::RangeRequest request;
  request.set_key(std::string(key));
  etcdserverpb::RangeResponse response;
  absl::Status s = Call("Range", [&](Stubs& stubs, grpc::ClientContext* context) {
    return stubs.kv->Range(context, request, &response);
  });
  if (!s.ok()) return s;
  if (response.kvs_size() == 0) return std::optional<EtcdKeyValue>();
  return std::optional<EtcdKeyValue>(FromProto(response.kvs(0)));
}

absl::StatusOr<std::vector<EtcdKeyValue>> EtcdClient::GetPrefix(absl::string_view prefix) {
  etcdserverpb::RangeRequest request;
  request.set_key(std::string(prefix));
  request.set_range_end(EtcdPrefixEnd(prefix));
  etcdserverpb::RangeResponse response;
  absl::Status s = Call("Range", [&](Stubs& stubs, grpc::ClientContext* context) {
    return stubs.kv->Range(context, request, &response);
  });
  if (!s.ok()) return s;
  std::vector<EtcdKeyValue> out;
  out.reserve(response.kvs_size());
  for (const etcdserverpb::KeyValue& kv : response.kvs()) out.push_back(FromProto(kv));
  return out;
}

absl::StatusOr<int64_t> EtcdClient::Put(absl::string_view key, absl::string_view value,
                                        int64_t lease) {
  etcdserverpb::PutRequest request;
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  request.set_lease(lease);
  etcdserverpb::PutResponse response;
  absl::Status s = Call("Put", [&](Stubs& stubs, grpc::ClientContext* context) {
    return stubs.kv->Put(context, request, &response);
  });
  if (!s.ok()) return s;
  return response.header().revision();
}

absl::StatusOr<int64_t> EtcdClient::Delete(absl::string_view key) {
  etcdserverpb::DeleteRangeRequest request;
  request.set_key(std::string(key));
  etcdserverpb::DeleteRangeResponse response;
  absl::Status s = Call("DeleteRange", [&](Stubs& stubs, grpc::ClientContext* context) {
    return stubs.kv->DeleteRange(context, request, &response);
  });
  if (!s.ok()) return s;
  return response.deleted();
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(const etcdserverpb::TxnRequest& request) {
  etcdserverpb::TxnResponse response;
  absl::Status s = Call("Txn", [&](Stubs& stubs, grpc::ClientContext* context) {
    return stubs.kv->Txn(context, request, &response);
  });
  if (!s.ok()) return s;
  return response;
}

absl::StatusOr<EtcdClient::CasResult> EtcdClient::PutIfAbsent(
    absl::string_view key, absl::string_view value, int64_t lease,
    const std::vector<std::pair<std::string, std::string>>& also) {
  etcdserverpb::TxnRequest request;
  etcdserverpb::Compare* absent = request.add_compare();
  absent->set_result(etcdserverpb::Compare::EQUAL);
  absent->set_target(etcdserverpb::Compare::CREATE);
  absent->set_key(std::string(key));
  absent->set_create_revision(0);
  etcdserverpb::PutRequest* put = request.add_success()->mutable_request_put();
  put->set_key(std::string(key));
  put->set_value(std::string(value));
  put->set_lease(lease);
  for (const auto& [k, v] : also) {
    etcdserverpb::PutRequest* extra = request.add_success()->mutable_request_put();
    extra->set_key(k);
    extra->set_value(v);
  }
  request.add_failure()->mutable_request_range()->set_key(std::string(key));
  absl::StatusOr<etcdserverpb::TxnResponse> response = Txn(request);
  if (!response.ok()) return response.status();
  CasResult result;
  result.written = response->succeeded();
  if (!result.written && response->responses_size() > 0 &&
      response->responses(0).response_range().kvs_size() > 0) {
    result.existing = FromProto(response->responses(0).response_range().kvs(0));
  }
  return result;
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(absl::Duration ttl) {
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)))));
  etcdserverpb::LeaseGrantResponse response;
  absl::Status s = Call("LeaseGrant", [&](Stubs& stubs, grpc::ClientContext* context) {
    return stubs.lease->LeaseGrant(context, request, &response);
  });
  if (!s.ok()) return s;
  if (!response.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd LeaseGrant: ", response.error()));
  }
  return response.id();
}

absl::StatusOr<absl::Duration> EtcdClient::KeepAlive(int64_t lease) {
  etcdserverpb::LeaseKeepAliveResponse response;
  absl::Status s = Call("LeaseKeepAlive", [&](Stubs& stubs, grpc::ClientContext* context) {
    auto stream = stubs.lease->LeaseKeepAlive(context);
    etcdserverpb::LeaseKeepAliveRequest request;
    request.set_id(lease);
    if (stream->Write(request)) {
      stream->WritesDone();
      if (!stream->Read(&response)) response.set_ttl(-2);
    }
    return stream->Finish();
  });
  if (!s.ok()) return s;
  if (response.ttl() == -2) {
    return absl::UnavailableError("etcd LeaseKeepAlive: the stream ended without an answer");
  }
  if (response.ttl() <= 0) {
    return absl::NotFoundError(absl::StrCat("etcd lease ", lease, " has expired"));
  }
  return absl::Seconds(response.ttl());
}

absl::Status EtcdClient::RevokeLease(int64_t lease) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease);
  etcdserverpb::LeaseRevokeResponse response;
  return Call("LeaseRevoke", [&](Stubs& stubs, grpc::ClientContext* context) {
    return stubs.lease->LeaseRevoke(context, request, &response);
  });
}

EtcdClient::Watch::~Watch() {
  Cancel();
  if (thread_.joinable()) thread_.join();
}

void EtcdClient::Watch::Cancel() { context_.TryCancel(); }

absl::StatusOr<std::unique_ptr<EtcdClient::Watch>> EtcdClient::WatchPrefix(
    absl::string_view prefix, int64_t start_revision,
    std::function<void(const std::vector<WatchEvent>&, int64_t revision)> on_events,
    std::function<void(const absl::Status&)> on_end) {
  size_t start;
  {
    absl::MutexLock lock(&mu_);
    start = current_;
  }
  using Stream = grpc::ClientReaderWriter<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse>;
  etcdserverpb::WatchRequest request;
  etcdserverpb::WatchCreateRequest* create = request.mutable_create_request();
  create->set_key(std::string(prefix));
  create->set_range_end(EtcdPrefixEnd(prefix));
  create->set_start_revision(start_revision);
  // As Call: the current endpoint first, then each of the others once.
  std::unique_ptr<Watch> watch;
  std::shared_ptr<Stream> stream;
  std::vector<std::string> failures;
  size_t index = start;
  for (size_t i = 0; i < stubs_.size() && stream == nullptr; ++i) {
    index = (start + i) % stubs_.size();
    Stubs& stubs = *stubs_[index];
    watch.reset(new Watch());
    std::shared_ptr<Stream> candidate(stubs.watch->Watch(&watch->context_).release());
    etcdserverpb::WatchResponse created;
    if (candidate->Write(request) && candidate->Read(&created) && created.created()) {
      stream = std::move(candidate);
      break;
    }
    watch->context_.TryCancel();
    grpc::Status status = candidate->Finish();
    if (status.ok()) status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch not created");
    absl::Status failed = FromGrpc(status, stubs.endpoint, "Watch");
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE) return failed;
    failures.push_back(std::string(failed.message()));
  }
  if (stream == nullptr) {
    return absl::UnavailableError(absl::StrJoin(failures, "; "));
  }
  {
    absl::MutexLock lock(&mu_);
    current_ = index;
  }
  const Stubs& stubs = *stubs_[index];
  Watch* raw = watch.get();
  const std::string endpoint = stubs.endpoint;
  raw->thread_ = std::thread(
      [raw, stream, endpoint, on_events = std::move(on_events), on_end = std::move(on_end)] {
        etcdserverpb::WatchResponse response;
        absl::Status end;
        while (stream->Read(&response)) {
          if (response.canceled()) {
            end = absl::AbortedError(
                absl::StrCat("etcd ", endpoint, " cancelled the watch: ", response.cancel_reason(),
                             response.compact_revision() > 0
                                 ? absl::StrCat(" (compacted at ", response.compact_revision(), ")")
                                 : ""));
            raw->context_.TryCancel();
            break;
          }
          if (response.events_size() == 0) continue;
          std::vector<WatchEvent> events;
          events.reserve(response.events_size());
          for (const etcdserverpb::WatchEvent& e : response.events()) {
            WatchEvent event;
            event.deleted = e.type() == etcdserverpb::WatchEvent::DELETE;
            event.kv = FromProto(e.kv());
            events.push_back(std::move(event));
          }
          on_events(events, response.header().revision());
        }
        grpc::Status status = stream->Finish();
        if (end.ok()) {
          end = status.ok() ? absl::UnavailableError("etcd ended the watch")
                            : FromGrpc(status, endpoint, "Watch");
        }
        raw->done_.store(true);
        on_end(end);
      });
  return watch;
}

}  // namespace refit::server
