#include "server/push_message.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <cstdint>

namespace refit::server {
namespace {

// PushRequest.chunks: field 2, length-delimited.
constexpr uint8_t kChunksTag = (2 << 3) | 2;

// Decodes the varint at data[0..size) into *value; returns its length, or 0
// when it does not end within 5 bytes (a length field is a uint32).
int ReadVarint32(const uint8_t* data, int size, uint32_t* value) {
  uint32_t result = 0;
  for (int i = 0; i < size && i < 5; ++i) {
    result |= static_cast<uint32_t>(data[i] & 0x7f) << (7 * i);
    if ((data[i] & 0x80) == 0) {
      *value = result;
      return i + 1;
    }
  }
  return 0;
}

}  // namespace

bool PushMessage::Parse(grpc::ByteBuffer* raw, size_t keep_limit) {
  const size_t total = raw->Length();
  if (total == 0) {  // an empty message (no kind); its buffer may hold no slices
    raw->Clear();
    is_chunks_ = false;
    request_.Clear();
    return true;
  }
  bool parsed = false;
  {
    grpc::ProtoBufferReader reader(raw);
    if (!reader.status().ok()) {
      raw->Clear();
      return false;
    }
    // The common case: the whole message is one Chunks field (tag, length,
    // Chunks). Its header lies in the first slice.
    const void* data = nullptr;
    int size = 0;
    bool fast = false;
    int header = 0;
    if (reader.Next(&data, &size) && size > 1) {
      const auto* bytes = static_cast<const uint8_t*>(data);
      uint32_t length = 0;
      const int varint = bytes[0] == kChunksTag ? ReadVarint32(bytes + 1, size - 1, &length) : 0;
      header = 1 + varint;
      fast = varint > 0 && header + static_cast<size_t>(length) == total;
    }
    if (fast) {
      reader.BackUp(size - header);
      is_chunks_ = true;
      // Parsing keeps each string's capacity and grows it where this
      // message's chunk is larger, so afterwards at most what was kept plus
      // this message is held: drop what was kept when that could pass the
      // limit.
      if (retained_ + total > keep_limit) {
        chunks_ = v1::Chunks();
        elements_ = 0;
        retained_ = 0;
      }
      parsed = chunks_.ParseFromZeroCopyStream(&reader);
      if (parsed) FreeUnused();
    } else {
      is_chunks_ = false;
      grpc::ProtoBufferReader whole(raw);
      parsed = whole.status().ok() && request_.ParseFromZeroCopyStream(&whole);
    }
  }
  raw->Clear();
  return parsed;
}

void PushMessage::FreeUnused() {
  // Clear() keeps the Chunk objects beyond this message's count out of
  // sight, with their strings: bring them back and free them, so that what is
  // kept is only what this message used.
  const int used = chunks_.chunks_size();
  if (elements_ > used) {
    for (int i = used; i < elements_; ++i) chunks_.add_chunks();
    chunks_.mutable_chunks()->DeleteSubrange(used, elements_ - used);
  }
  elements_ = used;
  size_t retained = 0;
  for (const v1::Chunk& chunk : chunks_.chunks()) {
    retained += chunk.data().capacity() + chunk.tensor_name().capacity();
  }
  retained_ = retained;
}

}  // namespace refit::server
