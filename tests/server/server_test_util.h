// Shared helpers of the tests in tests/server: a RefitServer on a Unix socket
// in a fresh temp dir, clients for it, and Push messages built from the
// fixture model.
#ifndef REFIT_TESTS_SERVER_SERVER_TEST_UTIL_H_
#define REFIT_TESTS_SERVER_SERVER_TEST_UTIL_H_

#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "core/fixture_model.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "refit/v1/refit.grpc.pb.h"
#include "server/grpc_convert.h"
#include "server/refit_server.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/sanitizers.h"

namespace refit::server::testing {

// Tests that leave their process without a free descriptor (to see what
// the server does at its open-file limit) cannot run under the sanitizers:
// their runtimes need descriptors of their own (UBSan's type checks then
// report objects falsely).
constexpr bool kUnderSanitizer = refit::testing::kSanitized;

// While it lives, this process can open no descriptor: the soft open-file
// limit sits at the lowest free descriptor number (every one below it is in
// use). The destructor restores the limit. ok() is false if it could not.
class NoFreeDescriptors {
 public:
  NoFreeDescriptors() {
    if (::getrlimit(RLIMIT_NOFILE, &saved_) != 0) return;
    const int probe = ::dup(0);
    if (probe < 0) return;
    ::close(probe);
    rlimit low = saved_;
    low.rlim_cur = static_cast<rlim_t>(probe);
    ok_ = ::setrlimit(RLIMIT_NOFILE, &low) == 0;
  }
  ~NoFreeDescriptors() { Restore(); }
  NoFreeDescriptors(const NoFreeDescriptors&) = delete;
  NoFreeDescriptors& operator=(const NoFreeDescriptors&) = delete;
  bool ok() const { return ok_; }
  void Restore() {
    if (ok_) ::setrlimit(RLIMIT_NOFILE, &saved_);
    ok_ = false;
  }

 private:
  rlimit saved_{};
  bool ok_ = false;
};

// A stream socket connected to the Unix socket at `path`, or -1 and the
// reason in *error.
inline int ConnectUnix(const std::string& path, std::string* error) {
  int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), std::min(path.size(), sizeof(addr.sun_path) - 1));
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    *error = absl::StrCat("connect: ", std::strerror(errno));
    ::close(s);
    return -1;
  }
  return s;
}

// Redeems `ticket` at a descriptor socket: every descriptor of the 'K'
// answer (up to 8), or none and the refusal in *error.
inline std::vector<int> ReceiveFds(const std::string& path, const std::string& ticket,
                                   std::string* error) {
  const int s = ConnectUnix(path, error);
  if (s < 0) return {};
  const std::string line = ticket + "\n";
  (void)!::send(s, line.data(), line.size(), MSG_NOSIGNAL);
  char buf[512];
  iovec iov{buf, sizeof(buf)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  ::close(s);
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const size_t at = fds.size();
    fds.resize(at + count);
    std::memcpy(fds.data() + at, CMSG_DATA(c), count * sizeof(int));
  }
  if (n > 0 && buf[0] == 'K' && !fds.empty()) return fds;
  for (int fd : fds) ::close(fd);
  *error = n > 1 ? std::string(buf + 1, static_cast<size_t>(n - 1)) : "nothing";
  return {};
}

