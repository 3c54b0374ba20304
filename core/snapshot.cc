#include "core/snapshot.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/xxh3.h"

namespace refit::core {
namespace {

constexpr char kMagic[] = "refit-snapshot";
constexpr char kFormat[] = "v1";
constexpr char kPrefix[] = "snapshot-";
constexpr char kSuffix[] = ".refit";
constexpr char kTmpSuffix[] = ".refit.tmp";
constexpr char kRejectedSuffix[] = ".rejected";
constexpr char kVersionFile[] = "version";
// A manifest is about 100 bytes per kernel; anything near this is not one.
constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;
constexpr size_t kWriteChunk = size_t{8} << 20;

std::string Hex(uint64_t v) { return absl::StrFormat("%016x", v); }

bool ParseHex(absl::string_view text, uint64_t* out) {
  if (text.size() != 16) return false;
  return absl::SimpleHexAtoi(text, out);
}

std::string Errno() { return std::strerror(errno); }

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int Close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return absl::InternalError(absl::StrCat(path, ": write: ", Errno()));
    data += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status ReadAt(int fd, char* data, size_t n, int64_t offset, const std::string& path) {
  while (n > 0) {
    ssize_t r = ::pread(fd, data, n, offset);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::InternalError(absl::StrCat(path, ": read: ", Errno()));
    if (r == 0) return absl::DataLossError(absl::StrCat(path, ": ends early (torn snapshot)"));
    data += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return absl::InternalError(absl::StrCat(dir, ": open: ", Errno()));
  if (::fsync(fd.get()) != 0) return absl::InternalError(absl::StrCat(dir, ": fsync: ", Errno()));
  return absl::OkStatus();
}

absl::Status MakeDir(const std::string& dir) {
  // mkdir -p, one component at a time.
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::InternalError(
          absl::StrCat("state dir ", dir, ": cannot create ", prefix, ": ", Errno()));
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InternalError(absl::StrCat("state dir ", dir, " is not a directory"));
  }
  return absl::OkStatus();
}

// Writes `text` to dir/name through a temporary name, fsynced and renamed.
absl::Status ReplaceFile(const std::string& dir, const std::string& name, absl::string_view text) {
  const std::string path = absl::StrCat(dir, "/", name);
  const std::string tmp = absl::StrCat(dir, "/.", name, ".tmp");
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return absl::InternalError(absl::StrCat(tmp, ": create: ", Errno()));
  absl::Status s = WriteAll(fd.get(), text.data(), text.size(), tmp);
  if (s.ok() && ::fsync(fd.get()) != 0)
    s = absl::InternalError(absl::StrCat(tmp, ": fsync: ", Errno()));
  if (s.ok() && fd.Close() != 0) s = absl::InternalError(absl::StrCat(tmp, ": close: ", Errno()));
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = absl::InternalError(absl::StrCat(tmp, ": rename to ", path, ": ", Errno()));
  }
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return FsyncDir(dir);
}

struct DirEntries {
  std::vector<std::pair<uint64_t, std::string>> snapshots;  // complete, by version
  std::vector<std::pair<uint64_t, std::string>> temporaries;
  std::vector<std::pair<uint64_t, std::string>> rejected;
};

// The version in "snapshot-<v>.refit" style names (with `suffix`).
bool VersionOf(absl::string_view name, absl::string_view prefix, absl::string_view suffix,
               uint64_t* version) {
  if (!absl::ConsumePrefix(&name, prefix) || !absl::ConsumeSuffix(&name, suffix)) return false;
  return !name.empty() && absl::SimpleAtoi(name, version);
}

absl::StatusOr<DirEntries> ListDir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return absl::InternalError(absl::StrCat("state dir ", dir, ": ", Errno()));
  DirEntries entries;
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const std::string path = absl::StrCat(dir, "/", name);
    uint64_t v = 0;
    if (VersionOf(name, kPrefix, kSuffix, &v)) {
      entries.snapshots.emplace_back(v, path);
    } else if (VersionOf(name, absl::StrCat(".", kPrefix), kTmpSuffix, &v)) {
      entries.temporaries.emplace_back(v, path);
    } else if (VersionOf(name, kPrefix, absl::StrCat(kSuffix, kRejectedSuffix), &v)) {
      entries.rejected.emplace_back(v, path);
    }
  }
  ::closedir(d);
  std::sort(entries.snapshots.begin(), entries.snapshots.end());
  return entries;
}

