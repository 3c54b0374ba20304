#include "core/safetensors.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/text.h"
#include "nlohmann/json.hpp"

namespace refit::core {
namespace {

using Json = nlohmann::json;

constexpr size_t kLengthPrefixBytes = 8;
constexpr absl::string_view kMetadataKey = "__metadata__";
// Untrusted strings echoed in error messages are escaped and bounded in one
// place (core/text.h) so a hostile header cannot flood the logs.
constexpr size_t kMaxQuotedChars = 120;
// Nesting allowed in the header JSON; see HeaderChecker for why there is a
// limit.
constexpr int kMaxHeaderDepth = 16;

std::string Quote(absl::string_view s) { return QuoteText(s); }

// A compact rendering of an offending JSON value, for messages.
std::string Render(const Json& value) {
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > kMaxQuotedChars) {
    text.resize(kMaxQuotedChars);
    text += "...";
  }
  return text;
}

// SAX handler for the streaming pre-pass over the header. It exists because
// the DOM parse cannot do these checks itself:
//  - nlohmann builds and frees nested values recursively, so a header of a
//    few MB of '[' would overflow the stack; valid headers nest three deep
//    ({ "name": { "shape": [ ), and the SAX parser itself is iterative;
//  - the DOM keeps one value per key, so a repeated tensor name would
//    silently drop a tensor;
//  - the DOM parser's callback hook, which could do both, is quadratic in the
//    number of keys (75 s for a 100k-tensor header).
class HeaderChecker {
 public:
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
    if (depth_ != 1) return true;
    // Checked before the DOM parse, so an oversized header is refused at the
    // cost of reading it once, not of building it.
    if (top_level_keys_.size() == kMaxSafetensorsHeaderEntries) {
      error_ = absl::StrCat("header has more than ", kMaxSafetensorsHeaderEntries,
                            " entries, the limit per file");
      return false;
    }
    if (!top_level_keys_.insert(key).second) {
      error_ = absl::StrCat("header names ", Quote(key), " twice");
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
      error_ = absl::StrCat("header nests deeper than ", kMaxHeaderDepth,
                            " levels; a safetensors header needs 3");
      return false;
    }
    return true;
  }
  bool Leave() {
    --depth_;
    return true;
  }

  int depth_ = 0;
  std::set<std::string> top_level_keys_;
  std::string error_;
};

std::string FormatShape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

template <typename... Args>
absl::Status Invalid(absl::string_view label, const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", args...));
}

// JSON numbers that are whole and non-negative. nlohmann stores
// non-negative literals as unsigned and "-0" as a signed zero; floats such as
// 2.0 are rejected because safetensors writers never produce them.
bool AsUint64(const Json& value, uint64_t* out) {
  if (value.is_number_unsigned()) {
    *out = value.get<uint64_t>();
    return true;
  }
  if (value.is_number_integer()) {
    const int64_t v = value.get<int64_t>();
    if (v < 0) return false;
    *out = static_cast<uint64_t>(v);
    return true;
  }
  return false;
}

absl::Status ParseMetadata(absl::string_view label, const Json& value,
                           std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    return Invalid(label, "\"__metadata__\" must be an object of strings, got ", Render(value));
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return Invalid(label, "\"__metadata__\" must map strings to strings, but the value of ",
                     Quote(key), " is ", Render(item));
    }
    metadata->emplace(key, item.get<std::string>());
  }
  return absl::OkStatus();
}

