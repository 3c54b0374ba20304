#include "server/push_message.h"

#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "absl/base/config.h"

namespace refit::server {
namespace {

// A received message's bytes were written by whichever gRPC thread read the
// socket and handed to this thread inside gRPC, whose synchronization a
// ThreadSanitizer build cannot see: gRPC is not instrumented, so the reads
// of those bytes here and on the ingest thread would be reported as races
// with that write (seen when a client thread of the same process, lent to
// gRPC's poller by a blocking call, did the read). Under ThreadSanitizer the
// message is therefore parsed from a copy that gRPC makes on this thread
// (the copy's read of gRPC's bytes lies in libgrpc, which scripts/tsan.supp
// names); everything after it is checked as usual. Nothing in other builds.
void SlicesHandedOverByGrpc(std::vector<grpc::Slice>* slices) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  for (grpc::Slice& slice : *slices) slice = grpc::Slice(slice.begin(), slice.size());
#else
  (void)slices;
#endif
}

// PushRequest.chunks: field 2, length-delimited.
constexpr uint8_t kChunksTag = (2 << 3) | 2;
// Chunks.chunks: field 1, length-delimited.
constexpr uint8_t kChunkTag = (1 << 3) | 2;
// Chunk.data: field 5.
constexpr uint64_t kDataField = 5;
// Chunk.region: field 7.
constexpr uint64_t kRegionField = 7;
// The most capacity the copy of a chunk's other fields keeps between
// messages.
constexpr size_t kFieldsKeptBytes = size_t{64} << 10;

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

// Reads a message that lies in several slices. Never reads past the last
// slice: every read says whether the bytes were there. While `record` is
// set, the bytes read or skipped are appended to it.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { Settle(); }

  uint64_t position() const { return position_; }
  void Record(std::string* record) { record_ = record; }

  bool ReadByte(uint8_t* byte) {
    if (index_ == slices_.size()) return false;
    *byte = slices_[index_].begin()[at_];
    if (record_ != nullptr) record_->push_back(static_cast<char>(*byte));
    Advance(1);
    return true;
  }

  // A varint of at most 10 bytes.
  bool ReadVarint(uint64_t* value) {
    uint64_t result = 0;
    for (int i = 0; i < 10; ++i) {
      uint8_t byte;
      if (!ReadByte(&byte)) return false;
      result |= static_cast<uint64_t>(byte & 0x7f) << (7 * i);
      if ((byte & 0x80) == 0) {
        *value = result;
        return true;
      }
    }
    return false;
  }

  // Skips n bytes (recorded); n must not pass the end (the caller checks
  // it against a bound within the message).
  bool Skip(uint64_t n) {
    while (n > 0) {
      if (index_ == slices_.size()) return false;
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, slices_[index_].size() - at_));
      if (record_ != nullptr) {
        record_->append(reinterpret_cast<const char*>(slices_[index_].begin() + at_), take);
      }
      Advance(take);
      n -= take;
    }
    return true;
  }

  // The next n bytes, as pieces of the slices (not recorded).
  bool Pieces(uint64_t n, std::vector<absl::Span<const uint8_t>>* pieces) {
    while (n > 0) {
      if (index_ == slices_.size()) return false;
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, slices_[index_].size() - at_));
      pieces->emplace_back(slices_[index_].begin() + at_, take);
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    at_ += n;
    position_ += n;
    Settle();
  }
  // Moves past empty slices and the end of the current one.
  void Settle() {
    while (index_ < slices_.size() && at_ == slices_[index_].size()) {
      ++index_;
      at_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t at_ = 0;
  uint64_t position_ = 0;
  std::string* record_ = nullptr;
};

}  // namespace

bool PushMessage::Parse(grpc::ByteBuffer* raw, size_t keep_limit) {
  zero_copy_ = false;
  slices_.clear();
  pieces_.clear();
  data_.clear();
  const size_t total = raw->Length();
  if (total == 0) {  // an empty message (no kind); its buffer may hold no slices
    raw->Clear();
    is_chunks_ = false;
    request_.Clear();
    return true;
  }
  // References to the received slices, not a copy.
  const bool dumped = raw->Dump(&slices_).ok();
  raw->Clear();
  if (!dumped) return false;
  SlicesHandedOverByGrpc(&slices_);
  const bool in_place = ParseInPlace(keep_limit);
  // What an unusual chunk's fields left there (an unknown field may be
  // large) is not kept.
  if (fields_.capacity() > kFieldsKeptBytes) std::string().swap(fields_);
  if (in_place) return true;

  bool parsed = false;
  {
    grpc::ByteBuffer whole(slices_.data(), slices_.size());
    grpc::ProtoBufferReader reader(&whole);
    if (!reader.status().ok()) {
      slices_.clear();
      return false;
    }
    // A message that is one Chunks field (tag, length, Chunks) goes into
    // the kept Chunks. Its header lies in the first slice.
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
      ResetKept(total, keep_limit);
      parsed = chunks_.ParseFromZeroCopyStream(&reader);
      if (parsed) FreeUnused();
    } else {
      is_chunks_ = false;
      grpc::ByteBuffer again(slices_.data(), slices_.size());
      grpc::ProtoBufferReader all(&again);
      parsed = all.status().ok() && request_.ParseFromZeroCopyStream(&all);
    }
  }
  slices_.clear();
  if (parsed && kind() == v1::PushRequest::kChunks) PiecesFromStrings();
  return parsed;
}