std::string ManifestText(const SnapshotManifest& m) {
  std::string out;
  absl::StrAppend(&out, "group ", absl::CEscape(m.group), "\n");
  absl::StrAppend(&out, "version ", m.version, "\n");
  absl::StrAppend(&out, "fingerprint ", m.fingerprint, "\n");
  absl::StrAppend(&out, "layout_fingerprint ", m.layout_fingerprint, "\n");
  absl::StrAppend(&out, "refit_id ", absl::CEscape(m.refit_id), "\n");
  absl::StrAppend(&out, "label ", absl::CEscape(m.label), "\n");
  absl::StrAppend(&out, "time ", absl::FormatTime(absl::RFC3339_full, m.time, absl::UTCTimeZone()),
                  "\n");
  absl::StrAppend(&out, "kernel_bytes ", m.kernel_bytes, "\n");
  absl::StrAppend(&out, "kernels ", m.kernels.size(), "\n");
  for (const SnapshotKernel& k : m.kernels) {
    absl::StrAppend(&out, "kernel ", absl::CEscape(k.name), " ", k.nbytes, " ", Hex(k.hash), "\n");
  }
  return out;
}

absl::StatusOr<SnapshotManifest> ParseManifest(absl::string_view text, const std::string& path) {
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(path, ": manifest: ", what));
  };
  SnapshotManifest m;
  int64_t declared_kernels = -1;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(line, absl::MaxSplits(' ', 1));
    const absl::string_view key = kv.first, value = kv.second;
    std::string unescaped;
    if (key == "group" || key == "refit_id" || key == "label") {
      if (!absl::CUnescape(value, &unescaped)) return bad(absl::StrCat("bad ", key));
      (key == "group" ? m.group : key == "refit_id" ? m.refit_id : m.label) = unescaped;
    } else if (key == "version") {
      if (!absl::SimpleAtoi(value, &m.version)) return bad("bad version");
    } else if (key == "fingerprint") {
      m.fingerprint = std::string(value);
    } else if (key == "layout_fingerprint") {
      m.layout_fingerprint = std::string(value);
    } else if (key == "time") {
      std::string error;
      if (!absl::ParseTime(absl::RFC3339_full, value, &m.time, &error)) return bad("bad time");
    } else if (key == "kernel_bytes") {
      if (!absl::SimpleAtoi(value, &m.kernel_bytes) || m.kernel_bytes < 0) {
        return bad("bad kernel_bytes");
      }
    } else if (key == "kernels") {
      if (!absl::SimpleAtoi(value, &declared_kernels)) return bad("bad kernels");
    } else if (key == "kernel") {
      std::vector<absl::string_view> parts = absl::StrSplit(value, ' ');
      SnapshotKernel k;
      if (parts.size() != 3 || !absl::CUnescape(parts[0], &k.name) ||
          !absl::SimpleAtoi(parts[1], &k.nbytes) || !ParseHex(parts[2], &k.hash)) {
        return bad(absl::StrCat("bad kernel line \"", absl::CHexEscape(line.substr(0, 200)), "\""));
      }
      m.kernels.push_back(std::move(k));
    }  // unknown keys: written by a newer version, ignored
  }
  if (m.version == 0) return bad("no version");
  if (declared_kernels != static_cast<int64_t>(m.kernels.size())) {
    return bad(absl::StrCat(m.kernels.size(), " kernel lines, header says ", declared_kernels));
  }
  int64_t sum = 0;
  for (const SnapshotKernel& k : m.kernels) sum += k.nbytes;
  if (sum != m.kernel_bytes) {
    return bad(
        absl::StrCat("kernels add up to ", sum, " bytes, kernel_bytes says ", m.kernel_bytes));
  }
  return m;
}

struct OpenedSnapshot {
  SnapshotManifest manifest;
  int64_t data_offset = 0;
};