absl::Status ParseEntry(absl::string_view label, const std::string& name, const Json& value,
                        uint64_t data_size, TensorEntry* entry) {
  const std::string where = absl::StrCat("tensor ", Quote(name), ": ");
  if (!value.is_object()) {
    return Invalid(label, where, "entry must be an object, got ", Render(value));
  }
  entry->name = name;

  auto dtype_it = value.find("dtype");
  if (dtype_it == value.end()) return Invalid(label, where, "missing \"dtype\"");
  if (!dtype_it->is_string()) {
    return Invalid(label, where, "\"dtype\" must be a string, got ", Render(*dtype_it));
  }
  absl::StatusOr<DType> dtype = ParseDType(dtype_it->get_ref<const std::string&>());
  if (!dtype.ok()) return Invalid(label, where, "\"dtype\": ", dtype.status().message());
  entry->dtype = *dtype;

  auto shape_it = value.find("shape");
  if (shape_it == value.end()) return Invalid(label, where, "missing \"shape\"");
  if (!shape_it->is_array()) {
    return Invalid(label, where, "\"shape\" must be a list of non-negative integers, got ",
                   Render(*shape_it));
  }
  // The element count is accumulated in the order dims are listed and any
  // intermediate overflow is an error, even if a later dim is 0: downstream
  // stride arithmetic would overflow the same way.
  uint64_t numel = 1;
  for (size_t i = 0; i < shape_it->size(); ++i) {
    uint64_t dim = 0;
    if (!AsUint64((*shape_it)[i], &dim)) {
      return Invalid(label, where, "\"shape\" ", Render(*shape_it), ": dimension ", i, " is ",
                     Render((*shape_it)[i]), ", not a non-negative integer");
    }
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        __builtin_mul_overflow(numel, dim, &numel)) {
      return Invalid(label, where, "\"shape\" ", Render(*shape_it), " overflows 64 bits");
    }
    entry->shape.push_back(static_cast<int64_t>(dim));
  }
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(entry->dtype)), &nbytes)) {
    return Invalid(label, where, "\"shape\" ", FormatShape(entry->shape), " of ",
                   DTypeName(entry->dtype), " overflows 64 bits");
  }

  auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end()) return Invalid(label, where, "missing \"data_offsets\"");
  uint64_t begin = 0;
  uint64_t end = 0;
  if (!offsets_it->is_array() || offsets_it->size() != 2 || !AsUint64((*offsets_it)[0], &begin) ||
      !AsUint64((*offsets_it)[1], &end)) {
    return Invalid(label, where,
                   "\"data_offsets\" must be [begin, end] with non-negative integers, got ",
                   Render(*offsets_it));
  }
  if (end < begin) {
    return Invalid(label, where, "\"data_offsets\" [", begin, ", ", end, "] end before begin");
  }
  if (end - begin != nbytes) {
    return Invalid(label, where, "\"data_offsets\" [", begin, ", ", end, "] hold ", end - begin,
                   " bytes but shape ", FormatShape(entry->shape), " of ", DTypeName(entry->dtype),
                   " needs ", nbytes);
  }
  if (end > data_size) {
    return Invalid(label, where, "\"data_offsets\" [", begin, ", ", end,
                   "] extend past the end of the data section (", data_size, " bytes)");
  }
  entry->offset = begin;
  entry->nbytes = nbytes;
  return absl::OkStatus();
}

absl::Status ErrnoStatus(int err, absl::string_view what, absl::string_view path) {
  std::string message = absl::StrCat(path, ": ", what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case EIO:
      return absl::DataLossError(message);
    default:
      return absl::InternalError(message);
  }
}

