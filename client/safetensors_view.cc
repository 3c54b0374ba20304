#include "client/safetensors_view.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace refit::client {
namespace {

struct DTypeEntry {
  const char* name;
  refit::v1::DType dtype;
  size_t bytes;
};

constexpr DTypeEntry kDTypes[] = {
    {"F32", refit::v1::DTYPE_F32, 4},   {"F16", refit::v1::DTYPE_F16, 2},
    {"BF16", refit::v1::DTYPE_BF16, 2}, {"F8_E4M3", refit::v1::DTYPE_F8_E4M3, 1},
    {"I64", refit::v1::DTYPE_I64, 8},   {"I32", refit::v1::DTYPE_I32, 4},
    {"U8", refit::v1::DTYPE_U8, 1},
};

// Nesting allowed in a header; a valid one needs 3 ({"name": {"shape": [).
constexpr int kMaxHeaderDepth = 16;

// Streaming pre-pass over the header, for what the DOM parse cannot check:
// it keeps one value per key, so a repeated tensor name would silently drop a
// tensor from the push, and it recurses on nesting, so a header of many '['
// could exhaust the stack.
class HeaderChecker {
 public:
  using Json = nlohmann::json;
  const std::string& error() const { return error_; }

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(Json::number_integer_t) { return true; }
  bool number_unsigned(Json::number_unsigned_t) { return true; }
  bool number_float(Json::number_float_t, const Json::string_t&) { return true; }
  bool string(Json::string_t&) { return true; }
  bool binary(Json::binary_t&) { return true; }
  bool start_object(std::size_t) { return Enter(); }
  bool start_array(std::size_t) { return Enter(); }
  bool end_object() { return Leave(); }
  bool end_array() { return Leave(); }
  bool key(Json::string_t& key) {
    if (depth_ == 1 && !names_.insert(key).second) {
      error_ = absl::StrCat("header names tensor '", key, "' twice");
      return false;
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    error_ = absl::StrCat("header is not valid JSON: ", e.what());
    return false;
  }

 private:
  bool Enter() {
    if (++depth_ > kMaxHeaderDepth) {
      error_ = absl::StrCat("header nests deeper than ", kMaxHeaderDepth, " levels");
      return false;
    }
    return true;
  }
  bool Leave() {
    --depth_;
    return true;
  }

  int depth_ = 0;
  std::set<std::string> names_;
  std::string error_;
};

absl::Status OpenError(const std::string& path, int err) {
  std::string message = absl::StrCat("cannot open ", path, ": ", std::strerror(err));
  if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

// Reads up to `size` bytes at `offset`; how many were read (fewer only at the
// end of the file), or -errno.
int64_t PreadAll(int fd, uint8_t* out, size_t size, uint64_t offset) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out + done, std::min<size_t>(size - done, size_t{1} << 30),
                              static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return static_cast<int64_t>(done);
}

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

refit::v1::DType DTypeFromSafetensorsName(absl::string_view name) {
  for (const DTypeEntry& e : kDTypes) {
    if (name == e.name) return e.dtype;
  }
  return refit::v1::DTYPE_UNSPECIFIED;
}

absl::string_view SafetensorsNameOf(refit::v1::DType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (dtype == e.dtype) return e.name;
  }
  return "";
}

size_t DTypeBytes(refit::v1::DType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (dtype == e.dtype) return e.bytes;
  }
  return 0;
}