absl::StatusOr<OpenedSnapshot> OpenSnapshot(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat(path, ": stat: ", Errno()));
  const int64_t size = st.st_size;
  // The header line: "refit-snapshot v1 <manifest bytes> <hash>\n", < 128 bytes.
  char head[128];
  const size_t head_n = static_cast<size_t>(std::min<int64_t>(size, sizeof(head)));
  if (absl::Status s = ReadAt(fd, head, head_n, 0, path); !s.ok()) return s;
  absl::string_view head_text(head, head_n);
  const size_t eol = head_text.find('\n');
  if (eol == absl::string_view::npos) {
    return absl::DataLossError(absl::StrCat(path, ": no snapshot header (", size, " bytes)"));
  }
  std::vector<absl::string_view> fields = absl::StrSplit(head_text.substr(0, eol), ' ');
  int64_t manifest_bytes = 0;
  uint64_t manifest_hash = 0;
  if (fields.size() != 4 || fields[0] != kMagic || fields[1] != kFormat ||
      !absl::SimpleAtoi(fields[2], &manifest_bytes) || manifest_bytes <= 0 ||
      manifest_bytes > kMaxManifestBytes || !ParseHex(fields[3], &manifest_hash)) {
    return absl::DataLossError(absl::StrCat(path, ": unreadable snapshot header \"",
                                            absl::CHexEscape(head_text.substr(0, eol)), "\""));
  }
  const int64_t manifest_offset = static_cast<int64_t>(eol) + 1;
  if (manifest_offset + manifest_bytes > size) {
    return absl::DataLossError(absl::StrCat(path, ": torn snapshot: ", size,
                                            " bytes, the manifest alone needs ",
                                            manifest_offset + manifest_bytes));
  }
  std::string text(static_cast<size_t>(manifest_bytes), '\0');
  if (absl::Status s = ReadAt(fd, text.data(), text.size(), manifest_offset, path); !s.ok()) {
    return s;
  }
  const uint64_t got = XXH3_64bits(text.data(), text.size());
  if (got != manifest_hash) {
    return absl::DataLossError(absl::StrCat(path, ": manifest checksum mismatch: XXH3 ", Hex(got),
                                            ", header says ", Hex(manifest_hash)));
  }
  absl::StatusOr<SnapshotManifest> manifest = ParseManifest(text, path);
  if (!manifest.ok()) return manifest.status();
  OpenedSnapshot opened;
  opened.data_offset = manifest_offset + manifest_bytes;
  const int64_t expected = opened.data_offset + manifest->kernel_bytes;
  if (size != expected) {
    return absl::DataLossError(absl::StrCat(path, ": torn snapshot: ", size, " bytes, expected ",
                                            expected, " (manifest of version ", manifest->version,
                                            ")"));
  }
  opened.manifest = *std::move(manifest);
  return opened;
}

}  // namespace

std::string LayoutFingerprint(const ModelLayout& layout) {
  const ModelConfig& c = layout.config();
  std::string text = absl::StrCat(
      "arch=", c.arch_name, ";hidden=", c.hidden_size, ";intermediate=", c.intermediate_size,
      ";layers=", c.num_layers, ";heads=", c.num_heads, ";kv_heads=", c.num_kv_heads,
      ";head_dim=", c.head_dim, ";vocab=", c.vocab_size, ";tie=", c.tie_word_embeddings,
      ";bias=", c.attention_bias, ";dtype=", DTypeName(c.dtype), ";experts=", c.num_experts,
      ";tp=", layout.parallel().tp_rank, "/", layout.parallel().tp_size,
      ";quant=", QuantSchemeName(layout.quant()), ";");
  for (const LayerSpec& l : layout.layers()) {
    for (const KernelSpec& k : l.kernels) {
      absl::StrAppend(&text, k.name, ":", DTypeName(k.dtype), ":");
      for (int64_t d : k.shape) absl::StrAppend(&text, d, ",");
      absl::StrAppend(&text, ";");
    }
  }
  return Hex(XXH3_64bits(text.data(), text.size()));
}

std::string SnapshotFileName(uint64_t version) {
  return absl::StrFormat("%s%020u%s", kPrefix, version, kSuffix);
}

SnapshotManifest ManifestFor(const ShardStore& store, const ShardStore::KernelCopy& copy,
                             std::string refit_id, std::string label) {
  SnapshotManifest m;
  m.group = store.group();
  m.version = copy.version;
  m.fingerprint = copy.fingerprint;
  m.layout_fingerprint = LayoutFingerprint(store.layout());
  m.refit_id = std::move(refit_id);
  m.label = std::move(label);
  m.time = copy.commit_time;
  size_t i = 0;
  for (const LayerSpec& l : store.layout().layers()) {
    for (const KernelSpec& k : l.kernels) {
      m.kernels.push_back({k.name, k.nbytes(), i < copy.hashes.size() ? copy.hashes[i] : 0});
      m.kernel_bytes += k.nbytes();
      ++i;
    }
  }
  return m;
}

