// Safetensors files: a validated reader and a writer.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the data section. The reader is where untrusted bytes enter refitd
// (Reload reads operator-named files; refitctl push reads trainer output), so
// every header field is checked before any tensor is exposed:
//   - the header length fits in the file and the JSON parses to an object;
//   - dtypes are known, shapes are non-negative integers;
//   - end - begin == product(shape) * dtype size;
//   - ranges lie inside the data section and do not overlap;
//   - the header is bounded (kMaxSafetensorsHeaderBytes, at most
//     kMaxSafetensorsHeaderEntries entries) and holds no NUL byte.
// Errors are INVALID_ARGUMENT (malformed) or NOT_FOUND / PERMISSION_DENIED
// (cannot open), and the message names the file and the offending field.
//
// Tensor bytes are read with pread (Read), not through a memory mapping: a
// file truncated while mapped turns the next access into SIGBUS, which would
// kill the daemon, while a short read is an error the refit can report. A
// file that changes after Open (size or modification time, checked on every
// Read) fails the read with FAILED_PRECONDITION, so a refit never mixes bytes
// of two versions of a file without saying so.
//
// Lifecycle: a SafetensorsFile owns its open descriptor (or, from FromBytes,
// its bytes). Immutable after Open, so safe to read from any number of
// threads (pread has no shared file position).
#ifndef REFIT_CORE_SAFETENSORS_H_
#define REFIT_CORE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace refit::core {

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // within the data section
  uint64_t nbytes = 0;
};

// Header bounds. Real headers are a few MB even for checkpoints with 100k
// tensors in a file; the caps keep a forged header from costing gigabytes of
// memory and seconds of parsing (the parsed header takes ~1 KB per entry).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{32} << 20;
inline constexpr size_t kMaxSafetensorsHeaderEntries = size_t{1} << 17;  // 131,072

class SafetensorsFile {
 public:
  // Opens `path` and validates its header. Every message starts with the
  // path; those about one tensor or field name it.
  // Errors:
  //   NOT_FOUND          no such file (or a path component is not a directory)
  //   PERMISSION_DENIED  the file cannot be read
  //   INVALID_ARGUMENT   not a regular file, or malformed: shorter than the
  //                      length prefix, a header length past the end of the
  //                      file or over kMaxSafetensorsHeaderBytes, a header
  //                      with a NUL byte or more than
  //                      kMaxSafetensorsHeaderEntries entries, one that is not
  //                      a JSON object, nests too deep or names a tensor
  //                      twice, a bad
  //                      "__metadata__", an entry with a missing or mistyped
  //                      dtype/shape/data_offsets, an unknown dtype, a shape
  //                      that overflows, data_offsets that do not match the
  //                      shape, lie outside the data section or overlap
  //   FAILED_PRECONDITION the file shrank while its header was read
  //   INTERNAL           other I/O errors (stat, read)
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Validates an in-memory image (copied); `label` stands for the path in
  // errors. Errors: Open's INVALID_ARGUMENT cases, for the same images.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(absl::string_view bytes,
                                                                    std::string label);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In data-offset order.
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  // nullptr if absent.
  const TensorEntry* Find(absl::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Copies bytes [offset, offset + out.size()) of `tensor` (an entry of this
  // file) into `out`.
  // Errors (naming the file and the tensor):
  //   INVALID_ARGUMENT     the range is not inside the tensor
  //   FAILED_PRECONDITION  the file changed since Open: its size or
  //                        modification time differs, or it ends early (it
  //                        was truncated or is being rewritten)
  //   DATA_LOSS            the device reported an I/O error (EIO)
  //   INTERNAL             other read errors
  absl::Status Read(const TensorEntry& tensor, uint64_t offset, absl::Span<uint8_t> out) const;
  // The path the open file has now (from /proc/self/fd, symlinks resolved),
  // so a caller can check where the bytes really come from; the label for
  // FromBytes. Errors: INTERNAL if it cannot be resolved.
  absl::StatusOr<std::string> OpenedPath() const;
  // All of `tensor`'s bytes. Errors: those of Read.
  absl::StatusOr<std::string> ReadAll(const TensorEntry& tensor) const;

 private:
  SafetensorsFile() = default;
  // Validates the length prefix of a `size`-byte file and returns the header
  // length.
  absl::StatusOr<uint64_t> CheckPrefix(const uint8_t* prefix) const;
  absl::Status Parse(absl::string_view header, uint64_t data_size);
  absl::Status CheckUnchanged(absl::string_view tensor_name) const;

  std::string path_;
  int fd_ = -1;              // Open: the file, read with pread
  uint64_t size_ = 0;        // of the file (or image) at Open
  int64_t mtime_ns_ = 0;     // at Open
  uint64_t data_start_ = 0;  // file offset of the data section
  std::string image_;        // FromBytes: the whole image
  std::vector<TensorEntry> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> data;  // product(shape) * DTypeSize(dtype) bytes
};

// Writes a safetensors file (header padded to 8 bytes, tensors in the given
// order). Writes to a temporary file and renames, so readers never see a
// partial file; on any error no file is left at `path` or beside it.
// Errors (every message names the path and, where one is at fault, the
// tensor):
//   INVALID_ARGUMENT  a tensor's data size does not match dtype x shape, a
//                     negative or overflowing shape, a name given twice, the
//                     reserved name "__metadata__", names or metadata that
//                     are not UTF-8
//   INTERNAL          I/O errors: the directory does not exist or is not
//                     writable, write, fsync or rename failed
absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors,
                              const std::map<std::string, std::string>& metadata = {});

// The *.safetensors files of a checkpoint directory, sorted by name: regular
// files, symlinks followed; other entries are skipped.
// Errors (naming the directory):
//   NOT_FOUND          no such directory, or it holds no *.safetensors file
//   PERMISSION_DENIED  the directory cannot be listed
//   INTERNAL           other I/O errors
absl::StatusOr<std::vector<std::string>> ListSafetensorsFiles(const std::string& dir);

}  // namespace refit::core

#endif  // REFIT_CORE_SAFETENSORS_H_
