// RegionService and Push chunks that reference shared-memory regions,
// against an in-process refitd over its Unix socket: a sealed memfd is
// mapped and a plain one read with pread, both committing the same
// fingerprint as a push that carries the bytes; the refusals (TCP, limits,
// bad offsets, unknown and foreign regions, a descriptor smaller than its
// size, a reused ticket); a region truncated mid-refit fails the refit and
// leaves the live version; a lease that ends releases its region.
#include "server/region_service.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/statfs.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "refit/v1/region.grpc.pb.h"
#include "tests/server/server_test_util.h"

namespace refit::server::testing {
namespace {

using ::testing::HasSubstr;

// Sends `ticket` with `fd` attached to the descriptor socket: the reply
// ("K" or "E<reason>").
std::string SendTicketOn(int s, const std::string& ticket, int fd);

std::string SendFd(const std::string& path, const std::string& ticket, int fd) {
  std::string error;
  const int s = ConnectUnix(path, &error);
  if (s < 0) return absl::StrCat("E", error);
  return SendTicketOn(s, ticket, fd);
}

// SendFd on a connected socket `s` (closed here); fd -1 sends none.
std::string SendTicketOn(int s, const std::string& ticket, int fd) {
  std::string line = ticket + "\n";
  iovec iov{line.data(), line.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  }
  (void)!::sendmsg(s, &msg, MSG_NOSIGNAL);
  std::string reply;
  char buf[512];
  ssize_t n;
  while ((n = ::recv(s, buf, sizeof(buf), 0)) > 0) reply.append(buf, static_cast<size_t>(n));
  ::close(s);
  while (!reply.empty() && reply.back() == '\n') reply.pop_back();
  return reply;
}

// The fixture's tensors laid out in one memfd, 256-byte aligned.
struct RegionFile {
  int fd = -1;
  uint64_t size = 0;
  std::vector<uint64_t> offsets;
  ~RegionFile() {
    if (fd >= 0) ::close(fd);
  }
};

std::unique_ptr<RegionFile> MakeRegionFile(const std::vector<core::OwnedTensor>& tensors,
                                           bool seal) {
  auto file = std::make_unique<RegionFile>();
  file->fd = ::memfd_create("weights", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  uint64_t at = 0;
  for (const core::OwnedTensor& t : tensors) {
    file->offsets.push_back(at);
    at += (t.bytes.size() + 255) / 256 * 256;
  }
  file->size = at;
  EXPECT_EQ(::ftruncate(file->fd, static_cast<off_t>(at)), 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(::pwrite(file->fd, tensors[i].bytes.data(), tensors[i].bytes.size(),
                       static_cast<off_t>(file->offsets[i])),
              static_cast<ssize_t>(tensors[i].bytes.size()));
  }
  if (seal) {
    EXPECT_EQ(::fcntl(file->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  }
  return file;
}

// Chunk messages that reference the tensors in `region_id` at `file`'s
// offsets, about `bucket` tensors per message.
std::vector<v1::PushRequest> RegionChunkMessages(const std::vector<core::OwnedTensor>& tensors,
                                                 const RegionFile& file,
                                                 const std::string& region_id, size_t bucket = 8) {
  std::vector<v1::PushRequest> out;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i % bucket == 0) out.emplace_back();
    v1::Chunk* chunk = out.back().mutable_chunks()->add_chunks();
    chunk->set_tensor_name(tensors[i].name);
    chunk->set_dtype(ToProtoDType(tensors[i].dtype));
    for (int64_t d : tensors[i].shape) chunk->add_shape(d);
    chunk->mutable_region()->set_region_id(region_id);
    chunk->mutable_region()->set_offset(file.offsets[i]);
    chunk->mutable_region()->set_length(tensors[i].bytes.size());
  }
  return out;
}

// Bytes of the quantized weights (the linear layers' *_proj.weight).
uint64_t QuantizedWeightBytes(const std::vector<core::OwnedTensor>& tensors) {
  uint64_t n = 0;
  for (const core::OwnedTensor& t : tensors) {
    if (absl::EndsWith(t.name, "_proj.weight")) n += t.bytes.size();
  }
  return n;
}

// One RegisterRegion stream (the lease).
class Lease {
 public:
  Lease(v1::RegionService::Stub* stub, uint64_t size, const std::string& token = "") {
    if (!token.empty()) context_.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    v1::RegisterRegionRequest request;
    request.set_size(size);
    request.set_name("test-weights");
    reader_ = stub->RegisterRegion(&context_, request);
  }
  Lease(v1::RegionService::Stub* stub, const v1::RegisterRegionRequest& request) {
    reader_ = stub->RegisterRegion(&context_, request);
  }
  ~Lease() {
    Cancel();
    Finish();
  }

  bool ReadTicket(v1::RegionTicket* ticket) {
    v1::RegionEvent event;
    if (!reader_->Read(&event) || !event.has_ticket()) return false;
    *ticket = event.ticket();
    return true;
  }
  bool ReadRegistered(v1::RegionRegistered* registered) {
    v1::RegionEvent event;
    if (!reader_->Read(&event) || !event.has_registered()) return false;
    *registered = event.registered();
    return true;
  }
  // Ticket, descriptor, Registered: the region id, or "" (see Finish()).
  std::string Register(int fd, v1::RegionRegistered::Access* access = nullptr) {
    v1::RegionTicket ticket;
    if (!ReadTicket(&ticket)) return "";
    reply_ = SendFd(ticket.fd_socket(), ticket.ticket(), fd);
    v1::RegionRegistered registered;
    if (!ReadRegistered(&registered)) return "";
    if (access != nullptr) *access = registered.access();
    return registered.region_id();
  }
  const std::string& reply() const { return reply_; }
  void Cancel() { context_.TryCancel(); }
  grpc::Status Finish() {
    if (finished_) return status_;
    finished_ = true;
    v1::RegionEvent rest;
    while (reader_->Read(&rest)) {
    }
    status_ = reader_->Finish();
    return status_;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::RegionEvent>> reader_;
  std::string reply_;
  bool finished_ = false;
  grpc::Status status_;
};

// A tiny HTTP/1.0 GET of /metrics.
std::string Scrape(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!::write(fd, request.data(), request.size());
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  ::close(fd);
  return response;
}

class RegionTest : public ServerTest {
 protected:
  // Begins a Push on `writer` and sends every tensor by reference to region
  // `id` but `held`, whose chunk (with its bytes) goes into *last; returns
  // once every chunk sent was ingested (bounded wait).
  void SendAllButHeld(grpc::ClientWriter<v1::PushRequest>* writer,
                      const std::vector<core::OwnedTensor>& tensors, const RegionFile& file,
                      const std::string& id, const std::string& held, v1::PushRequest* last) {
    ASSERT_TRUE(writer->Write(BeginMessage()));
    for (const v1::PushRequest& m : RegionChunkMessages(tensors, file, id, /*bucket=*/1)) {
      if (m.chunks().chunks(0).tensor_name() == held) continue;
      ASSERT_TRUE(writer->Write(m));
    }
    for (const core::OwnedTensor& t : tensors) {
      if (t.name != held) continue;
      v1::Chunk* chunk = last->mutable_chunks()->add_chunks();
      chunk->set_tensor_name(t.name);
      chunk->set_dtype(ToProtoDType(t.dtype));
      for (int64_t d : t.shape) chunk->add_shape(d);
      chunk->set_data(std::string(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size()));
    }
    ASSERT_EQ(last->chunks().chunks_size(), 1);
    writer->WaitForInitialMetadata();
    uint64_t sent = 0;
    for (const core::OwnedTensor& t : tensors) sent += t.name == held ? 0 : t.bytes.size();
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (Status(stub_.get()).active_refit().bytes_received() < sent && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(Status(stub_.get()).active_refit().bytes_received(), sent);
  }

  void SetUp() override { Start(TestOptions(dir_)); }

  void Start(ServerOptions options) {
    options.metrics_listen = "127.0.0.1:0";
    StartServer(std::move(options));
    region_stub_ = v1::RegionService::NewStub(Connect(*server_));
  }

  // `status` (a push's) failed because `id`'s file shrank, nothing live
  // changed, and once the file is whole again a push from it is refused.
  void ExpectShrunkRegionFailedTheRefitAndIsRefused(const grpc::Status& status,
                                                    const std::string& id,
                                                    const v1::GetStatusResponse& before,
                                                    const std::vector<core::OwnedTensor>& tensors,
                                                    const RegionFile& file) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(), HasSubstr("truncated while in use"));
    EXPECT_THAT(status.error_message(), HasSubstr(id));
    const v1::GetStatusResponse after = Status(stub_.get());
    EXPECT_EQ(after.version(), before.version());
    EXPECT_EQ(after.fingerprint(), before.fingerprint());
    EXPECT_FALSE(after.has_active_refit());
    ASSERT_EQ(::ftruncate(file.fd, static_cast<off_t>(file.size)), 0);
    const PushOutcome again = PushRegion(tensors, file, id);
    EXPECT_EQ(again.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(again.status.error_message(), HasSubstr("register it again"));
    EXPECT_EQ(Status(stub_.get()).version(), before.version());
  }

  // Begin, the region chunks, End.
  PushOutcome PushRegion(const std::vector<core::OwnedTensor>& tensors, const RegionFile& file,
                         const std::string& region_id, const std::string& token = "") {
    std::vector<v1::PushRequest> messages = {BeginMessage()};
    for (v1::PushRequest& m : RegionChunkMessages(tensors, file, region_id)) {
      messages.push_back(std::move(m));
    }
    messages.push_back(EndMessage());
    return PushMessages(stub_.get(), messages, token);
  }

  std::string MetricsText() { return Scrape(server_->metrics_port()); }

  std::unique_ptr<v1::RegionService::Stub> region_stub_;
};

TEST_F(RegionTest, SealedRegionIsMappedAndCommitsTheFingerprintOfTheSameBytesPushedInline) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(7);
  ASSERT_TRUE(PushMessages(stub_.get(), FullPush(7)).status.ok());
  const v1::GetStatusResponse inline_status = Status(stub_.get());
  ASSERT_EQ(inline_status.version(), 2u);

  auto file = MakeRegionFile(tensors, /*seal=*/true);
  Lease lease(region_stub_.get(), file->size);
  v1::RegionRegistered::Access access = v1::RegionRegistered::ACCESS_UNSPECIFIED;
  const std::string id = lease.Register(file->fd, &access);
  ASSERT_FALSE(id.empty()) << lease.reply() << " " << lease.Finish().error_message();
  EXPECT_EQ(lease.reply(), "K");
  EXPECT_EQ(access, v1::RegionRegistered::ACCESS_MAPPED);
  EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_regions 1\n"));
  // A host store: nothing is page-locked.
  EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_region_pinned_bytes 0\n"));

  const PushOutcome outcome = PushRegion(tensors, *file, id);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  // The rows of every quantized weight were read where they lie.
  EXPECT_EQ(outcome.response.result().bytes_read_in_place(), QuantizedWeightBytes(tensors));
  const v1::GetStatusResponse status = Status(stub_.get());
  EXPECT_EQ(status.version(), 3u);
  EXPECT_EQ(status.fingerprint(), inline_status.fingerprint());
  // A sealed region cannot shrink under the daemon.
  EXPECT_NE(::ftruncate(file->fd, 0), 0);
  EXPECT_EQ(errno, EPERM);
}

TEST_F(RegionTest, UnsealedRegionIsMappedUnderTheGuardAndCommitsTheSameFingerprint) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(9);
  ASSERT_TRUE(PushMessages(stub_.get(), FullPush(9)).status.ok());
  const std::string expected = Status(stub_.get()).fingerprint();
  auto file = MakeRegionFile(tensors, /*seal=*/false);
  Lease lease(region_stub_.get(), file->size);
  v1::RegionRegistered::Access access = v1::RegionRegistered::ACCESS_UNSPECIFIED;
  const std::string id = lease.Register(file->fd, &access);
  ASSERT_FALSE(id.empty()) << lease.reply();
  EXPECT_EQ(access, v1::RegionRegistered::ACCESS_MAPPED);
  const PushOutcome outcome = PushRegion(tensors, *file, id);
  ASSERT_TRUE(outcome.status.ok()) << outcome.status.error_message();
  // The quantized weights' rows were read in place, as from a sealed memfd.
  EXPECT_GT(outcome.response.result().bytes_read_in_place(), 0u);
  EXPECT_EQ(Status(stub_.get()).fingerprint(), expected);
}

TEST_F(RegionTest, RegionReleasedMidRefitStaysMappedUntilItsRowsAreQuantized) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(8);
  ASSERT_TRUE(PushMessages(stub_.get(), FullPush(8)).status.ok());
  const std::string expected = Status(stub_.get()).fingerprint();
  ASSERT_TRUE(PushMessages(stub_.get(), FullPush(2)).status.ok());
  auto file = MakeRegionFile(tensors, /*seal=*/true);
  Lease lease(region_stub_.get(), file->size);
  const std::string id = lease.Register(file->fd);
  ASSERT_FALSE(id.empty()) << lease.reply();

