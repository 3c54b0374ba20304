// SafetensorsView: a read-only view of one safetensors file, for the client
// side of a push.
//
// Why not core's SafetensorsFile: the client library must stay free of
// refit_core (which links LibTorch), so that trainers can push with nothing
// but gRPC. The daemon validates every chunk it receives anyway; this view
// checks what it needs to slice bytes safely and to push every tensor once:
// the header parses (no repeated names, bounded nesting), dtypes are known,
// and every tensor's byte range matches its shape, lies inside the file and
// shares no bytes with another tensor's.
//
// Tensor bytes are read with pread (Read), not through a mapping: a file
// truncated under a mapping kills the process with SIGBUS on the next access,
// while a read of a file that changed since Open (size or modification time,
// checked on every Read) is a FAILED_PRECONDITION the push reports.
//
// Lifecycle: Open opens the file and parses its header; the view owns the
// descriptor. Immutable after Open; thread-safe to read (pread has no shared
// position).
#ifndef REFIT_CLIENT_SAFETENSORS_VIEW_H_
#define REFIT_CLIENT_SAFETENSORS_VIEW_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "refit/v1/refit.pb.h"

namespace refit::client {

struct SafetensorsTensor {
  std::string name;
  std::string dtype_name;  // as written in the header, e.g. "BF16"
  refit::v1::DType dtype = refit::v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // within the data section
  uint64_t nbytes = 0;
};

// Safetensors dtype spelling -> proto enum; DTYPE_UNSPECIFIED if refit.v1
// has no such type. And back ("" for unspecified).
refit::v1::DType DTypeFromSafetensorsName(absl::string_view name);
absl::string_view SafetensorsNameOf(refit::v1::DType dtype);
// Bytes per element; 0 for DTYPE_UNSPECIFIED.
size_t DTypeBytes(refit::v1::DType dtype);

class SafetensorsView {
 public:
  // Errors (every message names the file; those about one tensor name it):
  //   NOT_FOUND          no such file
  //   PERMISSION_DENIED  the file cannot be read
  //   INVALID_ARGUMENT   not a regular file; shorter than the 8-byte length
  //                      prefix; a header length past the end of the file; a
  //                      header that is not a JSON object, names a tensor
  //                      twice, nests too deep or has a "__metadata__" that
  //                      is not an object of strings; an entry without dtype,
  //                      shape or data_offsets; a dtype refit.v1 cannot carry;
  //                      a shape that overflows; data_offsets outside the data
  //                      section, not matching the shape, or overlapping
  //                      another tensor's
  //   FAILED_PRECONDITION the file shrank while its header was read
  //   INTERNAL           other read errors
  static absl::StatusOr<std::unique_ptr<SafetensorsView>> Open(const std::string& path);
  ~SafetensorsView();
  SafetensorsView(const SafetensorsView&) = delete;
  SafetensorsView& operator=(const SafetensorsView&) = delete;

  const std::string& path() const { return path_; }
  // In data-offset order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }

  // Copies bytes [offset, offset + out.size()) of `tensor` (one of this
  // view's) into `out`.
  // Errors (naming the file and the tensor):
  //   INVALID_ARGUMENT     the range is not inside the tensor
  //   FAILED_PRECONDITION  the file changed since Open (truncated, rewritten)
  //   INTERNAL             other read errors
  absl::Status Read(const SafetensorsTensor& tensor, uint64_t offset,
                    absl::Span<uint8_t> out) const;
  // All of `tensor`'s bytes. Errors: those of Read.
  absl::StatusOr<std::string> ReadAll(const SafetensorsTensor& tensor) const;

 private:
  SafetensorsView() = default;
  absl::Status ChangedError(absl::string_view tensor_name) const;

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;  // at Open
  int64_t mtime_ns_ = 0;
  uint64_t data_start_ = 0;  // file offset of the data section
  std::vector<SafetensorsTensor> tensors_;
};

// The *.safetensors files of each directory in `paths` (sorted), and each
// path that is not a directory as it is, in the order given.
// Errors:
//   NOT_FOUND          `paths` is empty, a path does not exist, or a
//                      directory holds no *.safetensors file
//   PERMISSION_DENIED  a path or directory cannot be read
absl::StatusOr<std::vector<std::string>> ExpandSafetensorsPaths(
    const std::vector<std::string>& paths);

}  // namespace refit::client

#endif  // REFIT_CLIENT_SAFETENSORS_VIEW_H_