// Closes the descriptor on every path out of Open / WriteSafetensors.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  // Closes now, reporting the error (close can surface delayed write errors).
  int Close() {
    int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, const uint8_t* data, size_t size, absl::string_view path) {
  while (size > 0) {
    // Large single writes can be split by the kernel; cap each call and loop.
    const size_t chunk = std::min<size_t>(size, size_t{1} << 30);
    ssize_t n = ::write(fd, data, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat(path, ": write: ", std::strerror(errno)));
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Reads up to `size` bytes at `offset`; returns how many were read (fewer only
// at the end of the file) or -errno.
int64_t PreadAll(int fd, uint8_t* out, size_t size, uint64_t offset) {
  size_t done = 0;
  while (done < size) {
    const size_t chunk = std::min<size_t>(size - done, size_t{1} << 30);
    ssize_t n = ::pread(fd, out + done, chunk, static_cast<off_t>(offset + done));
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

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->fd_ = fd;  // closed by the destructor on every path out
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  file->size_ = static_cast<uint64_t>(st.st_size);
  file->mtime_ns_ = MtimeNs(st);
  uint8_t prefix[kLengthPrefixBytes] = {};
  if (file->size_ >= kLengthPrefixBytes) {
    const int64_t n = PreadAll(fd, prefix, kLengthPrefixBytes, 0);
    if (n < 0) return ErrnoStatus(static_cast<int>(-n), "cannot read", path);
    if (n < static_cast<int64_t>(kLengthPrefixBytes)) file->size_ = static_cast<uint64_t>(n);
  }
  absl::StatusOr<uint64_t> header_len = file->CheckPrefix(prefix);
  if (!header_len.ok()) return header_len.status();
  std::string header(*header_len, '\0');
  const int64_t n =
      PreadAll(fd, reinterpret_cast<uint8_t*>(header.data()), header.size(), kLengthPrefixBytes);
  if (n < 0) return ErrnoStatus(static_cast<int>(-n), "cannot read", path);
  if (n < static_cast<int64_t>(header.size())) {
    absl::Status changed = file->CheckUnchanged("");
    if (!changed.ok()) return changed;
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": file ended inside the header; was it truncated while being read?"));
  }
  file->data_start_ = kLengthPrefixBytes + *header_len;
  absl::Status status = file->Parse(header, file->size_ - file->data_start_);
  if (!status.ok()) return status;
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(absl::string_view bytes,
                                                                            std::string label) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = std::move(label);
  file->image_ = std::string(bytes);
  file->size_ = bytes.size();
  uint8_t prefix[kLengthPrefixBytes] = {};
  if (bytes.size() >= kLengthPrefixBytes) std::memcpy(prefix, bytes.data(), kLengthPrefixBytes);
  absl::StatusOr<uint64_t> header_len = file->CheckPrefix(prefix);
  if (!header_len.ok()) return header_len.status();
  file->data_start_ = kLengthPrefixBytes + *header_len;
  absl::Status status =
      file->Parse(absl::string_view(file->image_).substr(kLengthPrefixBytes, *header_len),
                  file->size_ - file->data_start_);
  if (!status.ok()) return status;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorEntry* SafetensorsFile::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<uint64_t> SafetensorsFile::CheckPrefix(const uint8_t* prefix) const {
  const std::string& label = path_;
  if (size_ < kLengthPrefixBytes) {
    return Invalid(label, "file is ", size_,
                   " bytes, shorter than the 8-byte header length prefix");
  }
  uint64_t header_len = 0;
  for (size_t i = 0; i < kLengthPrefixBytes; ++i) {
    header_len |= uint64_t{prefix[i]} << (8 * i);
  }
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return Invalid(label, "header length ", header_len, " exceeds the limit of ",
                   kMaxSafetensorsHeaderBytes, " bytes");
  }
  if (header_len > size_ - kLengthPrefixBytes) {
    return Invalid(label, "header length ", header_len, " runs past the end of the file (", size_,
                   " bytes)");
  }
  return header_len;
}

absl::Status SafetensorsFile::CheckUnchanged(absl::string_view tensor_name) const {
  if (fd_ < 0) return absl::OkStatus();
  struct stat st;
  if (::fstat(fd_, &st) != 0) return ErrnoStatus(errno, "cannot stat", path_);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == size_ && MtimeNs(st) == mtime_ns_) return absl::OkStatus();
  const std::string what = tensor_name.empty()
                               ? std::string()
                               : absl::StrCat("reading tensor ", Quote(tensor_name), ": ");
  if (size != size_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": ", what, "the file changed while being read (", size_,
                     " bytes at open, ", size, " now); was it truncated or rewritten in place?"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      path_, ": ", what,
      "the file changed while being read (modified since it was opened); was it rewritten in "
      "place?"));
}