absl::StatusOr<std::string> WriteSnapshot(const std::string& dir, const SnapshotManifest& manifest,
                                          absl::Span<const char> bytes,
                                          const SnapshotWriteHooks& hooks) {
  if (static_cast<int64_t>(bytes.size()) != manifest.kernel_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("snapshot of ", manifest.kernel_bytes, " kernel bytes given ", bytes.size()));
  }
  const std::string text = ManifestText(manifest);
  const std::string header = absl::StrCat(kMagic, " ", kFormat, " ", text.size(), " ",
                                          Hex(XXH3_64bits(text.data(), text.size())), "\n");
  const std::string path = absl::StrCat(dir, "/", SnapshotFileName(manifest.version));
  const std::string tmp =
      absl::StrCat(dir, "/.", kPrefix, absl::StrFormat("%020u", manifest.version), kTmpSuffix);
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return absl::InternalError(absl::StrCat(tmp, ": create: ", Errno()));
  absl::Status s = WriteAll(fd.get(), header.data(), header.size(), tmp);
  if (s.ok()) s = WriteAll(fd.get(), text.data(), text.size(), tmp);
  int64_t written = static_cast<int64_t>(header.size() + text.size());
  for (size_t done = 0; s.ok() && done < bytes.size();) {
    size_t n = std::min(kWriteChunk, bytes.size() - done);
    if (hooks.pause_after_bytes >= 0 && written < hooks.pause_after_bytes) {
      n = std::min<size_t>(n, static_cast<size_t>(hooks.pause_after_bytes - written));
    }
    s = WriteAll(fd.get(), bytes.data() + done, n, tmp);
    done += n;
    written += static_cast<int64_t>(n);
    if (s.ok() && hooks.pause_after_bytes >= 0 && written >= hooks.pause_after_bytes &&
        done < bytes.size()) {
      ::fdatasync(fd.get());  // so a test that kills the process sees the part on disk
      REFIT_LOG(WARNING)
              .Field("file", tmp)
              .Field("bytes", absl::StrCat(written))
              .Field("version", absl::StrCat(manifest.version))
          << "snapshot write paused (test hook)";
      while (!(hooks.cancelled && hooks.cancelled())) absl::SleepFor(absl::Milliseconds(20));
      s = absl::CancelledError(absl::StrCat(tmp, ": snapshot write cancelled while paused"));
    }
  }
  // fsync before rename: otherwise a crash can leave the new name pointing at
  // a file whose data never reached the disk.
  if (s.ok() && ::fsync(fd.get()) != 0)
    s = absl::InternalError(absl::StrCat(tmp, ": fsync: ", Errno()));
  if (s.ok() && fd.Close() != 0) s = absl::InternalError(absl::StrCat(tmp, ": close: ", Errno()));
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    s = absl::InternalError(absl::StrCat(tmp, ": rename to ", path, ": ", Errno()));
  }
  if (s.ok()) s = FsyncDir(dir);
  if (!s.ok()) {
    if (!absl::IsCancelled(s)) ::unlink(tmp.c_str());
    return s;
  }
  return path;
}

absl::StatusOr<SnapshotManifest> ReadSnapshotManifest(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such snapshot"));
    return absl::InternalError(absl::StrCat(path, ": open: ", Errno()));
  }
  absl::StatusOr<OpenedSnapshot> opened = OpenSnapshot(fd.get(), path);
  if (!opened.ok()) return opened.status();
  return std::move(opened->manifest);
}

namespace {

// A snapshot whose manifest matches the layout, ready for its kernel bytes.
struct CheckedSnapshot {
  OpenedSnapshot opened;
  std::vector<const KernelSpec*> specs;  // layout order, one per manifest kernel
  std::vector<int64_t> offsets;          // of each kernel in the kernel bytes, and the end
};

absl::StatusOr<CheckedSnapshot> OpenAndCheck(int fd, const std::string& path,
                                             const ModelLayout& layout) {
  absl::StatusOr<OpenedSnapshot> opened = OpenSnapshot(fd, path);
  if (!opened.ok()) return opened.status();
  const SnapshotManifest& m = opened->manifest;
  const std::string layout_fingerprint = LayoutFingerprint(layout);
  if (m.layout_fingerprint != layout_fingerprint) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": snapshot of another model layout (layout fingerprint ",
                     m.layout_fingerprint, ", the configured model's ", layout_fingerprint, ")"));
  }
  CheckedSnapshot checked;
  for (const LayerSpec& l : layout.layers()) {
    for (const KernelSpec& k : l.kernels) checked.specs.push_back(&k);
  }
  const std::vector<const KernelSpec*>& specs = checked.specs;
  if (specs.size() != m.kernels.size()) {
    return absl::DataLossError(absl::StrCat(
        path, ": ", m.kernels.size(), " kernels in the manifest, the layout has ", specs.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i]->name != m.kernels[i].name || specs[i]->nbytes() != m.kernels[i].nbytes) {
      return absl::DataLossError(absl::StrCat(path, ": manifest kernel ", i, " is \"",
                                              absl::CHexEscape(m.kernels[i].name), "\" (",
                                              m.kernels[i].nbytes, " bytes), the layout's \"",
                                              specs[i]->name, "\" (", specs[i]->nbytes(), ")"));
    }
  }
  checked.offsets.assign(specs.size() + 1, 0);
  for (size_t i = 0; i < specs.size(); ++i) {
    checked.offsets[i + 1] = checked.offsets[i] + m.kernels[i].nbytes;
  }
  checked.opened = *std::move(opened);
  return checked;
}

// Hashed as read: a piece is hashed while it is still in the cache.
constexpr size_t kReadPiece = size_t{1} << 20;

