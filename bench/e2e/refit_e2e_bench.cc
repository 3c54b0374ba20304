// refit_e2e_bench: the real refitd and the real client library, as separate
// processes, against references measured in the same run.
//
// The harness is the trainer: it holds the model (read from a checkpoint
// directory made by refit_make_fixture) in its own anonymous memory and
// starts, as child processes,
//   refitd A  --quant per-tensor, --reload-root <shm dir>   (the subject)
//   refitd B  --quant none                                  (ingest-only)
//   refit_bench_sink  bare gRPC BareStream + raw Unix socket (references)
// All listen on Unix sockets. Each repetition runs, in a rotating order:
//   raw      the model's bytes over a raw Unix socket, chunk-sized reads (ceiling)
//   bare     a gRPC client stream of `bytes` messages of the same chunk size
//   push     RefitClient::Push to A with default options (32 MiB buckets,
//            XXH3 checksums): receive + FP8 quantize + finalize + commit
//   push_nocs  the same without checksums
//   ingest   RefitClient::Push to B with COMPLETION_MODE_PREPARE, then Abort:
//            receive + assemble, no quantization, no commit
//   push_tight  the same Push to refitd C, whose --staging-budget is 2 x the
//            largest layer (ingest waits for the quantizer instead of queueing)
//   reload   what a user would do instead: write the tensors as safetensors
//            files to /dev/shm, then A's Reload of that directory; timed whole
// A's peak RSS over its idle RSS is taken around every push (VmHWM reset via
// /proc/PID/clear_refs). Prints {"figures": [...], "series": {...}} on stdout.
//
// With --serve_pushes_to=ADDRESS it starts nothing: it loads the model, then
// for every line on stdin pushes it once to that daemon (default options, as
// `push` above) and answers one JSON line {"seconds", "cpu_seconds"} (this
// process's user + system time over the call): the C++ reference that
// bench/python/push_bench.py interleaves with the Python client's pushes.
//
// Links the client library and gRPC only (no LibTorch, no refit_core).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/core/bench_json.h"
#include "bench/e2e/bare_stream.grpc.pb.h"
#include "client/refit_client.h"
#include "client/safetensors_view.h"

ABSL_FLAG(std::string, refitd, "build-bench/bin/refitd", "the daemon binary");
ABSL_FLAG(std::string, sink, "build-bench/bench/refit_bench_sink", "the reference sink binary");
ABSL_FLAG(std::string, model_dir, "", "checkpoint directory (config.json + *.safetensors)");
ABSL_FLAG(std::string, workdir, "", "sockets and logs (default /tmp/refit-e2e-<pid>)");
ABSL_FLAG(std::string, shm_dir, "",
          "tmpfs directory for the Reload reference "
          "(default /dev/shm/refit-e2e-<pid>)");
ABSL_FLAG(int, reps, 3, "repetitions");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{32} << 20,
          "bytes per message (the client library's default bucket)");
ABSL_FLAG(int, startup_timeout_s, 180, "how long to wait for the daemons to become ready");
ABSL_FLAG(std::string, serve_pushes_to, "",
          "push the model to this daemon once per line on stdin, one JSON line each; no children");
ABSL_FLAG(
    bool, tight_budget, true,
    "also run refitd C (per-tensor, --staging-budget = 2 x the largest layer) and push to it");

namespace refit::bench {
namespace {

namespace rv1 = ::refit::v1;
using client::RefitClient;
using client::TensorRef;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "refit_e2e_bench: %s\n", what.c_str());
  std::exit(1);
}

// ---------------------------------------------------------------- processes

std::vector<pid_t>& Children() {
  static std::vector<pid_t> children;
  return children;
}

void StopAll() {
  for (pid_t pid : Children()) ::kill(pid, SIGTERM);
  for (pid_t pid : Children()) {
    for (int i = 0; i < 100; ++i) {
      if (::waitpid(pid, nullptr, WNOHANG) == pid) break;
      if (i == 99) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
      ::usleep(100 * 1000);
    }
  }
  Children().clear();
}