  // Every tensor goes by reference but one half of a fused weight; the
  // trainer then unregisters the region and closes its descriptor, and
  // sends that half with its bytes: the layer completes after the release
  // and quantizes the other half's rows from the region, still mapped.
  const std::string held = "model.layers.1.mlp.up_proj.weight";
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  v1::PushRequest last;
  ASSERT_NO_FATAL_FAILURE(SendAllButHeld(writer.get(), tensors, *file, id, held, &last));
  {
    grpc::ClientContext unregister;
    v1::UnregisterRegionRequest request;
    request.set_region_id(id);
    v1::UnregisterRegionResponse unregistered;
    ASSERT_TRUE(region_stub_->UnregisterRegion(&unregister, request, &unregistered).ok());
  }
  EXPECT_TRUE(lease.Finish().ok());
  ::close(file->fd);
  file->fd = -1;
  ASSERT_TRUE(writer->Write(last));
  ASSERT_TRUE(writer->Write(EndMessage()));
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  uint64_t held_bytes = 0;
  for (const core::OwnedTensor& t : tensors) {
    if (t.name == held) held_bytes = t.bytes.size();
  }
  EXPECT_EQ(response.result().bytes_read_in_place(), QuantizedWeightBytes(tensors) - held_bytes);
  EXPECT_EQ(Status(stub_.get()).fingerprint(), expected);
  EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_regions 0\n"));
}

TEST_F(RegionTest, OffsetPastTheRegionIsOutOfRangeNamingTensorRegionOffsetLengthAndSize) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(3);
  auto file = MakeRegionFile(tensors, true);
  Lease lease(region_stub_.get(), file->size);
  const std::string id = lease.Register(file->fd);
  ASSERT_FALSE(id.empty());
  const std::string before = Status(stub_.get()).fingerprint();
  std::vector<v1::PushRequest> messages = {BeginMessage()};
  for (v1::PushRequest& m : RegionChunkMessages(tensors, *file, id)) messages.push_back(m);
  v1::Chunk* last = messages.back().mutable_chunks()->mutable_chunks(0);
  last->mutable_region()->set_offset(file->size - 16);
  last->mutable_region()->set_length(64);
  messages.push_back(EndMessage());
  const PushOutcome outcome = PushMessages(stub_.get(), messages);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr(last->tensor_name()));
  EXPECT_THAT(outcome.status.error_message(),
              HasSubstr(absl::StrCat("region \"", id, "\" offset ", file->size - 16,
                                     " length 64 reaches past its size ", file->size)));
  const v1::GetStatusResponse status = Status(stub_.get());
  EXPECT_EQ(status.version(), 1u);
  EXPECT_EQ(status.fingerprint(), before);
}