// Reads kernel `i` into host memory at `at`, hashing it piece by piece.
absl::StatusOr<uint64_t> ReadAndHash(int fd, const std::string& path, const CheckedSnapshot& c,
                                     size_t i, char* at) {
  const int64_t base = c.opened.data_offset + c.offsets[i];
  const size_t n = static_cast<size_t>(c.offsets[i + 1] - c.offsets[i]);
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(),
                                                                        &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  for (size_t done = 0; done < n;) {
    const size_t piece = std::min(kReadPiece, n - done);
    if (absl::Status s = ReadAt(fd, at + done, piece, base + static_cast<int64_t>(done), path);
        !s.ok()) {
      return s;
    }
    XXH3_64bits_update(state.get(), at + done, piece);
    done += piece;
  }
  return XXH3_64bits_digest(state.get());
}

// GPU store: kernel `i` through the target's bounce buffer, hashed on the
// host copy, uploaded piece by piece.
absl::StatusOr<uint64_t> ReadHashAndUpload(int fd, const std::string& path,
                                           const CheckedSnapshot& c, size_t i,
                                           const RestoreTarget& target) {
  const absl::Span<char> bounce = target.bounce();
  const int64_t base = c.opened.data_offset + c.offsets[i];
  const size_t n = static_cast<size_t>(c.offsets[i + 1] - c.offsets[i]);
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> state(XXH3_createState(),
                                                                        &XXH3_freeState);
  XXH3_64bits_reset(state.get());
  for (size_t done = 0; done < n;) {
    const size_t piece = std::min(bounce.size(), n - done);
    if (absl::Status s = ReadAt(fd, bounce.data(), piece, base + static_cast<int64_t>(done), path);
        !s.ok()) {
      return s;
    }
    XXH3_64bits_update(state.get(), bounce.data(), piece);
    if (absl::Status s = target.Upload(static_cast<int>(i), static_cast<int64_t>(done),
                                       bounce.data(), static_cast<int64_t>(piece));
        !s.ok()) {
      return s;
    }
    done += piece;
  }
  return XXH3_64bits_digest(state.get());
}

// Reads every kernel of `c` into `target` and verifies each against the
// manifest's XXH3 and the whole against its fingerprint; returns the hashes.
// DATA_LOSS naming the first kernel that does not match, or the fingerprint.
absl::StatusOr<std::vector<uint64_t>> ReadKernels(int fd, const std::string& path,
                                                  const CheckedSnapshot& c,
                                                  const RestoreTarget& target) {
  const SnapshotManifest& m = c.opened.manifest;
  const size_t count = c.specs.size();
  std::vector<uint64_t> hashes(count, XXH3_64bits(nullptr, 0));
  const bool host = count == 0 || m.kernel_bytes == 0 || target.bounce().empty();
  // Host memory: read and hash on several threads (both bound by memory
  // bandwidth; the restore is on the start's critical path). A GPU store's
  // one bounce buffer takes one piece at a time.
  const int64_t kPerThread = int64_t{64} << 20;
  const size_t threads =
      !host
          ? 1
          : static_cast<size_t>(std::clamp<int64_t>(m.kernel_bytes / kPerThread, 1, BulkThreads()));
  std::vector<absl::Status> read_status(threads);
  auto work = [&](size_t t) {
    // Kernels whose first byte falls in this thread's share of the bytes.
    const int64_t lo = m.kernel_bytes * static_cast<int64_t>(t) / static_cast<int64_t>(threads);
    const int64_t hi = m.kernel_bytes * static_cast<int64_t>(t + 1) / static_cast<int64_t>(threads);
    for (size_t i = 0; i < count; ++i) {
      if (c.offsets[i] < lo || c.offsets[i] >= hi || m.kernels[i].nbytes == 0) continue;
      absl::StatusOr<uint64_t> h =
          host ? ReadAndHash(fd, path, c, i, target.host_data(static_cast<int>(i)))
               : ReadHashAndUpload(fd, path, c, i, target);
      if (!h.ok()) {
        read_status[t] = h.status();
        return;
      }
      hashes[i] = *h;
      // Stop at the first damaged kernel: the whole snapshot is rejected.
      if (hashes[i] != m.kernels[i].hash) return;
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (std::thread& th : pool) th.join();
  for (const absl::Status& s : read_status) {
    if (!s.ok()) return s;
  }
  for (size_t i = 0; i < count; ++i) {
    if (hashes[i] != m.kernels[i].hash) {
      return absl::DataLossError(absl::StrCat(
          path, ": kernel ", c.specs[i]->name, " does not match its checksum (bytes at offset ",
          c.opened.data_offset + c.offsets[i], ": XXH3 ", Hex(hashes[i]), ", manifest ",
          Hex(m.kernels[i].hash), ")"));
    }
  }
  const std::string fingerprint = KernelFingerprint(c.specs, hashes);
  if (fingerprint != m.fingerprint) {
    return absl::DataLossError(absl::StrCat(path, ": fingerprint of the bytes ", fingerprint,
                                            ", manifest ", m.fingerprint));
  }
  return hashes;
}

// ReadSnapshot's target: one host buffer, the kernels back to back.
class BufferTarget : public RestoreTarget {
 public:
  BufferTarget(char* bytes, const std::vector<int64_t>& offsets)
      : bytes_(bytes), offsets_(offsets) {}
  char* host_data(int kernel) const override {
    return bytes_ + offsets_[static_cast<size_t>(kernel)];
  }
  absl::Span<char> bounce() const override { return {}; }
  absl::Status Upload(int, int64_t, const char*, int64_t) const override {
    return absl::InternalError("upload into a host buffer");
  }

 private:
  char* bytes_;
  const std::vector<int64_t>& offsets_;
};

absl::StatusOr<int> OpenForRead(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such snapshot"));
    return absl::InternalError(absl::StrCat(path, ": open: ", Errno()));
  }
  return fd;
}

}  // namespace