inline std::string MakeTempDir() {
  const char* tmp = getenv("TEST_TMPDIR");
  if (tmp == nullptr || *tmp == '\0') tmp = getenv("TMPDIR");
  std::string pattern = absl::StrCat(tmp != nullptr && *tmp ? tmp : "/tmp", "/refitd-test-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
  return pattern;
}

// gRPC 1.51's grpc_shutdown (run when the last gRPC object of the process
// goes) can wait up to 10 s for an executor thread sleeping in epoll. One
// reference held for the whole test process keeps that off the test path.
inline void HoldGrpcLibrary() {
  static const bool initialized = [] {
    grpc_init();
    return true;
  }();
  (void)initialized;
}

// Options for a fast in-process daemon on `dir`/refitd.sock.
inline ServerOptions TestOptions(const std::string& dir) {
  HoldGrpcLibrary();
  ServerOptions options;
  options.listen = {absl::StrCat("unix:", dir, "/refitd.sock")};
  options.model = "demo";
  options.reload_root = dir;
  options.shutdown_timeout = absl::Seconds(5);
  return options;
}

inline std::shared_ptr<grpc::Channel> Connect(const RefitServer& server) {
  return grpc::CreateChannel(server.bound_addresses().front(), grpc::InsecureChannelCredentials());
}

inline std::vector<core::OwnedTensor> FixtureWeights(uint64_t seed) {
  absl::StatusOr<std::vector<core::OwnedTensor>> weights =
      core::MakeFixtureWeights(core::FixtureConfig(), seed);
  EXPECT_TRUE(weights.ok()) << weights.status();
  return weights.ok() ? *std::move(weights) : std::vector<core::OwnedTensor>{};
}

inline v1::PushRequest BeginMessage(v1::CompletionMode mode = v1::COMPLETION_MODE_COMMIT) {
  v1::PushRequest request;
  v1::RefitOptions* options = request.mutable_begin()->mutable_options();
  options->set_completion(mode);
  options->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
  options->set_label("test");
  return request;
}

inline v1::PushRequest EndMessage() {
  v1::PushRequest request;
  request.mutable_end();
  return request;
}

inline void AddChunk(const core::OwnedTensor& tensor, v1::Chunks* chunks) {
  v1::Chunk* chunk = chunks->add_chunks();
  chunk->set_tensor_name(tensor.name);
  chunk->set_dtype(ToProtoDType(tensor.dtype));
  for (int64_t d : tensor.shape) chunk->add_shape(d);
  chunk->set_byte_offset(0);
  chunk->set_data(tensor.bytes.data(), tensor.bytes.size());
}

// All tensors, about `bucket_bytes` per message.
inline std::vector<v1::PushRequest> ChunkMessages(const std::vector<core::OwnedTensor>& tensors,
                                                  size_t bucket_bytes = 256 << 10) {
  std::vector<v1::PushRequest> out;
  v1::PushRequest current;
  size_t bytes = 0;
  for (const core::OwnedTensor& tensor : tensors) {
    AddChunk(tensor, current.mutable_chunks());
    bytes += tensor.bytes.size();
    if (bytes >= bucket_bytes) {
      out.push_back(std::move(current));
      current = v1::PushRequest();
      bytes = 0;
    }
  }
  if (current.has_chunks()) out.push_back(std::move(current));
  return out;
}

struct PushOutcome {
  grpc::Status status;
  v1::PushResponse response;
};

// One whole Push stream: `messages` in order, then WritesDone and Finish.
inline PushOutcome PushMessages(v1::RefitService::Stub* stub,
                                const std::vector<v1::PushRequest>& messages,
                                const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  PushOutcome outcome;
  std::unique_ptr<grpc::ClientWriter<v1::PushRequest>> writer =
      stub->Push(&context, &outcome.response);
  for (const v1::PushRequest& message : messages) {
    if (!writer->Write(message)) break;
  }
  writer->WritesDone();
  outcome.status = writer->Finish();
  return outcome;
}

inline std::vector<v1::PushRequest> FullPush(uint64_t seed,
                                             v1::CompletionMode mode = v1::COMPLETION_MODE_COMMIT) {
  std::vector<v1::PushRequest> messages = {BeginMessage(mode)};
  for (v1::PushRequest& m : ChunkMessages(FixtureWeights(seed))) messages.push_back(std::move(m));
  messages.push_back(EndMessage());
  return messages;
}

inline v1::GetStatusResponse Status(v1::RefitService::Stub* stub, const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  v1::GetStatusResponse response;
  grpc::Status status = stub->GetStatus(&context, v1::GetStatusRequest(), &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response;
}

// Reads a whole kernel tensor.
inline grpc::Status ReadTensorBytes(v1::RefitService::Stub* stub, const std::string& name,
                                    std::string* bytes, uint32_t max_chunk_bytes = 0,
                                    int* messages = nullptr) {
  grpc::ClientContext context;
  v1::ReadTensorRequest request;
  request.set_name(name);
  request.set_max_chunk_bytes(max_chunk_bytes);
  std::unique_ptr<grpc::ClientReader<v1::ReadTensorResponse>> reader =
      stub->ReadTensor(&context, request);
  v1::ReadTensorResponse response;
  bytes->clear();
  int count = 0;
  while (reader->Read(&response)) {
    EXPECT_EQ(response.byte_offset(), bytes->size());
    bytes->append(response.data());
    ++count;
  }
  if (messages != nullptr) *messages = count;
  return reader->Finish();
}

// A Watch stream opened before the action under test; Next() blocks for the
// next event.
class WatchStream {
 public:
  explicit WatchStream(v1::RefitService::Stub* stub) {
    reader_ = stub->Watch(&context_, v1::WatchRequest());
    v1::WatchEvent snapshot;
    EXPECT_TRUE(reader_->Read(&snapshot));
    EXPECT_EQ(snapshot.type(), v1::WatchEvent::TYPE_SNAPSHOT);
  }
  ~WatchStream() {
    context_.TryCancel();
    v1::WatchEvent ignored;
    while (reader_->Read(&ignored)) {
    }
    reader_->Finish();
  }
  // The next event of `type` (earlier ones of other types are skipped).
  v1::WatchEvent Next(v1::WatchEvent::Type type) {
    v1::WatchEvent event;
    while (reader_->Read(&event)) {
      if (event.type() == type) return event;
    }
    ADD_FAILURE() << "Watch ended before an event of type " << type;
    return event;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::WatchEvent>> reader_;
};

// A RefitServer started per test (TestOptions in a fresh directory unless the
// test restarts it with its own options) and a stub connected to it.
class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(TestOptions(dir_)); }

  void StartServer(ServerOptions options) {
    stub_.reset();
    server_.reset();
    absl::StatusOr<std::unique_ptr<RefitServer>> server = RefitServer::Start(std::move(options));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::RefitService::NewStub(Connect(*server_));
  }

  // TestOptions with the daemon's timers on clock_.
  ServerOptions FakeClockOptions() {
    ServerOptions options = TestOptions(dir_);
    options.clock = &clock_;
    return options;
  }

  uint64_t Version() { return Status(stub_.get()).version(); }

  std::string dir_ = MakeTempDir();
  ::refit::testing::FakeClock clock_;  // outlives the servers that run on it
  std::unique_ptr<RefitServer> server_;
  std::unique_ptr<v1::RefitService::Stub> stub_;
};

}  // namespace refit::server::testing

#endif  // REFIT_TESTS_SERVER_SERVER_TEST_UTIL_H_