TEST_F(RegionTest, ATensorOverPagesTheTrainerNeverWroteFailsThePushAndTheDaemonAllocatesNone) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(5);
  auto file = MakeRegionFile(tensors, /*seal=*/true);
  size_t largest = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].bytes.size() > tensors[largest].bytes.size()) largest = i;
  }
  ASSERT_GE(tensors[largest].bytes.size(), 3u * 4096);
  // Unwritten pages inside it (as if the trainer never wrote them).
  const uint64_t hole = (file->offsets[largest] + 4095) / 4096 * 4096;
  ASSERT_EQ(::fallocate(file->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        static_cast<off_t>(hole), 4096),
            0);
  Lease lease(region_stub_.get(), file->size);
  const std::string id = lease.Register(file->fd);
  ASSERT_FALSE(id.empty());
  const v1::GetStatusResponse before = Status(stub_.get());
  struct stat st {};
  ASSERT_EQ(::fstat(file->fd, &st), 0);
  const blkcnt_t blocks = st.st_blocks;

  const PushOutcome outcome = PushRegion(tensors, *file, id);
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(outcome.status.error_message(),
              HasSubstr(absl::StrCat("tensor \"", tensors[largest].name, "\": region \"", id,
                                     "\" offset ", file->offsets[largest])));
  EXPECT_THAT(
      outcome.status.error_message(),
      HasSubstr(absl::StrCat("its byte ", hole, " lies in a page the trainer never wrote")));
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), before.version());
  EXPECT_EQ(after.fingerprint(), before.fingerprint());
  ASSERT_EQ(::fstat(file->fd, &st), 0);
  EXPECT_EQ(st.st_blocks, blocks) << "refitd allocated the trainer's unwritten pages";

  // Written, the same region pushes.
  const uint64_t in_tensor = hole - file->offsets[largest];
  ASSERT_EQ(
      ::pwrite(file->fd, tensors[largest].bytes.data() + in_tensor, 4096, static_cast<off_t>(hole)),
      4096);
  const PushOutcome again = PushRegion(tensors, *file, id);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(Status(stub_.get()).version(), before.version() + 1);
}