absl::StatusOr<SnapshotManifest> ReadSnapshot(const std::string& path, const ModelLayout& layout,
                                              std::unique_ptr<char[]>* bytes) {
  absl::StatusOr<int> opened = OpenForRead(path);
  if (!opened.ok()) return opened.status();
  Fd fd(*opened);
  absl::StatusOr<CheckedSnapshot> checked = OpenAndCheck(fd.get(), path, layout);
  if (!checked.ok()) return checked.status();
  const int64_t kernel_bytes = checked->opened.manifest.kernel_bytes;
  bytes->reset(new char[static_cast<size_t>(std::max<int64_t>(kernel_bytes, 1))]);
  absl::StatusOr<std::vector<uint64_t>> hashes =
      ReadKernels(fd.get(), path, *checked, BufferTarget(bytes->get(), checked->offsets));
  if (!hashes.ok()) return hashes.status();
  return std::move(checked->opened.manifest);
}

absl::StatusOr<uint64_t> ReadVersionRecord(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kVersionFile);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return 0;
    return absl::InternalError(absl::StrCat(path, ": open: ", Errno()));
  }
  char buf[64];
  ssize_t n = ::read(fd.get(), buf, sizeof(buf));
  if (n < 0) return absl::InternalError(absl::StrCat(path, ": read: ", Errno()));
  absl::string_view text(buf, static_cast<size_t>(n));
  uint64_t version = 0;
  if (!absl::ConsumePrefix(&text, "highest_version ") || !absl::ConsumeSuffix(&text, "\n") ||
      !absl::SimpleAtoi(text, &version)) {
    return absl::DataLossError(absl::StrCat(path, ": not a version record"));
  }
  return version;
}

absl::Status WriteVersionRecord(const std::string& dir, uint64_t version) {
  return ReplaceFile(dir, kVersionFile, absl::StrCat("highest_version ", version, "\n"));
}

absl::StatusOr<RecoveryPolicy> ParseRecoveryPolicy(absl::string_view name) {
  if (name == "fallback") return RecoveryPolicy::kFallback;
  if (name == "fail") return RecoveryPolicy::kFail;
  return absl::InvalidArgumentError(
      absl::StrCat("--state-recovery \"", name, "\": use fallback or fail"));
}

