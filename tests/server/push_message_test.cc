// PushMessage: every encoding of a PushRequest parses as PushRequest would;
// the usual one leaves each chunk's bytes in the received slices (pieces),
// whatever the slice sizes; a stream of Chunks messages reuses the same
// Chunk objects instead of allocating them per message; malformed input is
// refused, never read past.
#include "server/push_message.h"

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::server {
namespace {

// The stream's receive limit in these tests.
constexpr size_t kLimit = size_t{8} << 20;

// `bytes` as a ByteBuffer of slices of at most `slice_size` bytes (gRPC
// hands large messages over in many slices).
grpc::ByteBuffer Buffer(const std::string& bytes, size_t slice_size = 1 << 20) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += slice_size) {
    slices.emplace_back(bytes.data() + at, std::min(slice_size, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// The chunks as parsed, with each chunk's `data` gathered from its pieces.
v1::Chunks Gathered(const PushMessage& message) {
  v1::Chunks out = message.chunks();
  for (int i = 0; i < out.chunks_size(); ++i) {
    std::string data;
    for (absl::Span<const uint8_t> piece : message.data_pieces(i)) {
      data.append(reinterpret_cast<const char*>(piece.data()), piece.size());
    }
    EXPECT_EQ(data.size(), message.data_size(i)) << i;
    out.mutable_chunks(i)->set_data(std::move(data));
  }
  return out;
}

std::string Varint(uint64_t value) {
  std::string out;
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
  return out;
}

// A PushRequest that is one Chunks field of these encoded Chunk messages.
std::string ChunksWire(const std::vector<std::string>& chunks) {
  std::string body;
  for (const std::string& chunk : chunks) body += "\x0a" + Varint(chunk.size()) + chunk;
  return "\x12" + Varint(body.size()) + body;
}

v1::PushRequest ChunksRequest(const std::string& name, size_t bytes, char fill) {
  v1::PushRequest request;
  v1::Chunk* chunk = request.mutable_chunks()->add_chunks();
  chunk->set_tensor_name(name);
  chunk->set_dtype(v1::DTYPE_BF16);
  chunk->add_shape(static_cast<int64_t>(bytes / 2));
  chunk->set_byte_offset(0);
  chunk->set_data(std::string(bytes, fill));
  chunk->set_xxh3(42);
  return request;
}

TEST(PushMessageTest, ChunkBytesStayInTheSlicesAndChunkObjectsAreReused) {
  PushMessage message;
  const v1::PushRequest first = ChunksRequest("model.layers.0.mlp.up_proj.weight", 3 << 20, 'a');
  grpc::ByteBuffer raw = Buffer(first.SerializeAsString(), 16 << 10);
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  EXPECT_EQ(raw.Length(), 0u) << "the buffer is consumed";
  ASSERT_EQ(message.kind(), v1::PushRequest::kChunks);
  EXPECT_TRUE(message.zero_copy());
  EXPECT_TRUE(message.chunks().chunks(0).data().empty()) << "the bytes were not copied";
  EXPECT_GT(message.data_pieces(0).size(), 190u) << "one piece per 16 KiB slice";
  EXPECT_EQ(Gathered(message).SerializeAsString(), first.chunks().SerializeAsString());
  const v1::Chunk* object = &message.chunks().chunks(0);

  // The next message: the same Chunk object.
  const v1::PushRequest second = ChunksRequest("model.layers.0.mlp.down_proj.weight", 1 << 20, 'b');
  raw = Buffer(second.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  EXPECT_TRUE(message.zero_copy());
  EXPECT_EQ(Gathered(message).SerializeAsString(), second.chunks().SerializeAsString());
  EXPECT_EQ(&message.chunks().chunks(0), object);
  EXPECT_LE(message.retained_bytes(), size_t{1} << 10) << "only names are kept";

  // Released slices: the sizes stay, the pieces are gone.
  message.ReleaseSlices();
  EXPECT_TRUE(message.data_pieces(0).empty());
  EXPECT_EQ(message.data_size(0), size_t{1} << 20);
}

TEST(PushMessageTest, EverySliceSizeGivesTheSameChunks) {
  v1::PushRequest request;
  for (int i = 0; i < 5; ++i) {
    v1::Chunk* chunk = request.mutable_chunks()->add_chunks();
    chunk->set_tensor_name(absl::StrCat("model.layers.", i, ".mlp.gate_proj.weight"));
    chunk->set_dtype(i % 2 == 0 ? v1::DTYPE_BF16 : v1::DTYPE_F32);
    chunk->add_shape(300 + i);
    chunk->add_shape(7);
    chunk->set_byte_offset(static_cast<uint64_t>(i) << 33);
    std::string data(static_cast<size_t>(i * 997), '\0');
    for (size_t b = 0; b < data.size(); ++b) data[b] = static_cast<char>(b * 31 + i);
    chunk->set_data(data);
    if (i != 3) chunk->set_xxh3(0xfedcba9876543210ull + i);
  }
  // A region chunk and a chunk of no bytes at all.
  v1::Chunk* region = request.mutable_chunks()->add_chunks();
  region->set_tensor_name("lm_head.weight");
  region->mutable_region()->set_region_id("r-9");
  region->mutable_region()->set_length(4096);
  request.mutable_chunks()->add_chunks();
  const std::string wire = request.SerializeAsString();
  for (size_t slice :
       {size_t{1}, size_t{2}, size_t{3}, size_t{7}, size_t{64}, size_t{1000}, wire.size()}) {
    SCOPED_TRACE(absl::StrCat("slices of ", slice));
    PushMessage message;
    grpc::ByteBuffer raw = Buffer(wire, slice);
    ASSERT_TRUE(message.Parse(&raw, kLimit));
    EXPECT_TRUE(message.zero_copy());
    ASSERT_EQ(message.kind(), v1::PushRequest::kChunks);
    EXPECT_EQ(Gathered(message).SerializeAsString(), request.chunks().SerializeAsString());
    EXPECT_TRUE(message.chunks().chunks(5).has_region());
    EXPECT_TRUE(message.chunks().chunks(1).has_xxh3());
    EXPECT_FALSE(message.chunks().chunks(3).has_xxh3());
  }
}

TEST(PushMessageTest, FieldsInAnyOrderAndUnknownFieldsStayOnTheFastPath) {
  // data first, then the metadata in reverse order, with unknown varint,
  // fixed32, fixed64 and length-delimited fields between.
  const std::string data(5000, 'd');
  const std::string chunk = "\x2a" + Varint(data.size()) + data +               // data
                            std::string("\xa0\x01\x05", 3) +                    // field 20, varint
                            "\x30" + Varint(77) +                               // xxh3
                            std::string("\xad\x01\x01\x02\x03\x04", 6) +        // field 21, fixed32
                            "\x20" + Varint(4096) +                             // byte_offset
                            std::string("\xb1\x01", 2) + std::string(8, 'x') +  // field 22, fixed64
                            "\x1a\x02\x02\x03" +  // shape [2, 3], packed
                            std::string(
                                "\xba\x01\x03"
                                "abc",
                                6) +      // field 23, bytes
                            "\x10\x01" +  // dtype
                            "\x0a\x01w";  // tensor_name
  const std::string wire = ChunksWire({chunk});
  v1::PushRequest expected;
  ASSERT_TRUE(expected.ParseFromString(wire));
  for (size_t slice : {size_t{1}, size_t{5}, size_t{4096}}) {
    PushMessage message;
    grpc::ByteBuffer raw = Buffer(wire, slice);
    ASSERT_TRUE(message.Parse(&raw, kLimit));
    EXPECT_TRUE(message.zero_copy()) << slice;
    EXPECT_EQ(Gathered(message).SerializeAsString(), expected.chunks().SerializeAsString());
    EXPECT_EQ(message.chunks().chunks(0).xxh3(), 77u);
    EXPECT_EQ(message.chunks().chunks(0).byte_offset(), 4096u);
  }
}

TEST(PushMessageTest, UnusualChunkEncodingsTakeTheFullParse) {
  const std::string data(300, 'p');
  const std::string plain = ChunksRequest("a", 8, 'a').chunks().chunks(0).SerializeAsString();
  v1::Chunk with_region;
  with_region.set_tensor_name("r");
  with_region.mutable_region()->set_region_id("x");
  const std::vector<std::string> wires = {
      // data twice: the last one wins
      ChunksWire({"\x0a\x01q\x2a\x02zz\x2a" + Varint(data.size()) + data}),
      // a group (unknown field 9)
      ChunksWire({plain + "\x4b\x08\x01\x4c"}),
      // data and a region in one chunk (refused by the ingest, which needs
      // to see both)
      ChunksWire({with_region.SerializeAsString() + "\x2a\x01z"}),
      // a Chunk's tag written in two bytes
      "\x12" + Varint(3 + plain.size()) + std::string("\x8a\x00", 2) + Varint(plain.size()) + plain,
      // the plain encoding (parsed in place)
      ChunksWire({plain}),
  };
  std::vector<std::string> all = wires;
  std::string extra = ChunksWire({plain});
  extra[1] = static_cast<char>(extra[1] + 2);  // Chunks holds an unknown varint field 2 too
  extra += "\x10\x05";
  all.push_back(extra);
  for (size_t w = 0; w < all.size(); ++w) {
    v1::PushRequest expected;
    ASSERT_TRUE(expected.ParseFromString(all[w])) << w;
    for (size_t slice : {size_t{1}, size_t{3}, size_t{1 << 20}}) {
      SCOPED_TRACE(absl::StrCat("wire ", w, " slices of ", slice));
      PushMessage message;
      grpc::ByteBuffer raw = Buffer(all[w], slice);
      ASSERT_TRUE(message.Parse(&raw, kLimit));
      ASSERT_EQ(message.kind(), v1::PushRequest::kChunks);
      EXPECT_EQ(message.zero_copy(), w == 4) << "only the plain one is parsed in place";
      EXPECT_EQ(Gathered(message).SerializeAsString(), expected.chunks().SerializeAsString());
    }
  }
}

// A client that moves one large chunk one position further in every
// message, behind ever more tiny ones, would grow one string per position
// of the full parse (here forced by a second, empty `data`): what a buffer
// keeps stays within the limit.
TEST(PushMessageTest, KeptCapacityStaysWithinTheLimitWhateverTheChunkOrder) {
  PushMessage message;
  constexpr size_t kBig = size_t{1} << 20;
  const auto full_parse = [](const v1::Chunk& chunk) {
    return std::string("\x2a\x00", 2) + chunk.SerializeAsString();
  };
  for (int k = 0; k < 40; ++k) {
    std::vector<std::string> chunks;
    v1::Chunk tiny;
    tiny.set_tensor_name("t");
    tiny.set_data("xy");
    for (int i = 0; i < k; ++i) chunks.push_back(full_parse(tiny));
    v1::Chunk big;
    big.set_tensor_name("big");
    big.set_data(std::string(kBig, 'b'));
    chunks.push_back(full_parse(big));
    grpc::ByteBuffer raw = Buffer(ChunksWire(chunks));
    ASSERT_TRUE(message.Parse(&raw, kLimit));
    EXPECT_FALSE(message.zero_copy());
    ASSERT_EQ(message.chunks().chunks_size(), k + 1);
    EXPECT_EQ(message.data_size(k), kBig);
    EXPECT_EQ(message.chunks().chunks(k).data().size(), kBig);
    EXPECT_LE(message.retained_bytes(), kLimit) << k;
  }
  // Fewer chunks than before: the Chunk objects beyond them are freed with
  // their bytes.
  const v1::PushRequest small = ChunksRequest("lm_head.weight", 64, 'c');
  grpc::ByteBuffer raw = Buffer(small.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  EXPECT_TRUE(message.zero_copy());
  EXPECT_LE(message.retained_bytes(), kLimit);
  EXPECT_EQ(message.chunks().chunks_size(), 1);
  // Under the limit, same-shaped messages of the full parse keep their
  // storage.
  v1::Chunk layer;
  layer.set_tensor_name("w");
  layer.set_data(std::string(2 << 20, 'w'));
  const std::string wire = ChunksWire({full_parse(layer)});
  raw = Buffer(wire);
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  const char* storage = message.chunks().chunks(0).data().data();
  for (int i = 0; i < 3; ++i) {
    raw = Buffer(wire);
    ASSERT_TRUE(message.Parse(&raw, kLimit));
    EXPECT_EQ(message.chunks().chunks(0).data().data(), storage);
  }
}

TEST(PushMessageTest, BeginEndAndEmptyMessages) {
  PushMessage message;
  v1::PushRequest begin;
  begin.mutable_begin()->set_refit_id("r-1");
  begin.mutable_begin()->set_streams(2);
  grpc::ByteBuffer raw = Buffer(begin.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  ASSERT_EQ(message.kind(), v1::PushRequest::kBegin);
  EXPECT_EQ(message.request().begin().refit_id(), "r-1");
  EXPECT_EQ(message.request().begin().streams(), 2u);

  v1::PushRequest end;
  end.mutable_end();
  raw = Buffer(end.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  EXPECT_EQ(message.kind(), v1::PushRequest::kEnd);

  // A chunks message after others is still parsed as chunks.
  const v1::PushRequest chunks = ChunksRequest("lm_head.weight", 64, 'c');
  raw = Buffer(chunks.SerializeAsString());
  ASSERT_TRUE(message.Parse(&raw, kLimit));
  ASSERT_EQ(message.kind(), v1::PushRequest::kChunks);
  EXPECT_EQ(message.chunks().chunks(0).tensor_name(), "lm_head.weight");

  grpc::ByteBuffer empty;
  ASSERT_TRUE(message.Parse(&empty, kLimit));
  EXPECT_EQ(message.kind(), v1::PushRequest::KIND_NOT_SET);
}

TEST(PushMessageTest, UnusualButValidEncodingsParseAsPushRequestDoes) {
  // Two Chunks fields in one message merge (protobuf's rule for a repeated
  // message field); Begin then Chunks means the last oneof member wins.
  const std::string a = ChunksRequest("a", 8, 'a').SerializeAsString();
  const std::string b = ChunksRequest("b", 8, 'b').SerializeAsString();
  v1::PushRequest begin;
  begin.mutable_begin()->set_refit_id("x");
  for (const std::string& wire : {a + b, begin.SerializeAsString() + a}) {
    v1::PushRequest expected;
    ASSERT_TRUE(expected.ParseFromString(wire));
    PushMessage message;
    grpc::ByteBuffer raw = Buffer(wire, 3);
    ASSERT_TRUE(message.Parse(&raw, kLimit));
    ASSERT_EQ(message.kind(), expected.kind_case());
    EXPECT_EQ(Gathered(message).SerializeAsString(), expected.chunks().SerializeAsString());
  }
}

TEST(PushMessageTest, MalformedBytesAreRefused) {
  const std::string good = ChunksRequest("model.norm.weight", 256, 'n').SerializeAsString();
  const std::vector<std::string> bad = {
      good.substr(0, good.size() - 7),             // truncated inside the data
      std::string("\x12\xff\xff\xff\xff\x7f", 6),  // a length past the end
      std::string("\x12\x03\x0a\x05xy", 6),        // a Chunk whose name runs past its Chunks
      std::string("\x0f", 1),                      // wire type 7 does not exist
  };
  std::vector<std::string> all = bad;
  const std::string data(100, 'd');
  // Inside a Chunk that claims to be whole: its length past the Chunks, a
  // field's length past the Chunk, a varint of 11 bytes, a fixed64 cut short,
  // field number 0, a name that is not UTF-8.
  all.push_back("\x12\x05\x0a\x09\x2a\x01z");
  all.push_back(ChunksWire({"\x2a" + Varint(data.size() + 1) + data}));
  all.push_back(ChunksWire({"\x20" + std::string(10, '\xff') + "\x01"}));
  all.push_back(ChunksWire({std::string("\x09\x01\x02\x03", 4)}));
  all.push_back(ChunksWire({std::string("\x02\x01z", 3)}));
  all.push_back(ChunksWire({std::string("\x0a\x02\xc3\x28", 4) + "\x2a\x01z"}));
  for (const std::string& wire : all) {
    for (size_t slice : {size_t{1}, size_t{2}, size_t{1 << 20}}) {
      PushMessage message;
      grpc::ByteBuffer raw = Buffer(wire, slice);
      EXPECT_FALSE(message.Parse(&raw, kLimit)) << testing::PrintToString(wire) << " " << slice;
      EXPECT_EQ(raw.Length(), 0u);
    }
  }
}

}  // namespace
}  // namespace refit::server