TEST_F(RegionTest, UnknownRegionIsNotFound) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(3);
  auto file = MakeRegionFile(tensors, true);
  const PushOutcome outcome = PushRegion(tensors, *file, "rg-0123");
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(outcome.status.error_message(),
              HasSubstr("unknown shared-memory region \"rg-0123\""));
  EXPECT_EQ(Version(), 1u);

  grpc::ClientContext context;
  v1::UnregisterRegionRequest request;
  request.set_region_id("rg-0123");
  v1::UnregisterRegionResponse response;
  EXPECT_EQ(region_stub_->UnregisterRegion(&context, request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(RegionTest, RegisterOverTcpIsFailedPrecondition) {
  ServerOptions options = TestOptions(dir_);
  options.listen.push_back("127.0.0.1:0");
  Start(std::move(options));
  auto tcp = v1::RegionService::NewStub(
      grpc::CreateChannel(server_->bound_addresses().back(), grpc::InsecureChannelCredentials()));
  Lease lease(tcp.get(), 4096);
  v1::RegionTicket ticket;
  EXPECT_FALSE(lease.ReadTicket(&ticket));
  const grpc::Status status = lease.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("shared-memory regions need a local Unix socket"));
}

TEST_F(RegionTest, DescriptorSmallerThanItsSizeIsInvalidArgumentAndTicketsWorkOnce) {
  auto file = MakeRegionFile(FixtureWeights(3), true);
  Lease lease(region_stub_.get(), file->size + 4096);
  v1::RegionTicket ticket;
  ASSERT_TRUE(lease.ReadTicket(&ticket));
  EXPECT_THAT(SendFd(ticket.fd_socket(), ticket.ticket(), file->fd),
              HasSubstr("smaller than its declared size"));
  const grpc::Status status = lease.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("smaller than its declared size"));
  EXPECT_THAT(SendFd(ticket.fd_socket(), ticket.ticket(), file->fd),
              HasSubstr("unknown region ticket"));
  EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_regions 0\n"));
}

// A trainer that shrinks its memfd and seals it against shrinking while the
// daemon checks it: the seals are read before the size, so what is seen
// sealed is never mapped past the file's end (which would be SIGBUS on the
// first read, with no guard on a sealed mapping).
TEST(RegionOpenTest, AMemfdShrunkAndSealedDuringTheChecksIsNeverMappedPastItsEnd) {
  const int fd = ::memfd_create("raced", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 1 << 20), 0);
  Region::SetOpenHookForTesting([](int region_fd) {
    ASSERT_EQ(::ftruncate(region_fd, 4096), 0);
    ASSERT_EQ(::fcntl(region_fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  });
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("rg-raced", ::dup(fd), 1 << 20);
  Region::SetOpenHookForTesting(nullptr);
  ASSERT_FALSE(region.ok()) << "mapped as sealed, unguarded, 1 MiB over a 4 KiB file";
  EXPECT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(region.status().message(), HasSubstr("is 4096 bytes, smaller than its declared"));
  ::close(fd);
}

// A memfd the trainer wrote only in part: reading its never-written pages
// would allocate them on the daemon's account, so a range that has one is
// refused (naming the first such byte) and the check allocates nothing;
// written ranges read as before, sealed (mapped) or not, and the trainer's
// file offset stays where it was.
TEST(RegionOpenTest, ARangeWithPagesTheTrainerNeverWroteIsInvalidArgumentAndAllocatesNothing) {
  for (bool seal : {true, false}) {
    SCOPED_TRACE(seal ? "sealed" : "unsealed");
    constexpr uint64_t kSize = 4 << 20;
    const int fd = ::memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, kSize), 0);
    if (seal) {
      ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    }
    // Written: the first MiB and the third.
    const std::string ones(1 << 20, '\x01');
    ASSERT_EQ(::pwrite(fd, ones.data(), ones.size(), 0), static_cast<ssize_t>(ones.size()));
    ASSERT_EQ(::pwrite(fd, ones.data(), ones.size(), 2 << 20), static_cast<ssize_t>(ones.size()));
    ASSERT_EQ(::lseek(fd, 12345, SEEK_SET), 12345);
    absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("rg-sparse", ::dup(fd), kSize);
    ASSERT_TRUE(region.ok()) << region.status();
    struct stat before {};
    ASSERT_EQ(::fstat(fd, &before), 0);

    // The check reopens the file to look for holes, and keeps no descriptor
    // of it: a region holds one, as the cap on regions counts.
    const auto open_descriptors = [] {
      return std::distance(std::filesystem::directory_iterator("/proc/self/fd"),
                           std::filesystem::directory_iterator());
    };
    const auto descriptors = open_descriptors();
    std::vector<uint8_t> scratch;
    for (uint64_t offset : {uint64_t{0}, uint64_t{4096}, uint64_t{2 << 20}}) {
      absl::StatusOr<absl::Span<const uint8_t>> bytes =
          (*region)->Read("w", offset, 1 << 19, &scratch);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      EXPECT_EQ((*bytes)[0], 1);
    }
    struct Case {
      uint64_t offset, length, first_hole;
    };
    for (const Case& c :
         {Case{0, (1 << 20) + 1, 1 << 20}, Case{(1 << 20) + 100, 8, (1 << 20) + 100},
          Case{(2 << 20) + 5, 1 << 20, 3 << 20}, Case{kSize - 4, 4, kSize - 4}}) {
      absl::StatusOr<absl::Span<const uint8_t>> bytes =
          (*region)->Read("model.layers.0.mlp.down_proj.weight", c.offset, c.length, &scratch);
      ASSERT_FALSE(bytes.ok()) << c.offset;
      EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(bytes.status().message(),
                  HasSubstr(absl::StrCat("tensor \"model.layers.0.mlp.down_proj.weight\": region "
                                         "\"rg-sparse\" offset ",
                                         c.offset, " length ", c.length, ": its byte ",
                                         c.first_hole, " lies in a page the trainer never wrote")));
    }
    struct stat after {};
    ASSERT_EQ(::fstat(fd, &after), 0);
    EXPECT_EQ(after.st_blocks, before.st_blocks) << "the check allocated pages";
    EXPECT_EQ(open_descriptors(), descriptors);
    EXPECT_EQ(::lseek(fd, 0, SEEK_CUR), 12345);

    // Once written, the same range reads.
    ASSERT_EQ(::pwrite(fd, ones.data(), ones.size(), 1 << 20), static_cast<ssize_t>(ones.size()));
    EXPECT_TRUE((*region)->Read("w", 0, (1 << 20) + 1, &scratch).ok());
    region->reset();
    ::close(fd);
  }
}