bool PushMessage::ParseInPlace(size_t keep_limit) {
  uint64_t total = 0;
  for (const grpc::Slice& slice : slices_) total += slice.size();
  SliceCursor in(slices_);
  uint8_t tag = 0;
  uint64_t length = 0;
  if (!in.ReadByte(&tag) || tag != kChunksTag || !in.ReadVarint(&length) ||
      length != total - in.position()) {
    return false;
  }
  // Parsing grows what is kept by at most this message (names, shapes).
  ResetKept(static_cast<size_t>(total), keep_limit);
  chunks_.Clear();
  while (in.position() < total) {
    if (!in.ReadByte(&tag) || tag != kChunkTag || !in.ReadVarint(&length) ||
        length > total - in.position()) {
      return false;
    }
    const uint64_t end = in.position() + length;
    DataRange range;
    range.first = pieces_.size();
    bool has_data = false;
    bool has_region = false;
    fields_.clear();
    in.Record(&fields_);
    while (in.position() < end) {
      const size_t mark = fields_.size();
      uint64_t key = 0;
      if (!in.ReadVarint(&key) || key > std::numeric_limits<uint32_t>::max() || (key >> 3) == 0) {
        in.Record(nullptr);
        return false;
      }
      bool ok = true;
      switch (key & 7) {
        case 0: {  // varint
          uint64_t value;
          ok = in.ReadVarint(&value);
          break;
        }
        case 1:  // fixed64
          ok = end - in.position() >= 8 && in.Skip(8);
          break;
        case 5:  // fixed32
          ok = end - in.position() >= 4 && in.Skip(4);
          break;
        case 2: {  // length-delimited
          uint64_t n = 0;
          ok = in.ReadVarint(&n) && in.position() <= end && n <= end - in.position();
          if (!ok) break;
          if ((key >> 3) == kDataField) {
            // A repeated `data` (the last one wins) takes the full parse.
            ok = !has_data;
            if (!ok) break;
            has_data = true;
            fields_.resize(mark);
            in.Record(nullptr);
            ok = in.Pieces(n, &pieces_);
            in.Record(&fields_);
            range.size = n;
          } else {
            has_region |= (key >> 3) == kRegionField;
            ok = in.Skip(n);
          }
          break;
        }
        default:  // groups (3, 4) and wire types that do not exist
          ok = false;
      }
      if (!ok || in.position() > end) {
        in.Record(nullptr);
        return false;
      }
    }
    in.Record(nullptr);
    // Data and a region in one chunk is refused where region chunks are
    // ingested, which reads the data from the parsed message.
    if (has_region && range.size > 0) return false;
    range.count = pieces_.size() - range.first;
    v1::Chunk* chunk = chunks_.add_chunks();
    elements_ = std::max(elements_, chunks_.chunks_size());
    if (!chunk->ParseFromString(fields_)) return false;
    data_.push_back(range);
  }
  FreeUnused();
  is_chunks_ = true;
  zero_copy_ = true;
  return true;
}

void PushMessage::PiecesFromStrings() {
  pieces_.clear();
  data_.clear();
  for (const v1::Chunk& chunk : chunks().chunks()) {
    DataRange range;
    range.first = pieces_.size();
    range.size = chunk.data().size();
    if (!chunk.data().empty()) {
      pieces_.emplace_back(reinterpret_cast<const uint8_t*>(chunk.data().data()),
                           chunk.data().size());
      range.count = 1;
    }
    data_.push_back(range);
  }
}

void PushMessage::ReleaseSlices() {
  if (!zero_copy_) return;
  slices_.clear();
  pieces_.clear();
  for (DataRange& range : data_) range = DataRange{0, 0, range.size};
}

void PushMessage::ResetKept(size_t total, size_t keep_limit) {
  // Parsing keeps each string's capacity and grows it where this message's
  // chunk is larger, so afterwards at most what was kept plus this message
  // is held: drop what was kept when that could pass the limit.
  if (retained_ + total > keep_limit) {
    chunks_ = v1::Chunks();
    elements_ = 0;
    retained_ = 0;
  }
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
