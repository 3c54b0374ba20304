// refit_bench_sink: the receiving side of bench/e2e's references, a process
// of its own like refitd.
//
//   --grpc unix:/path   bare gRPC server (BareStream.Send, client streaming
//                       `bytes`): the callback API and the same receive limit
//                       as refitd, each message read and dropped.
//   --raw /path         raw Unix stream socket: per connection, an 8-byte
//                       little-endian length, then that many bytes read into
//                       one chunk-sized buffer; an 8-byte ack at the end.
//   --chunk-bytes N     read size of the raw sink (the same chunk size).
// Runs until SIGTERM/SIGINT.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "bench/e2e/bare_stream.grpc.pb.h"

ABSL_FLAG(std::string, grpc, "", "bare gRPC listen address (unix:/path or host:port)");
ABSL_FLAG(std::string, raw, "", "raw Unix socket path");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{32} << 20, "read size of the raw sink");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{65} << 20,
          "gRPC receive limit (refitd: --max-chunk-bytes + 1 MiB)");

namespace refit::bench {
namespace {

class SendReactor final : public grpc::ServerReadReactor<v1::Blob> {
 public:
  explicit SendReactor(v1::Ack* ack) : ack_(ack) { StartRead(&blob_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    ack_->set_bytes(ack_->bytes() + blob_.data().size());
    ack_->set_messages(ack_->messages() + 1);
    StartRead(&blob_);
  }
  void OnDone() override { delete this; }

 private:
  v1::Ack* ack_;
  v1::Blob blob_;
};

class BareService final : public v1::BareStream::CallbackService {
  grpc::ServerReadReactor<v1::Blob>* Send(grpc::CallbackServerContext*, v1::Ack* ack) override {
    return new SendReactor(ack);
  }
};

bool ReadFull(int fd, uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t got = ::read(fd, p, n);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

void ServeRaw(int listen_fd, size_t chunk_bytes) {
  std::vector<uint8_t> buffer(chunk_bytes);
  std::memset(buffer.data(), 0, buffer.size());
  while (true) {
    int fd = ::accept(listen_fd, nullptr, nullptr);
    if (fd < 0) return;
    // The ceiling: the largest socket buffer the system allows (fewer wakeups).
    int size = 4 << 20;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof(size));
    uint64_t total = 0;
    if (ReadFull(fd, reinterpret_cast<uint8_t*>(&total), sizeof(total))) {
      uint64_t done = 0;
      bool ok = true;
      while (ok && done < total) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, total - done));
        ok = ReadFull(fd, buffer.data(), n);
        done += ok ? n : 0;
      }
      if (ok) (void)!::write(fd, &done, sizeof(done));
    }
    ::close(fd);
  }
}

int Run() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  std::thread raw_thread;
  const std::string raw = absl::GetFlag(FLAGS_raw);
  if (!raw.empty()) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (fd < 0 || raw.size() >= sizeof(addr.sun_path)) {
      std::fprintf(stderr, "refit_bench_sink: bad raw socket path %s\n", raw.c_str());
      return 1;
    }
    std::memcpy(addr.sun_path, raw.c_str(), raw.size() + 1);
    ::unlink(raw.c_str());
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 4) != 0) {
      std::fprintf(stderr, "refit_bench_sink: cannot listen on %s: %s\n", raw.c_str(),
                   std::strerror(errno));
      return 1;
    }
    raw_thread = std::thread(ServeRaw, fd, static_cast<size_t>(absl::GetFlag(FLAGS_chunk_bytes)));
    raw_thread.detach();
  }
  BareService service;
  std::unique_ptr<grpc::Server> server;
  const std::string address = absl::GetFlag(FLAGS_grpc);
  if (!address.empty()) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials());
    builder.SetMaxReceiveMessageSize(static_cast<int>(absl::GetFlag(FLAGS_max_message_bytes)));
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    if (server == nullptr) {
      std::fprintf(stderr, "refit_bench_sink: cannot listen on %s\n", address.c_str());
      return 1;
    }
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  if (server != nullptr) server->Shutdown();
  if (!raw.empty()) ::unlink(raw.c_str());
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return refit::bench::Run();
}