// Page-locking (a GPU store's regions) touches every page of a mapping: a
// page the trainer never wrote would be allocated then, on refitd's
// account, and would read as written. Such a region is not page-locked.
TEST(RegionOpenTest, ARegionWithPagesTheTrainerNeverWroteIsNotPageLocked) {
  constexpr uint64_t kSize = 1 << 20;
  struct Case {
    const char* what;
    bool write_first_half, write_second_half, fallocate;
    bool declined;
  };
  for (const Case& c : {Case{"never written", false, false, false, true},
                        Case{"half written", true, false, false, true},
                        Case{"the last page unwritten", true, false, false, true},
                        Case{"every page written", true, true, false, false},
                        Case{"reserved with fallocate", false, false, true, false}}) {
    SCOPED_TRACE(c.what);
    const int fd = ::memfd_create("pin", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, kSize), 0);
    ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    const std::string ones(kSize / 2, '\x01');
    if (c.write_first_half) {
      const size_t n = std::string(c.what) == "the last page unwritten" ? kSize - 4096 : kSize / 2;
      const std::string bytes(n, '\x01');
      ASSERT_EQ(::pwrite(fd, bytes.data(), n, 0), static_cast<ssize_t>(n));
    }
    if (c.write_second_half) {
      ASSERT_EQ(::pwrite(fd, ones.data(), ones.size(), kSize / 2),
                static_cast<ssize_t>(ones.size()));
    }
    if (c.fallocate) {
      ASSERT_EQ(::fallocate(fd, 0, 0, kSize), 0);
    }
    ASSERT_EQ(::lseek(fd, 777, SEEK_SET), 777);
    struct stat before {};
    ASSERT_EQ(::fstat(fd, &before), 0);
    absl::StatusOr<std::unique_ptr<Region>> region =
        Region::Open("rg-pin", ::dup(fd), kSize, /*pin=*/true);
    ASSERT_TRUE(region.ok()) << region.status();
    EXPECT_TRUE((*region)->pin_requested());
    if (c.declined) {
      EXPECT_FALSE((*region)->pinned());
      EXPECT_THAT((*region)->pin_declined(), HasSubstr("pages the trainer never wrote"));
    } else {
      // (Page-locked where a GPU driver is there; here the request is all.)
      EXPECT_EQ((*region)->pin_declined(), "");
    }
    struct stat after {};
    ASSERT_EQ(::fstat(fd, &after), 0);
    EXPECT_EQ(after.st_blocks, before.st_blocks) << "opening the region allocated pages";
    EXPECT_EQ(::lseek(fd, 0, SEEK_CUR), 777) << "the trainer's file offset moved";
    region->reset();
    ::close(fd);
  }
}

// Descriptors that pass for readable regular files but are not mappable
// memory: O_PATH (O_ACCMODE reads as O_RDONLY) and hugetlbfs memfds.
TEST(RegionOpenTest, ADescriptorOfAFileThatIsNotSharedMemoryIsInvalidArgument) {
  // procfs: a regular file whose reads are the kernel's, not a trainer's.
  const int proc = ::open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(proc, 0);
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("rg-proc", proc, 1);
  EXPECT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(region.status().message(),
              HasSubstr("region \"rg-proc\": the descriptor is not shared memory (a file on a "
                        "filesystem of type 0x9fa0, not tmpfs); send a memfd or a file in "
                        "/dev/shm"));
  // A file on the disk the tests run from (where that is not tmpfs).
  char path[] = "refit-region-XXXXXX";
  const int file = ::mkstemp(path);
  ASSERT_GE(file, 0);
  ::unlink(path);
  ASSERT_EQ(::ftruncate(file, 8192), 0);
  struct statfs fs {};
  ASSERT_EQ(::fstatfs(file, &fs), 0);
  region = Region::Open("rg-disk", file, 8192);
  if (static_cast<uint64_t>(fs.f_type) != TMPFS_MAGIC) {
    EXPECT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(region.status().message(), HasSubstr("not shared memory"));
  }
}

TEST(RegionOpenTest, OPathAndHugetlbfsDescriptorsAreInvalidArgument) {
  char path[] = "/dev/shm/refit-region-XXXXXX";
  const int file = ::mkstemp(path);
  ASSERT_GE(file, 0);
  ASSERT_EQ(::ftruncate(file, 8192), 0);
  const int opath = ::open(path, O_PATH | O_CLOEXEC);
  ASSERT_GE(opath, 0);
  absl::StatusOr<std::unique_ptr<Region>> region = Region::Open("rg-opath", opath, 8192);
  EXPECT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(region.status().message(), HasSubstr("not open for reading"));
  // The same file opened for reading is a region (mapped).
  EXPECT_TRUE(Region::Open("rg-file", ::dup(file), 8192).ok());
  ::close(file);
  ::unlink(path);

  const int huge = ::memfd_create("huge", MFD_CLOEXEC | MFD_HUGETLB);
  if (huge < 0) GTEST_SKIP() << "no hugetlbfs memfds here: " << std::strerror(errno);
  // The size needs no huge page: only the file's length is set.
  if (::ftruncate(huge, 2 << 20) != 0) {
    ::close(huge);
    GTEST_SKIP() << "hugetlbfs memfds here take no 2 MiB size: " << std::strerror(errno);
  }
  region = Region::Open("rg-huge", huge, 2 << 20);
  EXPECT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(region.status().message(), HasSubstr("hugetlbfs"));
}