pid_t Spawn(const std::vector<std::string>& args, const std::string& log_path) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) Die(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(1);
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execv(argv[0], argv.data());
    std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  Children().push_back(pid);
  return pid;
}

bool Alive(pid_t pid) { return ::waitpid(pid, nullptr, WNOHANG) == 0; }

// -------------------------------------------------------------------- model

struct HostFile {
  std::string name;  // file name only
  std::vector<size_t> tensors;
};

struct HostModel {
  std::vector<uint8_t> storage;  // every tensor, back to back, in file order
  std::vector<TensorRef> tensors;
  std::vector<std::string> dtype_names;
  std::vector<HostFile> files;
  int64_t bytes = 0;
};

HostModel LoadModel(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> paths = client::ExpandSafetensorsPaths({dir});
  if (!paths.ok()) Die(paths.status().ToString());
  std::vector<std::unique_ptr<client::SafetensorsView>> views;
  HostModel m;
  for (const std::string& path : *paths) {
    absl::StatusOr<std::unique_ptr<client::SafetensorsView>> view =
        client::SafetensorsView::Open(path);
    if (!view.ok()) Die(view.status().ToString());
    for (const client::SafetensorsTensor& t : (*view)->tensors()) m.bytes += t.nbytes;
    views.push_back(*std::move(view));
  }
  // Anonymous memory the harness owns (a trainer's weights), pre-faulted.
  m.storage.resize(static_cast<size_t>(m.bytes));
  size_t at = 0;
  for (const auto& view : views) {
    HostFile file;
    file.name = view->path().substr(view->path().rfind('/') + 1);
    for (const client::SafetensorsTensor& t : view->tensors()) {
      absl::Status read = view->Read(t, 0, absl::MakeSpan(m.storage.data() + at, t.nbytes));
      if (!read.ok()) Die(read.ToString());
      file.tensors.push_back(m.tensors.size());
      m.tensors.push_back(TensorRef{t.name, t.dtype, t.shape,
                                    absl::MakeConstSpan(m.storage.data() + at, t.nbytes)});
      m.dtype_names.push_back(t.dtype_name);
      at += t.nbytes;
    }
    m.files.push_back(std::move(file));
  }
  return m;
}

bool WriteAll(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// The model as safetensors files under `dir` (the same split as the source
// checkpoint): header, then each tensor with one write() from memory.
void WriteSafetensorsDir(const HostModel& m, const std::string& dir) {
  ::mkdir(dir.c_str(), 0755);
  for (const HostFile& file : m.files) {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    uint64_t offset = 0;
    for (size_t i : file.tensors) {
      const TensorRef& t = m.tensors[i];
      header[t.name] = {{"dtype", m.dtype_names[i]},
                        {"shape", t.shape},
                        {"data_offsets", {offset, offset + t.data.size()}}};
      offset += t.data.size();
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    uint64_t len = text.size();
    const std::string path = dir + "/" + file.name;
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) Die(absl::StrCat("create ", path, ": ", std::strerror(errno)));
    bool ok = WriteAll(fd, reinterpret_cast<const uint8_t*>(&len), sizeof(len)) &&
              WriteAll(fd, reinterpret_cast<const uint8_t*>(text.data()), text.size());
    for (size_t i : file.tensors) {
      ok = ok && WriteAll(fd, m.tensors[i].data.data(), m.tensors[i].data.size());
    }
    if (::close(fd) != 0 || !ok) Die(absl::StrCat("write ", path, ": ", std::strerror(errno)));
  }
}

void RemoveDir(const HostModel& m, const std::string& dir) {
  for (const HostFile& file : m.files) ::unlink((dir + "/" + file.name).c_str());
  ::rmdir(dir.c_str());
}

// --------------------------------------------------------------- references

double RawSocket(const std::string& path, const HostModel& m, size_t chunk) {
  const double t0 = NowSeconds();
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int size = 4 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    Die(absl::StrCat("connect ", path, ": ", std::strerror(errno)));
  }
  uint64_t total = m.storage.size();
  bool ok = WriteAll(fd, reinterpret_cast<const uint8_t*>(&total), sizeof(total));
  for (size_t at = 0; ok && at < m.storage.size(); at += chunk) {
    ok = WriteAll(fd, m.storage.data() + at, std::min(chunk, m.storage.size() - at));
  }
  uint64_t ack = 0;
  ok = ok && ::read(fd, &ack, sizeof(ack)) == sizeof(ack) && ack == total;
  ::close(fd);
  if (!ok) Die("raw socket transfer failed");
  return NowSeconds() - t0;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

double BareGrpc(v1::BareStream::Stub* stub, const HostModel& m, size_t chunk) {
  const double t0 = NowSeconds();
  grpc::ClientContext context;
  v1::Ack ack;
  std::unique_ptr<grpc::ClientWriter<v1::Blob>> writer = stub->Send(&context, &ack);
  v1::Blob blob;
  bool ok = true;
  for (size_t at = 0; ok && at < m.storage.size(); at += chunk) {
    blob.set_data(m.storage.data() + at, std::min(chunk, m.storage.size() - at));
    ok = writer->Write(blob);
  }
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!ok || !status.ok() || ack.bytes() != m.storage.size()) {
    Die(absl::StrCat("bare gRPC stream failed: ", status.error_message()));
  }
  return NowSeconds() - t0;
}

