#include "client/safetensors_view.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

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

absl::Status OpenError(const std::string& path, int err) {
  std::string message = absl::StrCat("cannot open ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
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
  const size_t size = static_cast<size_t>(st.st_size);
  std::unique_ptr<SafetensorsView> view(new SafetensorsView());
  view->path_ = path;
  if (size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", size, " bytes is too short for a safetensors file"));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (map == MAP_FAILED) return OpenError(path, err);
  view->map_ = map;
  view->map_size_ = size;
  const uint8_t* base = static_cast<const uint8_t*>(map);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base[i];
  if (header_len > size - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", header_len, " exceeds the file size ", size));
  }
  const uint8_t* data_begin = base + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  nlohmann::json header = nlohmann::json::parse(base + 8, data_begin, nullptr,
                                                /*allow_exceptions=*/false);
  if (!header.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header is not a JSON object"));
  }
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
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
      t.shape.push_back(d.get<int64_t>());
      numel *= d.get<uint64_t>();
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
    if (end - begin != numel * DTypeBytes(t.dtype)) {
      return bad(absl::StrCat("data_offsets span ", end - begin, " bytes, shape and dtype need ",
                              numel * DTypeBytes(t.dtype)));
    }
    t.data = absl::MakeConstSpan(data_begin + begin, end - begin);
    view->tensors_.push_back(std::move(t));
  }
  std::sort(view->tensors_.begin(), view->tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.data.data() < b.data.data();
            });
  return view;
}

SafetensorsView::~SafetensorsView() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
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
      if (absl::EndsWith(name, ".safetensors")) {
        in_dir.push_back(absl::StrCat(path, absl::EndsWith(path, "/") ? "" : "/", name));
      }
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