absl::StatusOr<RecoveryResult> RecoverFromSnapshots(ShardStore* store, const std::string& dir,
                                                    RecoveryPolicy policy) {
  if (absl::Status s = MakeDir(dir); !s.ok()) return s;
  absl::StatusOr<DirEntries> entries = ListDir(dir);
  if (!entries.ok()) return entries.status();
  RecoveryResult result;
  absl::StatusOr<uint64_t> recorded = ReadVersionRecord(dir);
  if (recorded.ok()) {
    result.highest_version = *recorded;
  } else {
    REFIT_LOG(ERROR).Field("state_dir", dir)
        << "version record unreadable (" << recorded.status().ToString()
        << "); numbering from the snapshot file names";
  }
  for (const auto& [v, path] : entries->temporaries) {
    result.highest_version = std::max(result.highest_version, v);
    REFIT_LOG(WARNING).Field("file", path).Field("version", absl::StrCat(v))
        << "removing the partial snapshot of an interrupted write";
    ::unlink(path.c_str());
  }
  for (const auto& [v, path] : entries->rejected) {
    result.highest_version = std::max(result.highest_version, v);
  }
  for (const auto& [v, path] : entries->snapshots) {
    result.highest_version = std::max(result.highest_version, v);
  }
  for (auto it = entries->snapshots.rbegin(); it != entries->snapshots.rend(); ++it) {
    const std::string& path = it->second;
    const absl::Time start = absl::Now();
    // The manifest first; then the kernel bytes straight into the live
    // tensors of the store, which serves nothing yet: RestoreInPlace zeroes
    // them again if a kernel or the fingerprint does not verify.
    absl::StatusOr<int> opened = OpenForRead(path);
    std::optional<Fd> fd;
    absl::StatusOr<CheckedSnapshot> checked = absl::UnknownError("not opened");
    if (opened.ok()) {
      fd.emplace(*opened);
      checked = OpenAndCheck(fd->get(), path, store->layout());
    } else {
      checked = opened.status();
    }
    if (checked.ok() && checked->opened.manifest.group != store->group()) {
      checked = absl::FailedPreconditionError(absl::StrCat(path, ": snapshot of group \"",
                                                           checked->opened.manifest.group,
                                                           "\", not \"", store->group(), "\""));
    }
    absl::Status verified = checked.status();
    absl::StatusOr<CommitStats> restored = absl::UnknownError("not restored");
    if (checked.ok()) {
      const SnapshotManifest& m = checked->opened.manifest;
      absl::StatusOr<RefitSlot> slot = store->AcquireRefitSlot(absl::StrCat("restore-", m.version));
      if (!slot.ok()) return slot.status();
      restored = slot->RestoreInPlace(m.version, [&](const RestoreTarget& target) {
        absl::StatusOr<std::vector<uint64_t>> hashes =
            ReadKernels(fd->get(), path, *checked, target);
        verified = hashes.status();
        return hashes;
      });
      // An error of the restore itself, not of the snapshot's bytes.
      if (!restored.ok() && verified.ok()) return restored.status();
    }
    if (absl::IsFailedPrecondition(verified)) {
      REFIT_LOG(WARNING).Field("file", path) << "skipping snapshot: " << verified.message();
      result.rejected.push_back(std::string(verified.message()));
      continue;
    }
    if (!verified.ok()) {
      REFIT_LOG(ERROR).Field("file", path).Field("code", absl::StatusCodeToString(verified.code()))
          << "CORRUPT SNAPSHOT, not served: " << verified.message();
      result.rejected.push_back(std::string(verified.message()));
      if (policy == RecoveryPolicy::kFail) {
        return absl::DataLossError(absl::StrCat("snapshot ", path, " is corrupt (",
                                                verified.message(), "); --state-recovery=fail"));
      }
      const std::string aside = absl::StrCat(path, kRejectedSuffix);
      if (::rename(path.c_str(), aside.c_str()) == 0) {
        REFIT_LOG(WARNING).Field("file", aside)
            << "corrupt snapshot set aside; trying the previous one";
      }
      continue;
    }
    result.read_time = absl::Now() - start;
    if (restored->fingerprint != checked->opened.manifest.fingerprint) {
      // KernelFingerprint over the same specs and hashes: cannot differ.
      return absl::InternalError(absl::StrCat("restored fingerprint ", restored->fingerprint,
                                              " differs from the snapshot's ",
                                              checked->opened.manifest.fingerprint));
    }
    result.restored = std::move(checked->opened.manifest);
    result.path = path;
    break;
  }
  store->SetNextVersionFloor(result.highest_version + 1);
  return result;
}

// SnapshotWriter

SnapshotWriter::SnapshotWriter(ShardStore* store, SnapshotWriterOptions options)
    : store_(store), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<SnapshotWriter>> SnapshotWriter::Create(
    ShardStore* store, SnapshotWriterOptions options) {
  if (store == nullptr) return absl::InvalidArgumentError("SnapshotWriter needs a store");
  if (absl::Status s = MakeDir(options.dir); !s.ok()) return s;
  absl::StatusOr<uint64_t> recorded = ReadVersionRecord(options.dir);
  std::unique_ptr<SnapshotWriter> writer(new SnapshotWriter(store, std::move(options)));
  {
    absl::MutexLock lock(&writer->record_mu_);
    writer->recorded_ = recorded.ok() ? *recorded : 0;
  }
  // Proves the directory writable now rather than at the first commit.
  {
    absl::MutexLock lock(&writer->record_mu_);
    writer->recorded_ = std::max(writer->recorded_, store->version());
    absl::Status s = WriteVersionRecord(writer->options_.dir, writer->recorded_);
    if (!s.ok()) return s;
  }
  {
    absl::MutexLock lock(&writer->mu_);
    writer->written_ = store->version();
  }
  SnapshotWriter* self = writer.get();
  store->SetCommitGuard([self](uint64_t next) { return self->Guard(next); });
  writer->listener_id_ = store->AddListener([self](const StoreEvent& event) {
    if (event.type == StoreEventType::kCommitted) self->Notify(event);
  });
  writer->thread_ = std::thread([self] { self->Run(); });
  return writer;
}

SnapshotWriter::~SnapshotWriter() {
  Stop();
  store_->RemoveListener(listener_id_);
  store_->SetCommitGuard(nullptr);
}

