#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "cleave/engine/sampler.h"

namespace cleave {
namespace {

struct Streamed {
  std::string emitted;
  bool stopped = false;
  std::string matched;
};

Streamed stream(StopMatcher& m, const std::vector<std::string>& pieces, bool flush = true) {
  Streamed out;
  for (const std::string& piece : pieces) {
    StopMatcher::Update u = m.push(piece);
    out.emitted += u.emit;
    if (u.stopped) {
      out.stopped = true;
      out.matched = u.matched;
      break;
    }
  }
  if (flush) out.emitted += m.flush();
  return out;
}

TEST(StopMatcher, NoStopsPassesTextThrough) {
  StopMatcher m({});
  EXPECT_EQ(m.push("Hello").emit, "Hello");
  EXPECT_EQ(m.push(" world").emit, " world");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, StopInsideOnePieceCutsBeforeIt) {
  StopMatcher m({"END"});
  StopMatcher::Update u = m.push("Hello END world");
  EXPECT_EQ(u.emit, "Hello ");
  EXPECT_TRUE(u.stopped);
  EXPECT_EQ(u.matched, "END");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, StopSplitAcrossPiecesIsFoundAndHeldBack) {
  StopMatcher m({"END"});
  StopMatcher::Update u = m.push("Hel");
  EXPECT_EQ(u.emit, "Hel");
  u = m.push("lo E");
  EXPECT_EQ(u.emit, "lo ");  // "E" could start "END": held back
  EXPECT_FALSE(u.stopped);
  u = m.push("N");
  EXPECT_EQ(u.emit, "");
  EXPECT_FALSE(u.stopped);
  u = m.push("D more");
  EXPECT_EQ(u.emit, "");
  EXPECT_TRUE(u.stopped);
  EXPECT_EQ(u.matched, "END");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, HeldPrefixIsReleasedWhenItStopsMatching) {
  StopMatcher m({"END"});
  EXPECT_EQ(m.push("xEN").emit, "x");
  EXPECT_EQ(m.push("x").emit, "ENx");
  EXPECT_EQ(m.push("E").emit, "");
  EXPECT_EQ(m.flush(), "E");  // end of generation: held text is emitted
}

TEST(StopMatcher, StopAtStart) {
  StopMatcher m({"###"});
  Streamed s = stream(m, {"#", "##", "after"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.emitted, "");
  EXPECT_EQ(s.matched, "###");
}

TEST(StopMatcher, AfterStopNothingMoreIsEmitted) {
  StopMatcher m({"."});
  EXPECT_TRUE(m.push("a.b").stopped);
  StopMatcher::Update u = m.push("more");
  EXPECT_TRUE(u.stopped);
  EXPECT_EQ(u.emit, "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, OverlappingStopsTheOneCompletingFirstWins) {
  {
    StopMatcher m({"bcd", "abc"});
    StopMatcher::Update u = m.push("xabcd");
    EXPECT_TRUE(u.stopped);
    EXPECT_EQ(u.matched, "abc");  // completes at 4, "bcd" only at 5
    EXPECT_EQ(u.emit, "x");
  }
  {
    StopMatcher m({"bc", "abc"});
    StopMatcher::Update u = m.push("xabc");
    EXPECT_EQ(u.matched, "abc");  // same end: the longer (earlier start) one
    EXPECT_EQ(u.emit, "x");
  }
  {
    // Streamed one byte at a time the result is the same.
    StopMatcher m({"bcd", "abc"});
    Streamed s = stream(m, {"x", "a", "b", "c", "d"});
    EXPECT_EQ(s.matched, "abc");
    EXPECT_EQ(s.emitted, "x");
  }
}

TEST(StopMatcher, SelfOverlappingStop) {
  StopMatcher m({"aab"});
  Streamed s = stream(m, {"a", "a", "a", "b", "z"});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.emitted, "a");
}

TEST(StopMatcher, EmptyStopStringsAreIgnored) {
  StopMatcher m({"", "stop"});
  Streamed s = stream(m, {"go ", "on"});
  EXPECT_FALSE(s.stopped);
  EXPECT_EQ(s.emitted, "go on");
}

TEST(StopMatcher, UnicodeStopSplitInsideACodePoint) {
  const std::string stop = "世界";  // e4 b8 96 e7 95 8c
  StopMatcher m({stop});
  const std::string text = "你好世界!";
  // Pieces that split code points: the detokenizer may deliver bytes like this.
  Streamed s = stream(m, {text.substr(0, 7), text.substr(7, 2), text.substr(9, 3),
                          text.substr(12)});
  EXPECT_TRUE(s.stopped);
  EXPECT_EQ(s.emitted, "你好");
}

TEST(StopMatcher, UnicodeHoldBackKeepsCodePointsWhole) {
  StopMatcher m({"→x"});
  StopMatcher::Update u = m.push("a→");
  EXPECT_EQ(u.emit, "a");  // "→" (3 bytes) held back whole
  u = m.push("b");
  EXPECT_EQ(u.emit, "→b");
  EXPECT_FALSE(u.stopped);
}

// Reference: the whole text at once, the stop that ends first (then starts first).
Streamed reference(const std::string& text, const std::vector<std::string>& stops) {
  Streamed out;
  size_t best_end = std::string::npos, best_start = 0;
  for (const std::string& s : stops) {
    size_t pos = text.find(s);
    if (pos == std::string::npos) continue;
    if (best_end == std::string::npos || pos + s.size() < best_end ||
        (pos + s.size() == best_end && pos < best_start)) {
      best_end = pos + s.size();
      best_start = pos;
      out.matched = s;
    }
  }
  if (best_end == std::string::npos) {
    out.emitted = text;
  } else {
    out.stopped = true;
    out.emitted = text.substr(0, best_start);
  }
  return out;
}

TEST(StopMatcher, AnyChunkingGivesTheSameResultAsTheWholeText) {
  std::mt19937 rng(1234);
  const std::string alphabet = "abc";
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<std::string> stops;
    const int n_stops = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n_stops; ++i) {
      std::string s;
      const int len = 1 + static_cast<int>(rng() % 4);
      for (int j = 0; j < len; ++j) s += alphabet[rng() % alphabet.size()];
      stops.push_back(s);
    }
    std::string text;
    const int len = static_cast<int>(rng() % 24);
    for (int j = 0; j < len; ++j) text += alphabet[rng() % alphabet.size()];
    std::vector<std::string> pieces;
    for (size_t i = 0; i < text.size();) {
      const size_t n = std::min<size_t>(text.size() - i, 1 + rng() % 4);
      pieces.push_back(text.substr(i, n));
      i += n;
    }
    StopMatcher m(stops);
    Streamed got = stream(m, pieces);
    Streamed want = reference(text, stops);
    ASSERT_EQ(got.stopped, want.stopped) << "text=" << text;
    ASSERT_EQ(got.emitted, want.emitted) << "text=" << text;
    ASSERT_EQ(got.matched, want.matched) << "text=" << text;
  }
}

}  // namespace
}  // namespace cleave