// CPU seconds (user + system) a process has used so far.
double ProcCpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(text.substr(paren + 2));
  std::string field;
  double ticks = 0;
  // Fields 3.. after the name; utime and stime are fields 14 and 15.
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i >= 14) ticks += std::stod(field);
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

double SelfCpuSeconds() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  auto sec = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return sec(usage.ru_utime) + sec(usage.ru_stime);
}

// ------------------------------------------------------------------- refitd

std::unique_ptr<RefitClient> Connect(const std::string& socket) {
  client::ClientOptions options;
  options.address = "unix:" + socket;
  options.max_message_bytes = 256 << 20;
  absl::StatusOr<std::unique_ptr<RefitClient>> c = RefitClient::Create(options);
  if (!c.ok()) Die(c.status().ToString());
  return *std::move(c);
}

void WaitReady(RefitClient& c, pid_t pid, const std::string& what, const std::string& log) {
  const absl::Time deadline = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_startup_timeout_s));
  while (absl::Now() < deadline) {
    if (!Alive(pid)) Die(absl::StrCat(what, " exited during startup; see ", log));
    absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> s =
        c.HealthCheck(client::kReadinessService);
    if (s.ok() && *s == grpc::health::v1::HealthCheckResponse::SERVING) return;
    absl::SleepFor(absl::Milliseconds(200));
  }
  Die(absl::StrCat(what, " not ready after the startup timeout; see ", log));
}

struct PushRun {
  double seconds = 0;
  rv1::RefitResult result;
  int64_t idle_rss = 0;
  int64_t peak_rss = 0;
};

PushRun Push(RefitClient& c, pid_t pid, const HostModel& m, bool checksums, bool prepare_only,
             int streams = 1) {
  PushRun run;
  const std::string p = std::to_string(pid);
  ResetPeakRss(p);
  run.idle_rss = ProcStatusBytes(p, "VmRSS");
  client::PushOptions options;
  options.checksums = checksums;
  options.bucket_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_bytes));
  options.max_chunk_bytes = options.bucket_bytes;
  options.completion = prepare_only ? rv1::COMPLETION_MODE_PREPARE : rv1::COMPLETION_MODE_COMMIT;
  options.label = "refit_e2e_bench";
  options.streams = streams;
  const double t0 = NowSeconds();
  absl::StatusOr<rv1::RefitResult> result = c.Push(m.tensors, options);
  run.seconds = NowSeconds() - t0;
  run.peak_rss = ProcStatusBytes(p, "VmHWM");
  if (!result.ok()) Die(absl::StrCat("Push: ", result.status().ToString()));
  run.result = *result;
  if (prepare_only) {
    absl::StatusOr<rv1::AbortResponse> aborted =
        c.Abort("", result->refit_id(), "refit_e2e_bench: ingest only");
    if (!aborted.ok()) Die(absl::StrCat("Abort: ", aborted.status().ToString()));
  }
  return run;
}

