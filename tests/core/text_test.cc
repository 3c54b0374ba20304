#include "core/text.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace refit::core {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::Not;

TEST(EscapeTextTest, EscapesControlBytesQuotesAndInvalidUtf8) {
  EXPECT_EQ(EscapeText("model.layers.0.w"), "model.layers.0.w");
  EXPECT_EQ(EscapeText("a\nb\tc\rd"), "a\\nb\\tc\\rd");
  EXPECT_EQ(EscapeText("say \"hi\" \\ there"), "say \\\"hi\\\" \\\\ there");
  EXPECT_EQ(EscapeText(std::string("nul\0here", 8)), "nul\\x00here");
  EXPECT_EQ(EscapeText("\x1b[31m\x7f"), "\\x1b[31m\\x7f");
  // Valid UTF-8 stays; stray, overlong and surrogate bytes are escaped.
  EXPECT_EQ(EscapeText("gewicht \xC3\xBC \xE2\x9C\x93"), "gewicht \xC3\xBC \xE2\x9C\x93");
  EXPECT_EQ(EscapeText("\xff\xC3"), "\\xff\\xc3");
  EXPECT_EQ(EscapeText("\xC0\xAF"), "\\xc0\\xaf");
  EXPECT_EQ(EscapeText("\xED\xA0\x80"), "\\xed\\xa0\\x80");
}

TEST(BoundedTextTest, CutsLongTextAtACharacterBoundaryAndSaysHowLongItWas) {
  const std::string name(900 * 1024, 'x');
  const std::string bounded = BoundedText(name);
  EXPECT_EQ(bounded, std::string(kMaxQuotedTextBytes, 'x') + "\xE2\x80\xA6(921600 bytes)");
  // A multi-byte character straddling the cut is left out whole.
  const std::string accents = std::string(255, 'a') + "\xC3\xBC" + "tail";
  EXPECT_EQ(BoundedText(accents), std::string(255, 'a') + "\xE2\x80\xA6(261 bytes)");
  EXPECT_EQ(BoundedText("short"), "short");
  EXPECT_EQ(QuoteText("a\"b"), "\"a\\\"b\"");
}

TEST(SanitizeLogTextTest, KeepsOneRecordOnOneLine) {
  const std::string forged = "x\n2026-01-01T00:00:00Z INFO refit_id=r-1 committed version 9";
  const std::string line = SanitizeLogText(forged, 4096);
  EXPECT_THAT(line, Not(HasSubstr("\n")));
  EXPECT_THAT(line, HasSubstr("x\\n2026"));
  // The program's own quotes are left alone.
  EXPECT_EQ(SanitizeLogText("tensor \"w\" bad", 4096), "tensor \"w\" bad");
  EXPECT_THAT(SanitizeLogText(std::string(5000, 'y'), 4096), EndsWith("(5000 bytes)"));
}

}  // namespace
}  // namespace refit::core