absl::Status SnapshotWriter::Guard(uint64_t next_version) {
  absl::MutexLock lock(&record_mu_);
  if (next_version <= recorded_) return absl::OkStatus();
  absl::Status s = WriteVersionRecord(options_.dir, next_version);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot record version ", next_version,
                                               " durably in the state dir: ", s.message()));
  }
  recorded_ = next_version;
  return absl::OkStatus();
}

void SnapshotWriter::Notify(const StoreEvent& event) {
  absl::MutexLock lock(&mu_);
  pending_ = Pending{event.version, event.refit_id, event.label};
}

void SnapshotWriter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool SnapshotWriter::AwaitWritten(uint64_t version, absl::Duration limit) const {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return written_ >= version; };
  mu_.AwaitWithTimeout(absl::Condition(&done), limit);
  return written_ >= version;
}

uint64_t SnapshotWriter::last_written_version() const {
  absl::MutexLock lock(&mu_);
  return written_;
}

void SnapshotWriter::Run() {
  // Background work: below the threads that receive, quantize and commit
  // refits, for the CPU and for the disk.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
  constexpr int kIoprioWhoProcess = 1, kIoprioClassBestEffort = 2, kIoprioClassShift = 13;
  ::syscall(SYS_ioprio_set, kIoprioWhoProcess, static_cast<int>(::syscall(SYS_gettid)),
            (kIoprioClassBestEffort << kIoprioClassShift) | 7);
  for (;;) {
    Pending pending;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_NO_THREAD_SAFETY_ANALYSIS { return pending_.has_value() || stop_; };
      mu_.Await(absl::Condition(&ready));
      if (!pending_.has_value()) return;  // stopping, nothing left to write
      pending = *std::move(pending_);
      pending_.reset();
      // A "committed" event without a new version (a refit that changed
      // nothing), or one for a version already on disk.
      if (pending.version <= written_) continue;
    }
    WriteOne(pending);
  }
}

void SnapshotWriter::WriteOne(const Pending& pending) {
  const absl::Time start = absl::Now();
  // Allocated once and kept: a fresh buffer would page-fault all of it in
  // during the copy, under the reader lock.
  buffer_.resize(static_cast<size_t>(store_->layout().kernel_bytes()));
  absl::StatusOr<ShardStore::KernelCopy> copy = store_->CopyKernels(absl::MakeSpan(buffer_));
  if (!copy.ok()) {
    REFIT_LOG(ERROR).Field("group", store_->group()).Field("version", absl::StrCat(pending.version))
        << "snapshot not written: " << copy.status().ToString();
    return;
  }
  // A newer commit landed before the copy: its own event follows, and its
  // snapshot is written then with its refit id and label.
  if (copy->version != pending.version) return;
  const absl::Duration copy_time = absl::Now() - start;
  SnapshotManifest manifest = ManifestFor(*store_, *copy, pending.refit_id, pending.label);
  SnapshotWriteHooks hooks = options_.hooks;
  hooks.cancelled = [this] {
    absl::MutexLock lock(&mu_);
    return stop_;
  };
  absl::StatusOr<std::string> path = WriteSnapshot(options_.dir, manifest, buffer_, hooks);
  if (!path.ok()) {
    REFIT_LOG(ERROR)
            .Field("refit_id", pending.refit_id)
            .Field("group", store_->group())
            .Field("version", absl::StrCat(manifest.version))
        << "snapshot not written (the previous one stays): " << path.status().ToString();
    return;
  }
  Prune(manifest.version);
  REFIT_LOG(INFO)
          .Field("refit_id", pending.refit_id)
          .Field("group", store_->group())
          .Field("version", absl::StrCat(manifest.version))
          .Field("fingerprint", manifest.fingerprint)
          .Field("file", *path)
          .Field("bytes", absl::StrCat(manifest.kernel_bytes))
          .Field("copy_ms", absl::StrCat(absl::ToInt64Milliseconds(copy_time)))
          .Field("total_ms", absl::StrCat(absl::ToInt64Milliseconds(absl::Now() - start)))
      << "snapshot written";
  absl::MutexLock lock(&mu_);
  written_ = std::max(written_, manifest.version);
}

void SnapshotWriter::Prune(uint64_t newest) {
  absl::StatusOr<DirEntries> entries = ListDir(options_.dir);
  if (!entries.ok()) return;
  std::vector<std::pair<uint64_t, std::string>>& snaps = entries->snapshots;
  const size_t keep = static_cast<size_t>(std::max(1, options_.keep));
  if (snaps.size() <= keep) return;
  bool removed = false;
  for (size_t i = 0; i + keep < snaps.size(); ++i) {
    if (snaps[i].first >= newest) continue;
    if (::unlink(snaps[i].second.c_str()) == 0) removed = true;
  }
  if (removed) (void)FsyncDir(options_.dir);
}

}  // namespace refit::core