struct ReloadRun {
  double write_s = 0;
  double reload_s = 0;
};

ReloadRun Reload(RefitClient& c, const HostModel& m, const std::string& dir) {
  ReloadRun run;
  const double t0 = NowSeconds();
  WriteSafetensorsDir(m, dir);
  const double t1 = NowSeconds();
  rv1::ReloadRequest request;
  request.set_path(dir);
  request.mutable_options()->set_completion(rv1::COMPLETION_MODE_COMMIT);
  request.mutable_options()->set_non_finite(rv1::NON_FINITE_POLICY_REJECT);
  request.mutable_options()->set_label("refit_e2e_bench reload");
  absl::StatusOr<rv1::RefitResult> result = c.Reload(request);
  const double t2 = NowSeconds();
  if (!result.ok()) Die(absl::StrCat("Reload: ", result.status().ToString()));
  RemoveDir(m, dir);
  run.write_s = t1 - t0;
  run.reload_s = t2 - t1;
  return run;
}

// --serve_pushes_to: the model stays loaded and the channel open between
// pushes, as in a trainer, so each answer is the Push alone.
int ServePushes(const std::string& model_dir, const std::string& address) {
  HostModel model = LoadModel(model_dir);
  client::ClientOptions options;
  options.address = address;
  options.max_message_bytes = 256 << 20;
  absl::StatusOr<std::unique_ptr<RefitClient>> c = RefitClient::Create(options);
  if (!c.ok()) Die(c.status().ToString());
  client::PushOptions push;
  push.bucket_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_bytes));
  push.max_chunk_bytes = push.bucket_bytes;
  push.label = "refit_e2e_bench serve_pushes";
  std::printf("{\"bytes\": %lld}\n", static_cast<long long>(model.bytes));
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    const double cpu0 = SelfCpuSeconds();
    const double t0 = NowSeconds();
    absl::StatusOr<rv1::RefitResult> result = (*c)->Push(model.tensors, push);
    const double seconds = NowSeconds() - t0;
    if (!result.ok()) Die(absl::StrCat("Push: ", result.status().ToString()));
    std::printf("{\"seconds\": %.9f, \"cpu_seconds\": %.6f, \"version\": %lld}\n", seconds,
                SelfCpuSeconds() - cpu0, static_cast<long long>(result->version()));
    std::fflush(stdout);
  }
  return 0;
}

