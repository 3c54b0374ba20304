// Fuzz target: the safetensors reader (SafetensorsFile::FromBytes), the
// parser every untrusted file goes through. Input: a whole file image.
//
// Beyond "no crash, no sanitizer report": an accepted file exposes only
// tensors whose byte ranges lie inside the image's data section, whose sizes
// match dtype x shape, in data-offset order without overlap, each found by
// its name; a rejected one is INVALID_ARGUMENT.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/safetensors.h"
#include "fuzz/fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = refit::core::SafetensorsFile::FromBytes(
      absl::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!file.ok()) {
    FUZZ_CHECK(file.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  // Accepted, so the length prefix was checked: the data section follows it.
  uint64_t header_len = 0;
  FUZZ_CHECK(size >= 8);
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | data[i];
  FUZZ_CHECK(header_len <= size - 8);
  const uint64_t data_size = size - 8 - header_len;
  uint64_t end_of_previous = 0;
  for (const refit::core::TensorEntry& t : (*file)->tensors()) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0);
      numel *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(t.nbytes == numel * refit::core::DTypeSize(t.dtype));
    FUZZ_CHECK(t.offset >= end_of_previous);
    FUZZ_CHECK(t.nbytes <= data_size && t.offset <= data_size - t.nbytes);
    end_of_previous = t.offset + t.nbytes;
    FUZZ_CHECK((*file)->Find(t.name) == &t);
  }
  return 0;
}