// A region ticket that comes without its descriptor ends the registration
// at once, with the reason, instead of leaving it waiting.
TEST_F(RegionTest, ARegionTicketWithoutItsDescriptorEndsTheRegistrationWithTheReason) {
  Lease lease(region_stub_.get(), 4096);
  v1::RegionTicket ticket;
  ASSERT_TRUE(lease.ReadTicket(&ticket));
  EXPECT_THAT(SendFd(ticket.fd_socket(), ticket.ticket(), -1),
              HasSubstr("came without its descriptor"));
  const grpc::Status status = lease.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("came without its descriptor"));
  EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_regions 0\n"));
}

int OpenDescriptors() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++n;
  }
  return n;
}

// The daemon at its descriptor limit: the kernel drops the region's
// descriptor (MSG_CTRUNC). The registration ends with that reason, not
// "unknown attach ticket" and a lease left waiting.
TEST_F(RegionTest, ARegionDescriptorLostToTheDescriptorLimitEndsTheRegistrationWithTheReason) {
  if (kUnderSanitizer) GTEST_SKIP() << "leaves the process no descriptor (see kUnderSanitizer)";
  auto file = MakeRegionFile(FixtureWeights(3), true);
  Lease lease(region_stub_.get(), file->size);
  v1::RegionTicket ticket;
  ASSERT_TRUE(lease.ReadTicket(&ticket));
  const int before = OpenDescriptors();
  std::string error;
  const int s = ConnectUnix(ticket.fd_socket(), &error);
  ASSERT_GE(s, 0) << error;
  // The server side of the connection is a descriptor of this process too.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (OpenDescriptors() < before + 2 && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(1));
  ASSERT_GE(OpenDescriptors(), before + 2);
  NoFreeDescriptors none;
  ASSERT_TRUE(none.ok());
  const std::string reply = SendTicketOn(s, ticket.ticket(), file->fd);
  none.Restore();
  EXPECT_THAT(reply, HasSubstr("lost on the way: refitd is out of file descriptors"));
  const grpc::Status status = lease.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("out of file descriptors"));
}

// A CUDA allocation is registered by its IPC handle in the request. This
// daemon sees no GPU with the given UUID (on a CPU-only machine, none at
// all): FAILED_PRECONDITION (UNIMPLEMENTED in a build without CUDA), and a
// malformed handle INVALID_ARGUMENT; the
// lease ends and nothing stays registered.
TEST_F(RegionTest, CudaRegionTheDaemonCannotOpenIsRefusedAndNothingStaysRegistered) {
  v1::RegisterRegionRequest request;
  request.set_size(1 << 20);
  request.set_name("cuda tensors");
  request.set_cuda_ipc_handle(std::string(64, '\x5a'));
  request.set_cuda_device_uuid(std::string(16, '\x11'));
  {
    Lease lease(region_stub_.get(), request);
    v1::RegionRegistered registered;
    EXPECT_FALSE(lease.ReadRegistered(&registered));
    const grpc::Status status = lease.Finish();
    // A build without CUDA (the sanitizer builds) cannot open one at all.
    if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      EXPECT_THAT(status.error_message(), HasSubstr("refitd built with CUDA"));
    } else {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
          << status.error_message();
      EXPECT_THAT(status.error_message(), HasSubstr("visible to refitd"));
    }
  }
  request.set_cuda_ipc_handle(std::string(63, '\x5a'));
  {
    Lease lease(region_stub_.get(), request);
    v1::RegionRegistered registered;
    EXPECT_FALSE(lease.ReadRegistered(&registered));
    const grpc::Status status = lease.Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("64 bytes (cudaIpcMemHandle_t), got 63"));
  }
  EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_regions 0\n"));
}

TEST_F(RegionTest, LimitsPerCallerAreResourceExhausted) {
  ServerOptions options = TestOptions(dir_);
  options.max_regions_per_caller = 1;
  options.max_region_bytes_per_caller = 1 << 20;
  Start(std::move(options));
  Lease too_big(region_stub_.get(), (1 << 20) + 1);
  v1::RegionTicket ticket;
  EXPECT_FALSE(too_big.ReadTicket(&ticket));
  grpc::Status status = too_big.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max-region-bytes-per-caller"));

  Lease first(region_stub_.get(), 4096);
  ASSERT_TRUE(first.ReadTicket(&ticket));  // pending counts too
  Lease second(region_stub_.get(), 4096);
  EXPECT_FALSE(second.ReadTicket(&ticket));
  status = second.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max-regions-per-caller 1"));
}

TEST_F(RegionTest, ARegistrationWhoseDescriptorNeverComesEndsAndFreesItsPlace) {
  // A client that takes tickets and never sends the descriptors would hold
  // its caller's places (and with authentication off, everyone's) for good.
  ServerOptions options = TestOptions(dir_);
  options.max_regions_per_caller = 1;
  options.push_idle_timeout = absl::Milliseconds(300);
  Start(std::move(options));
  Lease silent(region_stub_.get(), 4096);
  v1::RegionTicket ticket;
  ASSERT_TRUE(silent.ReadTicket(&ticket));
  const grpc::Status status = silent.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("no descriptor arrived at the descriptor socket within 300ms of the "
                        "ticket (--push-idle-timeout)"));
  EXPECT_THAT(SendFd(ticket.fd_socket(), ticket.ticket(), -1), HasSubstr("unknown region ticket"));
  // Its place is free; a registration that completes in time is not ended.
  auto file = MakeRegionFile(FixtureWeights(3), /*seal=*/true);
  Lease next(region_stub_.get(), file->size);
  ASSERT_FALSE(next.Register(file->fd).empty()) << next.Finish().error_message();
  absl::SleepFor(absl::Seconds(1));
  EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_regions 1\n"));
}

