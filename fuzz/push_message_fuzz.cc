// Fuzz target: PushMessage::Parse, which every Push message a client sends
// passes through, on the fast path (chunk bytes left in the received slices)
// or the full parse. Input: one byte choosing how the message is cut into
// slices (gRPC hands a message over in slices of any size), then the
// message's bytes.
//
// Checks: Parse accepts exactly what PushRequest::ParseFromString accepts,
// and gives the same message: the same kind, and for Chunks the same chunks
// once each chunk's data is gathered from its pieces, which lie within the
// received bytes (AddressSanitizer reports any read past them). Parsing the
// message a second time with the same PushMessage (its kept objects reused)
// gives the same again.
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "refit/v1/refit.pb.h"
#include "server/push_message.h"

namespace {

using refit::server::PushMessage;
namespace v1 = refit::v1;

grpc::ByteBuffer Buffer(const uint8_t* data, size_t size, size_t slice_size) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < size; at += slice_size) {
    slices.emplace_back(data + at, std::min(slice_size, size - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void CheckSame(const PushMessage& message, const v1::PushRequest& expected) {
  FUZZ_CHECK(message.kind() == expected.kind_case());
  if (expected.kind_case() != v1::PushRequest::kChunks) return;
  v1::Chunks gathered = message.chunks();
  FUZZ_CHECK(gathered.chunks_size() == expected.chunks().chunks_size());
  for (int i = 0; i < gathered.chunks_size(); ++i) {
    std::string data;
    for (absl::Span<const uint8_t> piece : message.data_pieces(i)) {
      data.append(reinterpret_cast<const char*>(piece.data()), piece.size());
    }
    FUZZ_CHECK(data.size() == message.data_size(i));
    if (message.zero_copy()) FUZZ_CHECK(gathered.chunks(i).data().empty());
    gathered.mutable_chunks(i)->set_data(std::move(data));
  }
  FUZZ_CHECK(gathered.SerializeAsString() == expected.chunks().SerializeAsString());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static constexpr size_t kSliceSizes[] = {1, 2, 3, 5, 8, 64, 4096, size_t{1} << 30};
  const size_t slice_size = kSliceSizes[data[0] % 8];
  ++data;
  --size;
  v1::PushRequest expected;
  const bool valid = expected.ParseFromArray(data, static_cast<int>(size));
  PushMessage message;
  for (int round = 0; round < 2; ++round) {
    grpc::ByteBuffer raw = Buffer(data, size, slice_size);
    const bool parsed = message.Parse(&raw, size_t{64} << 20);
    FUZZ_CHECK(parsed == valid);
    FUZZ_CHECK(raw.Length() == 0);
    if (parsed) CheckSame(message, expected);
  }
  return 0;
}