absl::StatusOr<std::unique_ptr<SafetensorsView>> SafetensorsView::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return OpenError(path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return OpenError(path, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  std::unique_ptr<SafetensorsView> view(new SafetensorsView());
  view->path_ = path;
  if (size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", size, " bytes is too short for a safetensors file"));
  }
  view->fd_ = fd;  // closed by the destructor from here on
  view->size_ = size;
  view->mtime_ns_ = MtimeNs(st);
  uint8_t prefix[8];
  if (PreadAll(fd, prefix, 8, 0) != 8) return view->ChangedError("");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | prefix[i];
  if (header_len > size - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", header_len, " exceeds the file size ", size));
  }
  // The daemon's limit (core/safetensors.h): a longer header is refused
  // there anyway, and reading it here would cost its size in memory.
  constexpr uint64_t kMaxHeaderBytes = uint64_t{32} << 20;
  if (header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes, " bytes"));
  }
  std::string header_text(header_len, '\0');
  if (PreadAll(fd, reinterpret_cast<uint8_t*>(header_text.data()), header_len, 8) !=
      static_cast<int64_t>(header_len)) {
    return view->ChangedError("");
  }
  if (const size_t nul = header_text.find('\0'); nul != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header has a NUL byte at offset ", nul));
  }
  view->data_start_ = 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  const char* header_begin = header_text.data();
  const char* header_end = header_begin + header_text.size();
  HeaderChecker checker;
  if (!nlohmann::json::sax_parse(header_begin, header_end, &checker)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", checker.error()));
  }
  nlohmann::json header = nlohmann::json::parse(header_begin, header_end, nullptr,
                                                /*allow_exceptions=*/false);
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not a JSON object"));
  }
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      // Not pushed, but a file the daemon's reader would refuse should not
      // pass here either.
      bool strings = it.value().is_object();
      for (const auto& item : it.value().items()) strings = strings && item.value().is_string();
      if (!strings) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": __metadata__ must map strings to strings"));
      }
      continue;
    }
    const std::string& name = it.key();
    const nlohmann::json& entry = it.value();
    auto bad = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", name, "': ", what));
    };
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("data_offsets") ||
        !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2) {
      return bad("needs dtype, shape and data_offsets [begin, end]");
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype_name = entry["dtype"].get<std::string>();
    t.dtype = DTypeFromSafetensorsName(t.dtype_name);
    if (t.dtype == refit::v1::DTYPE_UNSPECIFIED) {
      return bad(absl::StrCat("dtype ", t.dtype_name, " cannot be pushed"));
    }
    uint64_t numel = 1;
    for (const nlohmann::json& d : entry["shape"]) {
      if (!d.is_number_unsigned()) return bad("shape must hold non-negative integers");
      // An overflowing product could wrap around to the size of the bytes
      // given and pass the check below with a shape the data does not fill.
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          __builtin_mul_overflow(numel, dim, &numel)) {
        return bad(absl::StrCat("shape ", entry["shape"].dump(), " overflows 64 bits"));
      }
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeBytes(t.dtype)), &nbytes)) {
      return bad(absl::StrCat("shape ", entry["shape"].dump(), " of ", t.dtype_name,
                              " overflows 64 bits"));
    }
    const nlohmann::json& offsets = entry["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return bad("data_offsets must be non-negative integers");
    }
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return bad(absl::StrCat("data_offsets [", begin, ", ", end, ") outside the data section of ",
                              data_size, " bytes"));
    }
    if (end - begin != nbytes) {
      return bad(
          absl::StrCat("data_offsets span ", end - begin, " bytes, shape and dtype need ", nbytes));
    }
    t.offset = begin;
    t.nbytes = nbytes;
    view->tensors_.push_back(std::move(t));
  }
  // By (begin, size): an empty tensor sorts before a non-empty one at the
  // same offset, so only bytes two tensors really share count as overlap.
  std::sort(view->tensors_.begin(), view->tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              if (a.offset != b.offset) return a.offset < b.offset;
              return a.nbytes < b.nbytes;
            });
  // Overlapping tensors would push the same bytes under two names; no
  // writer produces them, and the daemon's own reader rejects them.
  for (size_t i = 1; i < view->tensors_.size(); ++i) {
    const SafetensorsTensor& prev = view->tensors_[i - 1];
    const SafetensorsTensor& cur = view->tensors_[i];
    if (cur.offset < prev.offset + prev.nbytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensors '", prev.name, "' and '",
                                                     cur.name, "' overlap in data_offsets"));
    }
  }
  return view;
}

SafetensorsView::~SafetensorsView() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status SafetensorsView::ChangedError(absl::string_view tensor_name) const {
  return absl::FailedPreconditionError(absl::StrCat(
      path_, ": ", tensor_name.empty() ? "" : absl::StrCat("reading tensor '", tensor_name, "': "),
      "the file changed while being read (truncated or rewritten in place?)"));
}

absl::Status SafetensorsView::Read(const SafetensorsTensor& tensor, uint64_t offset,
                                   absl::Span<uint8_t> out) const {
  if (offset > tensor.nbytes || out.size() > tensor.nbytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", tensor.name, "': bytes [",
                                                   offset, ", ", offset + out.size(),
                                                   ") are not inside its ", tensor.nbytes));
  }
  if (out.empty()) return absl::OkStatus();
  const int64_t n = PreadAll(fd_, out.data(), out.size(), data_start_ + tensor.offset + offset);
  if (n < 0) {
    return absl::InternalError(
        absl::StrCat("cannot read ", path_, ": ", std::strerror(static_cast<int>(-n))));
  }
  // Checked after every read: a file rewritten in place reads in full but
  // mixes old and new bytes.
  struct stat st;
  if (::fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) != size_ ||
      MtimeNs(st) != mtime_ns_ || n < static_cast<int64_t>(out.size())) {
    return ChangedError(tensor.name);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SafetensorsView::ReadAll(const SafetensorsTensor& tensor) const {
  std::string bytes(tensor.nbytes, '\0');
  absl::Status status =
      Read(tensor, 0, absl::MakeSpan(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()));
  if (!status.ok()) return status;
  return bytes;
}

// POSIX rather than std::filesystem: refitctl also links LibTorch, whose
// libtorch.so exports its own (broken) copies of std::filesystem symbols
// that would be bound in their place.
absl::StatusOr<std::vector<std::string>> ExpandSafetensorsPaths(
    const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const std::string& path : paths) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) {
        return absl::NotFoundError(absl::StrCat("no such file or directory: ", path));
      }
      return OpenError(path, errno);
    }
    if (!S_ISDIR(st.st_mode)) {
      files.push_back(path);
      continue;
    }
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) return OpenError(path, errno);
    std::vector<std::string> in_dir;
    while (struct dirent* entry = ::readdir(dir)) {
      std::string name = entry->d_name;
      if (!absl::EndsWith(name, ".safetensors")) continue;
      std::string file = absl::StrCat(path, absl::EndsWith(path, "/") ? "" : "/", name);
      // As the daemon lists a checkpoint: regular files, symlinks followed
      // (Hugging Face caches link every shard).
      struct stat file_st;
      if (::stat(file.c_str(), &file_st) != 0 || !S_ISREG(file_st.st_mode)) continue;
      in_dir.push_back(std::move(file));
    }
    ::closedir(dir);
    if (in_dir.empty()) {
      return absl::NotFoundError(absl::StrCat("no *.safetensors files in ", path));
    }
    std::sort(in_dir.begin(), in_dir.end());
    files.insert(files.end(), in_dir.begin(), in_dir.end());
  }
  if (files.empty()) return absl::NotFoundError("no safetensors files given");
  return files;
}

}  // namespace refit::client