absl::Status SafetensorsFile::Read(const TensorEntry& tensor, uint64_t offset,
                                   absl::Span<uint8_t> out) const {
  if (offset > tensor.nbytes || out.size() > tensor.nbytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor ", Quote(tensor.name),
                                                   ": bytes [", offset, ", ", offset + out.size(),
                                                   ") are not inside its ", tensor.nbytes));
  }
  if (out.empty()) return absl::OkStatus();
  const uint64_t at = data_start_ + tensor.offset + offset;
  if (fd_ < 0) {
    std::memcpy(out.data(), image_.data() + at, out.size());
    return absl::OkStatus();
  }
  const int64_t n = PreadAll(fd_, out.data(), out.size(), at);
  if (n < 0) {
    return ErrnoStatus(static_cast<int>(-n),
                       absl::StrCat("cannot read tensor ", Quote(tensor.name)), path_);
  }
  // Checked after every read, short or not: a file rewritten in place reads
  // in full but mixes old and new bytes.
  if (absl::Status changed = CheckUnchanged(tensor.name); !changed.ok()) return changed;
  if (n < static_cast<int64_t>(out.size())) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": reading tensor ", Quote(tensor.name),
                     ": the file ended early; was it truncated while being read?"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SafetensorsFile::OpenedPath() const {
  if (fd_ < 0) return path_;
  const std::string link = absl::StrCat("/proc/self/fd/", fd_);
  char target[PATH_MAX];
  const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  if (n < 0) return ErrnoStatus(errno, "cannot resolve the open file", path_);
  return std::string(target, static_cast<size_t>(n));
}

absl::StatusOr<std::string> SafetensorsFile::ReadAll(const TensorEntry& tensor) const {
  std::string bytes(tensor.nbytes, '\0');
  absl::Status status =
      Read(tensor, 0, absl::MakeSpan(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()));
  if (!status.ok()) return status;
  return bytes;
}

