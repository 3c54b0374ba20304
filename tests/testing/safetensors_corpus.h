// Test helpers for safetensors files: raw file images built from a header
// string, and a corpus of malformed files with the message fragment the
// reader must name for each.
//
// Used by the reader's own tests and by anything that feeds operator-named
// files to the reader (Reload, refitctl push), which should reject the same
// corpus with INVALID_ARGUMENT. Plain functions; thread-compatible.
#ifndef REFIT_TESTS_TESTING_SAFETENSORS_CORPUS_H_
#define REFIT_TESTS_TESTING_SAFETENSORS_CORPUS_H_

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace refit::testing {

// The 8-byte little-endian length prefix followed by `rest`; `header_len` need
// not match `rest`, so forged lengths can be written.
inline std::string SafetensorsImageWithLength(uint64_t header_len, absl::string_view rest) {
  std::string image(8, '\0');
  for (int i = 0; i < 8; ++i) image[i] = static_cast<char>((header_len >> (8 * i)) & 0xff);
  image.append(rest.data(), rest.size());
  return image;
}

// A well-formed container: prefix, `header_json` verbatim, then `data`.
inline std::string SafetensorsImage(absl::string_view header_json, absl::string_view data) {
  std::string rest(header_json);
  rest.append(data.data(), data.size());
  return SafetensorsImageWithLength(header_json.size(), rest);
}

// Writes `bytes` to `path`, replacing it. False on any I/O error.
inline bool WriteFileBytes(const std::string& path, absl::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

struct MalformedSafetensors {
  std::string name;              // short id, usable as a file name
  std::string bytes;             // the whole file
  std::string message_fragment;  // must appear in the INVALID_ARGUMENT message
};

// Each entry breaks exactly one rule of the format.
inline std::vector<MalformedSafetensors> MalformedSafetensorsCorpus() {
  const std::string data16(16, '\x01');
  auto tensor = [&](absl::string_view name, absl::string_view body) {
    return SafetensorsImage(
        std::string("{\"") + std::string(name) + "\":" + std::string(body) + "}", data16);
  };
  return {
      {"short_file", "abc", "shorter than the 8-byte header length"},
      {"length_past_eof", SafetensorsImageWithLength(1000, "{}"),
       "header length 1000 runs past the end of the file"},
      {"length_over_cap", SafetensorsImageWithLength(uint64_t{1} << 62, "{}"), "exceeds the limit"},
      {"not_json", SafetensorsImage("{\"w\": {\"dtype\": ", data16), "not valid JSON"},
      {"json_array", SafetensorsImage("[1, 2]", data16), "not a JSON object (got array)"},
      {"entry_not_object", tensor("w", "5"), "tensor \"w\": entry must be an object"},
      {"missing_dtype", tensor("w", R"({"shape":[2],"data_offsets":[0,8]})"),
       "tensor \"w\": missing \"dtype\""},
      {"dtype_not_string", tensor("w", R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})"),
       "tensor \"w\": \"dtype\" must be a string"},
      {"unknown_dtype", tensor("w", R"({"dtype":"F12","shape":[2],"data_offsets":[0,8]})"),
       "tensor \"w\": \"dtype\": unknown dtype \"F12\""},
      {"missing_shape", tensor("w", R"({"dtype":"F32","data_offsets":[0,8]})"),
       "tensor \"w\": missing \"shape\""},
      {"shape_not_list", tensor("w", R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})"),
       "tensor \"w\": \"shape\" must be a list"},
      {"negative_dim", tensor("w", R"({"dtype":"F32","shape":[2,-1],"data_offsets":[0,8]})"),
       "tensor \"w\": \"shape\" [2,-1]: dimension 1 is -1"},
      {"fractional_dim", tensor("w", R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,8]})"),
       "tensor \"w\": \"shape\" [2.5]: dimension 0 is 2.5"},
      {"overflowing_shape",
       tensor("w", R"({"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]})"),
       "tensor \"w\": \"shape\" [4294967296,4294967296,16] overflows"},
      {"overflowing_bytes",
       tensor("w", R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]})"),
       "tensor \"w\": \"shape\" [4611686018427387904] of F64 overflows"},
      {"dim_above_int64",
       tensor("w", R"({"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,8]})"),
       "tensor \"w\": \"shape\" [18446744073709551615] overflows"},
      {"missing_offsets", tensor("w", R"({"dtype":"F32","shape":[2]})"),
       "tensor \"w\": missing \"data_offsets\""},
      {"offsets_wrong_length", tensor("w", R"({"dtype":"F32","shape":[2],"data_offsets":[0]})"),
       "tensor \"w\": \"data_offsets\" must be [begin, end]"},
      {"offsets_not_integers", tensor("w", R"({"dtype":"F32","shape":[2],"data_offsets":["0",8]})"),
       "tensor \"w\": \"data_offsets\" must be [begin, end]"},
      {"end_before_begin", tensor("w", R"({"dtype":"F32","shape":[0],"data_offsets":[8,4]})"),
       "tensor \"w\": \"data_offsets\" [8, 4] end before begin"},
      {"range_past_eof", tensor("w", R"({"dtype":"F32","shape":[6],"data_offsets":[0,24]})"),
       "tensor \"w\": \"data_offsets\" [0, 24] extend past the end of the data section (16 "
       "bytes)"},
      {"size_mismatch",
       tensor("x.weight", R"({"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]})"),
       "tensor \"x.weight\": \"data_offsets\" [0, 10] hold 10 bytes but shape [2, 3] of BF16 "
       "needs 12"},
      {"overlap",
       SafetensorsImage(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        data16),
       "tensors \"a\" [0, 8] and \"b\" [4, 12] overlap"},
      {"empty_inside_other",
       SafetensorsImage(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                        R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                        data16),
       "tensors \"a\" [0, 16] and \"e\" [4, 4] overlap"},
      {"deep_nesting",
       SafetensorsImage("{\"a\":" + std::string(40, '[') + std::string(40, ']') + "}", ""),
       "header nests deeper than 16 levels"},
      {"duplicate_name",
       SafetensorsImage(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                        data16),
       "header names \"a\" twice"},
      {"metadata_not_object", SafetensorsImage(R"({"__metadata__":["x"]})", ""),
       "\"__metadata__\" must be an object of strings"},
      {"metadata_not_strings", SafetensorsImage(R"({"__metadata__":{"format":"pt","n":1}})", ""),
       "\"__metadata__\" must map strings to strings, but the value of \"n\" is 1"},
  };
}

}  // namespace refit::testing

#endif  // REFIT_TESTS_TESTING_SAFETENSORS_CORPUS_H_