int Run() {
  const std::string model_dir = absl::GetFlag(FLAGS_model_dir);
  if (model_dir.empty()) Die("--model-dir is required");
  if (!absl::GetFlag(FLAGS_serve_pushes_to).empty()) {
    return ServePushes(model_dir, absl::GetFlag(FLAGS_serve_pushes_to));
  }
  const std::string pid = std::to_string(::getpid());
  std::string workdir = absl::GetFlag(FLAGS_workdir);
  if (workdir.empty()) workdir = "/tmp/refit-e2e-" + pid;
  std::string shm = absl::GetFlag(FLAGS_shm_dir);
  if (shm.empty()) shm = "/dev/shm/refit-e2e-" + pid;
  ::mkdir(workdir.c_str(), 0755);
  ::mkdir(shm.c_str(), 0755);
  const size_t chunk = static_cast<size_t>(absl::GetFlag(FLAGS_chunk_bytes));
  const int reps = absl::GetFlag(FLAGS_reps);

  // Children first, before this process starts any gRPC thread.
  const std::string sock_a = workdir + "/refitd-a.sock";
  const std::string sock_b = workdir + "/refitd-b.sock";
  const std::string sock_bare = workdir + "/bare.sock";
  const std::string sock_raw = workdir + "/raw.sock";
  const std::string refitd = absl::GetFlag(FLAGS_refitd);
  const std::string max_chunk = std::to_string(std::max<size_t>(chunk, size_t{64} << 20));
  pid_t pid_a =
      Spawn({refitd, "--model=" + model_dir, "--listen=unix:" + sock_a, "--quant=per-tensor",
             "--reload-root=" + shm, "--max-chunk-bytes=" + max_chunk},
            workdir + "/refitd-a.log");
  pid_t pid_b = Spawn({refitd, "--model=" + model_dir, "--listen=unix:" + sock_b, "--quant=none",
                       "--max-chunk-bytes=" + max_chunk},
                      workdir + "/refitd-b.log");
  const std::string sink_limit = std::to_string(std::stoll(max_chunk) + (int64_t{1} << 20));
  pid_t pid_sink =
      Spawn({absl::GetFlag(FLAGS_sink), "--grpc=unix:" + sock_bare, "--raw=" + sock_raw,
             "--chunk_bytes=" + std::to_string(chunk), "--max_message_bytes=" + sink_limit},
            workdir + "/sink.log");
  std::atexit(StopAll);
  std::fprintf(stderr, "refit_e2e_bench: loading %s\n", model_dir.c_str());
  HostModel model = LoadModel(model_dir);

  std::unique_ptr<RefitClient> a = Connect(sock_a);
  std::unique_ptr<RefitClient> b = Connect(sock_b);
  WaitReady(*a, pid_a, "refitd A", workdir + "/refitd-a.log");
  WaitReady(*b, pid_b, "refitd B", workdir + "/refitd-b.log");
  for (int i = 0; i < 100 && ::access(sock_raw.c_str(), F_OK) != 0; ++i) ::usleep(50000);
  if (!Alive(pid_sink)) Die("the sink exited; see " + workdir + "/sink.log");
  auto bare_stub = v1::BareStream::NewStub(MakeChannel("unix:" + sock_bare));

  // Layout facts for the memory bound.
  absl::StatusOr<rv1::GetStatusResponse> status = a->GetStatus();
  if (!status.ok()) Die(status.status().ToString());
  const int64_t kernel_bytes = static_cast<int64_t>(status->memory().kernel_bytes());
  absl::StatusOr<rv1::ListTensorsResponse> listed =
      a->ListTensors("", rv1::ListTensorsRequest::LAYOUT_CHECKPOINT);
  if (!listed.ok()) Die(listed.status().ToString());
  std::map<std::string, int64_t> layer_bytes;
  for (const rv1::TensorInfo& t : listed->tensors())
    layer_bytes[t.layer()] += static_cast<int64_t>(t.nbytes());
  int64_t largest_layer = 0;
  for (const auto& [name, bytes] : layer_bytes) largest_layer = std::max(largest_layer, bytes);

  // refitd C: the same daemon with the staging budget at 2 x the largest layer.
  const bool tight = absl::GetFlag(FLAGS_tight_budget);
  const std::string sock_c = workdir + "/refitd-c.sock";
  pid_t pid_c = -1;
  std::unique_ptr<RefitClient> c;
  if (tight) {
    pid_c = Spawn(
        {refitd, "--model=" + model_dir, "--listen=unix:" + sock_c, "--quant=per-tensor",
         "--max-chunk-bytes=" + max_chunk, "--staging-budget=" + std::to_string(2 * largest_layer)},
        workdir + "/refitd-c.log");
    c = Connect(sock_c);
    WaitReady(*c, pid_c, "refitd C", workdir + "/refitd-c.log");
  }
  std::fprintf(stderr, "refit_e2e_bench: %lld bytes, %zu tensors, %d repetitions\n",
               static_cast<long long>(model.bytes), model.tensors.size(), reps);
  // Warm-up: one of each, unmeasured (connections, first-touch in the daemons).
  RawSocket(sock_raw, model, chunk);
  BareGrpc(bare_stub.get(), model, chunk);
  Push(*a, pid_a, model, true, false);
  Push(*b, pid_b, model, true, true);
  if (tight) Push(*c, pid_c, model, true, false);

  std::map<std::string, std::vector<double>> t, server_cpu, client_cpu;
  std::vector<PushRun> pushes, pushes_tight;
  std::vector<double> extra_rss_tight;
  std::vector<double> reload_write, reload_rpc, extra_rss, idle_rss;
  // push_s2, push_s4: the same full refit over 2 and 4 Push streams.
  std::vector<std::string> order = {"raw",    "bare",   "push",    "push_nocs",
                                    "ingest", "reload", "push_s2", "push_s4"};
  if (tight) order.push_back("push_tight");
  for (int r = 0; r < reps; ++r) {
    for (size_t k = 0; k < order.size(); ++k) {
      const std::string& what = order[(k + static_cast<size_t>(r)) % order.size()];
      const pid_t server = what == "raw" || what == "bare" ? pid_sink
                           : what == "ingest"              ? pid_b
                           : what == "push_tight"          ? pid_c
                                                           : pid_a;
      const double server_cpu0 = ProcCpuSeconds(server);
      const double client_cpu0 = SelfCpuSeconds();
      if (what == "raw") {
        t[what].push_back(RawSocket(sock_raw, model, chunk));
      } else if (what == "bare") {
        t[what].push_back(BareGrpc(bare_stub.get(), model, chunk));
      } else if (what == "push") {
        PushRun run = Push(*a, pid_a, model, true, false);
        t[what].push_back(run.seconds);
        extra_rss.push_back(static_cast<double>(run.peak_rss - run.idle_rss));
        idle_rss.push_back(static_cast<double>(run.idle_rss));
        pushes.push_back(run);
      } else if (what == "push_nocs") {
        t[what].push_back(Push(*a, pid_a, model, false, false).seconds);
      } else if (what == "push_tight") {
        PushRun run = Push(*c, pid_c, model, true, false);
        t[what].push_back(run.seconds);
        extra_rss_tight.push_back(static_cast<double>(run.peak_rss - run.idle_rss));
        pushes_tight.push_back(run);
      } else if (what == "ingest") {
        t[what].push_back(Push(*b, pid_b, model, true, true).seconds);
      } else if (what == "push_s2" || what == "push_s4") {
        t[what].push_back(Push(*a, pid_a, model, true, false, what == "push_s2" ? 2 : 4).seconds);
      } else {
        ReloadRun run = Reload(*a, model, shm + "/rep" + std::to_string(r));
        reload_write.push_back(run.write_s);
        reload_rpc.push_back(run.reload_s);
        t[what].push_back(run.write_s + run.reload_s);
      }
      server_cpu[what].push_back(ProcCpuSeconds(server) - server_cpu0);
      client_cpu[what].push_back(SelfCpuSeconds() - client_cpu0);
    }
    std::fprintf(stderr, "refit_e2e_bench: repetition %d done\n", r + 1);
  }
  StopAll();
  ::rmdir(shm.c_str());

  const double bytes = static_cast<double>(model.bytes);
  auto gbps = [&](const std::string& k) { return bytes / Median(t[k]) / 1e9; };
  const std::string size = absl::StrCat(static_cast<int64_t>(bytes / kMiB + 0.5), " MiB bf16");
  auto cpu = [&](const std::string& k) {
    const double gib = bytes / kGiB;
    return absl::StrCat("CPU s/GiB: receiver ", Median(server_cpu[k]) / gib, ", sender ",
                        Median(client_cpu[k]) / gib);
  };
  std::vector<Figure> figures;
  figures.push_back(MakeFigure("Push, full refit (FP8 per-tensor, commit, checksums), " + size,
                               gbps("push"), "GB/s", "bare gRPC client stream, same bytes & chunks",
                               gbps("bare"), gbps("push") / gbps("bare"), ">= 0.9",
                               absl::StrCat("push ", cpu("push"), "; bare ", cpu("bare"))));
  figures.push_back(MakeFigure(
      "Push, ingest only (quant none, prepare, checksums), " + size, gbps("ingest"), "GB/s",
      "bare gRPC client stream, same bytes & chunks", gbps("bare"), gbps("ingest") / gbps("bare"),
      ">= 0.9", absl::StrCat("ingest ", cpu("ingest"), "; bare ", cpu("bare"))));
  figures.push_back(MakeFigure("Push, full refit without checksums, " + size, gbps("push_nocs"),
                               "GB/s", "bare gRPC client stream, same bytes & chunks", gbps("bare"),
                               gbps("push_nocs") / gbps("bare"), ""));
  figures.push_back(MakeFigure("bare gRPC client stream, " + size, gbps("bare"), "GB/s",
                               "raw Unix socket (ceiling)", gbps("raw"), gbps("bare") / gbps("raw"),
                               ""));
  figures.push_back(MakeFigure("end-to-end refit over Push, " + size, gbps("push"), "GB/s",
                               "ingest-only Push (quant none, prepare)", gbps("ingest"),
                               gbps("push") / gbps("ingest"), ">= 0.8",
                               absl::StrCat("push ", cpu("push"), "; ingest ", cpu("ingest"))));
  for (const char* k : {"push_s2", "push_s4"}) {
    const bool two = std::string(k) == "push_s2";
    const std::string streams = two ? "2" : "4";
    const double gib = bytes / kGiB;
    figures.push_back(
        MakeFigure(absl::StrCat("Push, full refit over ", streams, " streams, ", size), gbps(k),
                   "GB/s", "the same Push over 1 stream", gbps("push"), gbps(k) / gbps("push"),
                   two ? ">= 1.0 (2 cores)" : ">= 2.5 (16 cores)",
                   absl::StrCat(k, " ", cpu(k), "; 1 stream ", cpu("push"))));
    const double v = Median(server_cpu[k]) / gib;
    const double one = Median(server_cpu["push"]) / gib;
    figures.push_back(MakeFigure(
        absl::StrCat("receiver CPU per GiB, refitd full refit Push over ", streams, " streams"), v,
        "CPU s/GiB", "the same over 1 stream", one, v / one, two ? "<= 1.1" : ""));
  }
  {
    const double gib = bytes / kGiB;
    const double bare_cpu = Median(server_cpu["bare"]) / gib;
    for (const char* k : {"ingest", "push"}) {
      const double v = Median(server_cpu[k]) / gib;
      figures.push_back(MakeFigure(
          absl::StrCat("receiver CPU per GiB, ", k == std::string("push")
                                                     ? "refitd full refit Push"
                                                     : "refitd ingest-only Push"),
          v, "CPU s/GiB", "bare gRPC sink", bare_cpu, v / bare_cpu, "",
          "user + system time of the receiving process over the call (robust to other load)"));
    }
  }
  const double bound = static_cast<double>(kernel_bytes + 2 * largest_layer) +
                       static_cast<double>(std::stoll(max_chunk));
  const double peak = *std::max_element(extra_rss.begin(), extra_rss.end());
  figures.push_back(MakeFigure(
      "refitd peak RSS over idle RSS during Push, " + size, peak / kMiB, "MiB",
      "kernel + 2 x largest layer + chunk budget", bound / kMiB, peak / bound, "<= 1.0",
      absl::StrCat("kernel ", kernel_bytes / kMiB, " MiB, largest layer ", largest_layer / kMiB,
                   " MiB, chunk budget (--max-chunk-bytes) ", std::stoll(max_chunk) / kMiB,
                   " MiB; idle RSS ", Median(idle_rss) / kMiB, " MiB")));
  // What the session itself holds at its peak: every staged kernel (until
  // commit) plus its peak high-precision staging. RSS over idle RSS can hide
  // part of it when the idle daemon still holds freed heap from the last refit.
  double staging_peak = 0;
  for (const PushRun& run : pushes) {
    staging_peak = std::max(staging_peak, static_cast<double>(run.result.peak_staging_bytes()));
  }
  figures.push_back(MakeFigure(
      "refit extra memory by session accounting (staged kernels + peak staging), " + size,
      (kernel_bytes + staging_peak) / kMiB, "MiB", "kernel + 2 x largest layer + chunk budget",
      bound / kMiB, (kernel_bytes + staging_peak) / bound, "<= 1.0",
      absl::StrCat("peak high-precision staging ", staging_peak / kMiB, " MiB = ",
                   staging_peak / std::max<double>(1.0, static_cast<double>(largest_layer)),
                   " x the largest layer")));
  if (tight) {
    const std::string budget =
        absl::StrCat("--staging-budget ", 2 * largest_layer / kMiB, " MiB (2 x largest layer)");
    figures.push_back(MakeFigure("Push, full refit, " + budget + ", " + size, gbps("push_tight"),
                                 "GB/s", "bare gRPC client stream, same bytes & chunks",
                                 gbps("bare"), gbps("push_tight") / gbps("bare"), ">= 0.9",
                                 absl::StrCat("push_tight ", cpu("push_tight"))));
    figures.push_back(MakeFigure("end-to-end refit over Push, " + budget + ", " + size,
                                 gbps("push_tight"), "GB/s",
                                 "ingest-only Push (quant none, prepare)", gbps("ingest"),
                                 gbps("push_tight") / gbps("ingest"), ">= 0.8"));
    const double peak_tight = *std::max_element(extra_rss_tight.begin(), extra_rss_tight.end());
    figures.push_back(
        MakeFigure("refitd peak RSS over idle RSS during Push, " + budget + ", " + size,
                   peak_tight / kMiB, "MiB", "kernel + 2 x largest layer + chunk budget",
                   bound / kMiB, peak_tight / bound, "<= 1.0"));
    double staging_tight = 0;
    for (const PushRun& run : pushes_tight) {
      staging_tight = std::max(staging_tight, static_cast<double>(run.result.peak_staging_bytes()));
    }
    figures.push_back(MakeFigure(
        "refit extra memory by session accounting, " + budget + ", " + size,
        (kernel_bytes + staging_tight) / kMiB, "MiB", "kernel + 2 x largest layer + chunk budget",
        bound / kMiB, (kernel_bytes + staging_tight) / bound, "<= 1.0",
        absl::StrCat("peak high-precision staging ", staging_tight / kMiB, " MiB")));
  }
  figures.push_back(MakeFigure(
      "Push, whole call, " + size, Median(t["push"]), "s", "write safetensors to /dev/shm + Reload",
      Median(t["reload"]), Median(t["push"]) / Median(t["reload"]), "",
      absl::StrCat("write ", Median(reload_write), " s + Reload ", Median(reload_rpc), " s")));

  nlohmann::json series;
  series["bytes"] = bytes;
  for (const auto& [k, v] : t) series["seconds"][k] = v;
  for (const auto& [k, v] : t) series["gbps"][k] = gbps(k);
  // CPU seconds per GiB moved, receiving process and sending process (the
  // harness). With 2 cores, wall time >= (server + client CPU) / 2.
  for (const auto& [k, v] : server_cpu) {
    series["server_cpu_s_per_gib"][k] = Median(v) / (bytes / kGiB);
    series["client_cpu_s_per_gib"][k] = Median(client_cpu[k]) / (bytes / kGiB);
  }
  series["reload_write_s"] = reload_write;
  series["reload_rpc_s"] = reload_rpc;
  series["extra_rss_bytes"] = extra_rss;
  nlohmann::json phases = nlohmann::json::array();
  for (const PushRun& run : pushes) {
    phases.push_back({{"receive_s", run.result.timings().receive_seconds()},
                      {"quantize_s", run.result.timings().quantize_seconds()},
                      {"finalize_s", run.result.timings().finalize_seconds()},
                      {"commit_s", run.result.timings().commit_seconds()},
                      {"peak_staging_bytes", run.result.peak_staging_bytes()}});
  }
  series["push_phases"] = phases;
  series["kernel_bytes"] = kernel_bytes;
  series["largest_layer_bytes"] = largest_layer;
  nlohmann::json out;
  out["figures"] = nlohmann::json::array();
  for (const Figure& f : figures) out["figures"].push_back(ToJson(f));
  out["series"] = series;
  std::printf("%s\n", out.dump(1).c_str());
  return 0;
}

}  // namespace
}  // namespace refit::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return refit::bench::Run();
}
