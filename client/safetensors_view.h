// SafetensorsView: a read-only, memory-mapped view of one safetensors file,
// for the client side of a push.
//
// Why not core's SafetensorsFile: the client library must stay free of
// refit_core (which links LibTorch), so that trainers can push with nothing
// but gRPC. The daemon validates every chunk it receives anyway; this view
// checks only what it needs to slice bytes safely: the header parses, dtypes
// are known, and every tensor's byte range matches its shape and lies inside
// the file.
//
// Lifecycle: Open maps the file; tensor data points into the mapping and is
// valid while the view lives. Immutable after Open; thread-safe to read.
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
  absl::Span<const uint8_t> data;
};

// Safetensors dtype spelling -> proto enum; DTYPE_UNSPECIFIED if refit.v1
// has no such type. And back ("" for unspecified).
refit::v1::DType DTypeFromSafetensorsName(absl::string_view name);
absl::string_view SafetensorsNameOf(refit::v1::DType dtype);
// Bytes per element; 0 for DTYPE_UNSPECIFIED.
size_t DTypeBytes(refit::v1::DType dtype);

class SafetensorsView {
 public:
  // NOT_FOUND / PERMISSION_DENIED if the file cannot be opened;
  // INVALID_ARGUMENT (naming the file and tensor) if it is malformed or holds
  // a dtype refit.v1 cannot carry.
  static absl::StatusOr<std::unique_ptr<SafetensorsView>> Open(const std::string& path);
  ~SafetensorsView();
  SafetensorsView(const SafetensorsView&) = delete;
  SafetensorsView& operator=(const SafetensorsView&) = delete;

  const std::string& path() const { return path_; }
  // In data-offset order.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }

 private:
  SafetensorsView() = default;

  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<SafetensorsTensor> tensors_;
};

// The *.safetensors files of a directory (sorted), or `path` itself if it is
// a file. NOT_FOUND if there are none.
absl::StatusOr<std::vector<std::string>> ExpandSafetensorsPaths(
    const std::vector<std::string>& paths);

}  // namespace refit::client

#endif  // REFIT_CLIENT_SAFETENSORS_VIEW_H_