// A region unregistered while a refit still reads it keeps its descriptor
// and mapping until the refit lets go: until then it counts against its
// owner, so register/push/unregister in a loop cannot pile up descriptors.
// All callers together are capped as well.
TEST(RegionRegistryTest, ReleasedRegionsARefitStillHoldsCountUntilLetGoAndTotalsAreCapped) {
  RegionRegistry registry(RegionRegistry::Limits{1, int64_t{1} << 30, 2});
  auto memfd = [] {
    const int fd = ::memfd_create("r", MFD_CLOEXEC);
    EXPECT_EQ(::ftruncate(fd, 4096), 0);
    return fd;
  };
  absl::StatusOr<std::string> id = registry.Reserve("trainer", 4096);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(registry.Activate(*id, memfd()).ok());
  absl::StatusOr<std::shared_ptr<const Region>> read = registry.Find("trainer", *id);  // a refit
  ASSERT_TRUE(read.ok()) << read.status();
  registry.Release(*id);
  absl::StatusOr<std::string> again = registry.Reserve("trainer", 4096);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(again.status().message(), HasSubstr("1 of them unregistered but still read"));
  read->reset();  // the refit ended
  again = registry.Reserve("trainer", 4096);
  ASSERT_TRUE(again.ok()) << again.status();

  // Two regions in all: a third caller is refused whatever its own count.
  ASSERT_TRUE(registry.Reserve("other", 4096).ok());
  absl::StatusOr<std::string> third = registry.Reserve("third", 4096);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("2 shared-memory regions of all callers"));
  registry.Release(*again);
  EXPECT_TRUE(registry.Reserve("third", 4096).ok());
}

// Page-locked memory cannot be reclaimed: a daemon that pins trainers'
// regions pins at most max_pinned_bytes of them, all callers together.
// Regions past it are mapped without; a region unregistered while a refit
// still reads it keeps its share until the refit lets go.
TEST(RegionRegistryTest, PageLockedRegionsStayWithinTheirBudget) {
  RegionRegistry::Limits limits{16, int64_t{1} << 30, 0};
  limits.max_pinned_bytes = 3 * 4096;
  RegionRegistry registry(limits, /*pin=*/true);
  // Every page reserved (fallocate), as the Python client's regions are:
  // page-locking allocates none on the daemon's account.
  auto open = [&](const std::string& owner, uint64_t size,
                  bool allocated = true) -> std::shared_ptr<const Region> {
    const int fd = ::memfd_create("r", MFD_CLOEXEC);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
    if (allocated) {
      EXPECT_EQ(::fallocate(fd, 0, 0, static_cast<off_t>(size)), 0);
    }
    absl::StatusOr<std::string> id = registry.Reserve(owner, size);
    EXPECT_TRUE(id.ok()) << id.status();
    absl::StatusOr<std::shared_ptr<const Region>> region = registry.Activate(*id, fd);
    EXPECT_TRUE(region.ok()) << region.status();
    return region.ok() ? *region : nullptr;
  };
  // One with pages nobody wrote is not page-locked, and takes no budget.
  std::shared_ptr<const Region> sparse = open("trainer", 3 * 4096, /*allocated=*/false);
  EXPECT_TRUE(sparse->pin_requested());
  EXPECT_FALSE(sparse->pinned());
  EXPECT_NE(sparse->pin_declined(), "");
  EXPECT_EQ(registry.totals().pin_budget_used_bytes, 0);
  std::shared_ptr<const Region> a = open("trainer", 2 * 4096);
  EXPECT_TRUE(a->pin_requested());
  EXPECT_EQ(a->pin_declined(), "");
  EXPECT_EQ(registry.totals().pin_budget_used_bytes, 2 * 4096);
  std::shared_ptr<const Region> b = open("other", 2 * 4096);  // 4 pages: past the budget
  EXPECT_FALSE(b->pin_requested());
  std::shared_ptr<const Region> c = open("other", 4096);  // 3 pages: fits
  EXPECT_TRUE(c->pin_requested());
  EXPECT_FALSE(open("trainer", 1)->pin_requested());
  // `a` unregistered while a refit (this reference) still reads it.
  registry.Release(a->id());
  EXPECT_FALSE(open("trainer", 4096)->pin_requested());
  EXPECT_THAT(registry.RenderMetrics(),
              HasSubstr("refitd_trainer_region_pin_budget_used_bytes 12288\n"));
  a.reset();  // the refit ended
  EXPECT_EQ(registry.totals().pin_budget_used_bytes, 4096);
  EXPECT_TRUE(open("trainer", 2 * 4096)->pin_requested());
  // A budget of none, and a daemon that does not pin at all.
  limits.max_pinned_bytes = 0;
  RegionRegistry none(limits, /*pin=*/true);
  absl::StatusOr<std::string> id = none.Reserve("trainer", 4096);
  ASSERT_TRUE(id.ok());
  const int fd = ::memfd_create("r", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  absl::StatusOr<std::shared_ptr<const Region>> region = none.Activate(*id, fd);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_FALSE((*region)->pin_requested());
  limits.max_pinned_bytes = -1;
  RegionRegistry unpinned(limits, /*pin=*/false);
  id = unpinned.Reserve("trainer", 4096);
  ASSERT_TRUE(id.ok());
  const int fd2 = ::memfd_create("r", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(fd2, 4096), 0);
  region = unpinned.Activate(*id, fd2);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_FALSE((*region)->pin_requested());
}

TEST_F(RegionTest, RegionTruncatedMidRefitFailsTheRefitAndTheLiveVersionStays) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(5);
  auto file = MakeRegionFile(tensors, /*seal=*/false);
  Lease lease(region_stub_.get(), file->size);
  const std::string id = lease.Register(file->fd);
  ASSERT_FALSE(id.empty());
  const v1::GetStatusResponse before = Status(stub_.get());

  std::vector<v1::PushRequest> chunks = RegionChunkMessages(tensors, *file, id, 4);
  ASSERT_GE(chunks.size(), 2u);
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  ASSERT_TRUE(writer->Write(BeginMessage()));
  ASSERT_TRUE(writer->Write(chunks[0]));
  writer->WaitForInitialMetadata();  // the refit began
  ASSERT_EQ(::ftruncate(file->fd, 0), 0);
  for (size_t i = 1; i < chunks.size(); ++i) {
    if (!writer->Write(chunks[i])) break;
  }
  writer->Write(EndMessage());
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("truncated while in use"));
  const v1::GetStatusResponse after = Status(stub_.get());
  EXPECT_EQ(after.version(), before.version());
  EXPECT_EQ(after.fingerprint(), before.fingerprint());
  EXPECT_FALSE(after.has_active_refit());
}