absl::Status SafetensorsFile::Parse(absl::string_view header_text, uint64_t data_size) {
  const std::string& label = path_;
  // nlohmann's lexer takes a NUL byte for the end of input, so the bytes after
  // it would be ignored; the reference parser requires UTF-8 JSON throughout
  // (trailing spaces are padding).
  if (const size_t nul = header_text.find('\0'); nul != absl::string_view::npos) {
    return Invalid(label, "header has a NUL byte at offset ", nul,
                   "; a safetensors header must be JSON text");
  }
  const char* header_begin = header_text.data();
  const char* header_end = header_begin + header_text.size();

  // A streaming pre-pass checks syntax, nesting depth, the entry count and
  // repeated names before anything is built; see HeaderChecker for why.
  HeaderChecker checker;
  if (!Json::sax_parse(header_begin, header_end, &checker)) {
    return Invalid(label, checker.error());
  }
  Json header;
  try {
    header = Json::parse(header_begin, header_end);
  } catch (const Json::exception& e) {
    return Invalid(label, "header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) {
    return Invalid(label, "header is not a JSON object (got ", header.type_name(), ")");
  }

  std::vector<TensorEntry> tensors;
  tensors.reserve(header.size());
  for (const auto& [key, value] : header.items()) {
    if (key == kMetadataKey) {
      absl::Status status = ParseMetadata(label, value, &metadata_);
      if (!status.ok()) return status;
      continue;
    }
    TensorEntry entry;
    absl::Status status = ParseEntry(label, key, value, data_size, &entry);
    if (!status.ok()) return status;
    tensors.push_back(std::move(entry));
  }

  // Sorting by (begin, end) puts an empty tensor before a non-empty one at
  // the same offset, so only genuinely shared bytes count as overlap.
  std::sort(tensors.begin(), tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    if (a.offset != b.offset) return a.offset < b.offset;
    return a.nbytes < b.nbytes;
  });
  for (size_t i = 1; i < tensors.size(); ++i) {
    const TensorEntry& prev = tensors[i - 1];
    const TensorEntry& cur = tensors[i];
    if (cur.offset < prev.offset + prev.nbytes) {
      return Invalid(label, "tensors ", Quote(prev.name), " [", prev.offset, ", ",
                     prev.offset + prev.nbytes, "] and ", Quote(cur.name), " [", cur.offset, ", ",
                     cur.offset + cur.nbytes, "] overlap in \"data_offsets\"");
    }
  }
  tensors_ = std::move(tensors);
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps __metadata__ first and tensors in the caller's order,
  // which matches how the Python writer lays files out.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  std::set<absl::string_view> names;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name == kMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": \"__metadata__\" is reserved and cannot name a tensor"));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", Quote(t.name), " is given twice"));
    }
    uint64_t numel = 1;
    for (int64_t dim : t.shape) {
      if (dim < 0 || __builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", Quote(t.name),
                                                       ": invalid shape ", FormatShape(t.shape)));
      }
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(t.dtype)), &nbytes) ||
        nbytes != t.data.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor ", Quote(t.name), ": shape ", FormatShape(t.shape), " of ",
                       DTypeName(t.dtype), " needs ", numel * DTypeSize(t.dtype), " bytes but ",
                       t.data.size(), " were given"));
    }
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = std::string(DTypeName(t.dtype));
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + nbytes};
    header[t.name] = std::move(entry);
    offset += nbytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::ordered_json::exception& e) {
    // Only non-UTF-8 names or metadata can make dump() throw.
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header cannot be encoded as JSON: ", e.what()));
  }
  // Padding to 8 keeps the data section 8-byte aligned in the mapping, so
  // readers can view F64/I64 tensors in place.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  uint8_t prefix[kLengthPrefixBytes];
  for (size_t i = 0; i < kLengthPrefixBytes; ++i) {
    prefix[i] = static_cast<uint8_t>(static_cast<uint64_t>(header_text.size()) >> (8 * i));
  }

  // The pid plus a per-process counter keeps concurrent writers of the same
  // path (other processes or threads) from sharing a temporary file.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp_path = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter++);
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat(tmp_path, ": cannot create: ", std::strerror(errno)));
  }
  FdCloser closer(fd);
  absl::Status status = WriteAll(fd, prefix, sizeof(prefix), tmp_path);
  if (status.ok()) {
    status = WriteAll(fd, reinterpret_cast<const uint8_t*>(header_text.data()), header_text.size(),
                      tmp_path);
  }
  for (const TensorToWrite& t : tensors) {
    if (!status.ok()) break;
    status = WriteAll(fd, t.data.data(), t.data.size(), tmp_path);
  }
  // fsync before rename: otherwise a crash can leave the new name pointing at
  // a file whose data never reached the disk.
  if (status.ok() && ::fsync(fd) != 0) {
    status = absl::InternalError(absl::StrCat(tmp_path, ": fsync: ", std::strerror(errno)));
  }
  if (status.ok() && closer.Close() != 0) {
    status = absl::InternalError(absl::StrCat(tmp_path, ": close: ", std::strerror(errno)));
  }
  if (status.ok() && ::rename(tmp_path.c_str(), path.c_str()) != 0) {
    status = absl::InternalError(
        absl::StrCat(tmp_path, ": cannot rename to ", path, ": ", std::strerror(errno)));
  }
  if (!status.ok()) ::unlink(tmp_path.c_str());
  return status;
}

absl::StatusOr<std::vector<std::string>> ListSafetensorsFiles(const std::string& dir) {
  // POSIX rather than std::filesystem: libtorch.so exports its own copies of
  // std::filesystem symbols, and binaries that load it can bind to those.
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoStatus(errno, "cannot list directory", dir);
  std::vector<std::string> files;
  constexpr absl::string_view kSuffix = ".safetensors";
  errno = 0;
  while (const struct dirent* entry = ::readdir(d)) {
    const absl::string_view name(entry->d_name);
    if (name.size() <= kSuffix.size() || name.substr(name.size() - kSuffix.size()) != kSuffix) {
      continue;
    }
    std::string path = absl::StrCat(dir, "/", name);
    // stat follows symlinks: Hugging Face caches link every shard.
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    files.push_back(std::move(path));
  }
  int read_errno = errno;
  ::closedir(d);
  if (read_errno != 0) return ErrnoStatus(read_errno, "cannot list directory", dir);
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat(dir, ": no *.safetensors files"));
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace refit::core