TEST_F(RegionTest, UnsealedRegionShrunkBeforeItsRowsAreQuantizedFailsAtPrepareAndIsRefusedAfter) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(6);
  auto file = MakeRegionFile(tensors, /*seal=*/false);
  Lease lease(region_stub_.get(), file->size);
  const std::string id = lease.Register(file->fd);
  ASSERT_FALSE(id.empty()) << lease.reply();
  const v1::GetStatusResponse before = Status(stub_.get());

  // Every tensor by reference but one half of a fused weight, sent with its
  // bytes after the file shrank: the other half's rows are aliased, not
  // copied, so the first read of the lost pages is the quantizer's, when
  // the layer completes. It reads zeros, and the refit fails at Prepare.
  const std::string held = "model.layers.1.mlp.up_proj.weight";
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  v1::PushRequest last;
  ASSERT_NO_FATAL_FAILURE(SendAllButHeld(writer.get(), tensors, *file, id, held, &last));
  ASSERT_EQ(::ftruncate(file->fd, 0), 0);
  ASSERT_TRUE(writer->Write(last));
  writer->Write(EndMessage());
  writer->WritesDone();
  // The region reads zeros now: a later push from it is refused at once,
  // even where the file is whole again.
  ExpectShrunkRegionFailedTheRefitAndIsRefused(writer->Finish(), id, before, tensors, *file);
}

TEST_F(RegionTest, UnsealedRegionFoundShorterAtPrepareFailsWhereNoReadFaulted) {
  // The file loses only a tail no chunk references: no read faults (what a
  // GPU store's DMA from page-locked pages looks like wherever the file
  // shrank), and the size check at Prepare still fails the refit.
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(7);
  auto file = MakeRegionFile(tensors, /*seal=*/false);
  const uint64_t used = file->size;
  file->size += 1 << 16;
  ASSERT_EQ(::ftruncate(file->fd, static_cast<off_t>(file->size)), 0);
  Lease lease(region_stub_.get(), file->size);
  const std::string id = lease.Register(file->fd);
  ASSERT_FALSE(id.empty()) << lease.reply();
  const v1::GetStatusResponse before = Status(stub_.get());

  std::vector<v1::PushRequest> chunks = RegionChunkMessages(tensors, *file, id, 4);
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  ASSERT_TRUE(writer->Write(BeginMessage()));
  ASSERT_TRUE(writer->Write(chunks[0]));
  writer->WaitForInitialMetadata();  // the refit began
  ASSERT_EQ(::ftruncate(file->fd, static_cast<off_t>(used)), 0);
  for (size_t i = 1; i < chunks.size(); ++i) ASSERT_TRUE(writer->Write(chunks[i]));
  writer->Write(EndMessage());
  writer->WritesDone();
  // Whole again, the region is still refused: pinned pages it dropped would
  // be read in place of the new ones.
  ExpectShrunkRegionFailedTheRefitAndIsRefused(writer->Finish(), id, before, tensors, *file);
}

TEST_F(RegionTest, UnregisterAndCancelledLeaseReleaseTheRegion) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(3);
  auto file = MakeRegionFile(tensors, true);
  {
    Lease lease(region_stub_.get(), file->size);
    const std::string id = lease.Register(file->fd);
    ASSERT_FALSE(id.empty());
    grpc::ClientContext context;
    v1::UnregisterRegionRequest request;
    request.set_region_id(id);
    v1::UnregisterRegionResponse response;
    ASSERT_TRUE(region_stub_->UnregisterRegion(&context, request, &response).ok());
    EXPECT_TRUE(lease.Finish().ok());  // the lease ends with OK
    EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_regions 0\n"));
    const PushOutcome outcome = PushRegion(tensors, *file, id);
    EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::NOT_FOUND);
  }
  Lease lease(region_stub_.get(), file->size);
  ASSERT_FALSE(lease.Register(file->fd).empty());
  EXPECT_THAT(MetricsText(), HasSubstr("refitd_trainer_regions 1\n"));
  lease.Cancel();
  EXPECT_EQ(lease.Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The daemon sees the cancel on its own time: wait for it, bounded.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string text = MetricsText();
  while (text.find("refitd_trainer_regions 0\n") == std::string::npos && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    text = MetricsText();
  }
  EXPECT_THAT(text, HasSubstr("refitd_trainer_regions 0\n"));
}

class RegionAuthTest : public RegionTest {
 protected:
  void SetUp() override {
    std::ofstream(dir_ + "/tokens") << "alice-token trainer alice\n"
                                       "bob-token trainer bob\n"
                                       "reader-token reader eve\n";
    ServerOptions options = TestOptions(dir_);
    options.auth_tokens_file = dir_ + "/tokens";
    Start(std::move(options));
  }
};

TEST_F(RegionAuthTest, AnotherCallersRegionIsPermissionDeniedAndReadersMayNotRegister) {
  const std::vector<core::OwnedTensor> tensors = FixtureWeights(3);
  auto file = MakeRegionFile(tensors, true);
  Lease lease(region_stub_.get(), file->size, "alice-token");
  const std::string id = lease.Register(file->fd);
  ASSERT_FALSE(id.empty()) << lease.reply();

  const PushOutcome outcome = PushRegion(tensors, *file, id, "bob-token");
  EXPECT_EQ(outcome.status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(outcome.status.error_message(), HasSubstr("belongs to another caller"));
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer bob-token");
  v1::UnregisterRegionRequest request;
  request.set_region_id(id);
  v1::UnregisterRegionResponse response;
  EXPECT_EQ(region_stub_->UnregisterRegion(&context, request, &response).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  EXPECT_TRUE(PushRegion(tensors, *file, id, "alice-token").status.ok());

  Lease reader(region_stub_.get(), 4096, "reader-token");
  v1::RegionTicket ticket;
  EXPECT_FALSE(reader.ReadTicket(&ticket));
  EXPECT_EQ(reader.Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

}  // namespace
}  // namespace refit::server::testing
