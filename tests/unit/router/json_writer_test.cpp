// JSON text output: escaping, UTF-8 repair, numbers and the comma-placing writer.
#include "cleave/router/json_writer.h"

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace cleave::openai {
namespace {

using nlohmann::json;

const std::string kFFFD = "\xEF\xBF\xBD";

std::string literal(std::string_view s) {
  std::string out;
  append_json_string(out, s);
  return out;
}

// Parses the literal back; fails the test when it is not valid JSON.
std::string round_trip(std::string_view s) {
  const std::string lit = literal(s);
  json j = json::parse(lit, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "not valid JSON: " << lit;
  return j.is_string() ? j.get<std::string>() : std::string("<not a string>");
}

TEST(JsonWriterTest, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(literal("plain"), "\"plain\"");
  EXPECT_EQ(literal("say \"hi\" \\ bye"), R"("say \"hi\" \\ bye")");
  EXPECT_EQ(literal("a\nb\rc\td\be\ff"), R"("a\nb\rc\td\be\ff")");
  EXPECT_EQ(literal(std::string("\x00\x01\x1f", 3)), R"("\u0000\u0001\u001f")");
  EXPECT_EQ(literal("\x7f"), "\"\x7f\"");  // DEL is legal in JSON strings
  EXPECT_EQ(literal("</script>"), "\"</script>\"");
  for (int c = 0; c < 0x80; ++c) {
    const std::string s(1, static_cast<char>(c));
    EXPECT_EQ(round_trip(s), s) << "byte " << c;
  }
}

TEST(JsonWriterTest, KeepsValidUtf8) {
  const std::string s = "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80 \xE4\xB8\xAD \xEF\xBF\xBF";
  EXPECT_EQ(literal(s), "\"" + s + "\"");
  EXPECT_EQ(round_trip(s), s);
  // U+2028/U+2029 are valid in JSON strings; U+10FFFF is the last code point.
  EXPECT_EQ(round_trip("\xE2\x80\xA8\xE2\x80\xA9\xF4\x8F\xBF\xBF"),
            "\xE2\x80\xA8\xE2\x80\xA9\xF4\x8F\xBF\xBF");
}

TEST(JsonWriterTest, ReplacesInvalidUtf8LikePythonDecodeReplace) {
  // Expected values are Python's bytes.decode("utf-8", errors="replace").
  EXPECT_EQ(round_trip("a\x80z"), "a" + kFFFD + "z");                 // stray continuation
  EXPECT_EQ(round_trip("\xC3"), kFFFD);                               // truncated at the end
  EXPECT_EQ(round_trip("\xE2\x82"), kFFFD);                           // truncated 3-byte
  EXPECT_EQ(round_trip("\xE2\x82x"), kFFFD + "x");                    // interrupted
  EXPECT_EQ(round_trip("\xF0\x9F\x98"), kFFFD);                       // truncated 4-byte
  EXPECT_EQ(round_trip("\xC0\xAF"), kFFFD + kFFFD);                   // overlong '/'
  EXPECT_EQ(round_trip("\xE0\x80\xAF"), kFFFD + kFFFD + kFFFD);       // overlong 3-byte
  EXPECT_EQ(round_trip("\xED\xA0\x80"), kFFFD + kFFFD + kFFFD);       // surrogate U+D800
  EXPECT_EQ(round_trip("\xF4\x90\x80\x80"), kFFFD + kFFFD + kFFFD + kFFFD);  // > U+10FFFF
  EXPECT_EQ(round_trip("\xF5\xFF"), kFFFD + kFFFD);
  EXPECT_EQ(round_trip("\xFE\"\xFF"), kFFFD + "\"" + kFFFD);
  // A byte-fallback token split across chunks: each half alone is invalid.
  EXPECT_EQ(round_trip("\xF0\x9F"), kFFFD);
  EXPECT_EQ(round_trip("\x98\x80"), kFFFD + kFFFD);
}

TEST(JsonWriterTest, Utf8ReplacingRepairsWithoutEscaping) {
  const auto repaired = [](std::string_view text) {
    std::string out = "<";
    append_utf8_replacing(out, text);
    return out;
  };
  EXPECT_EQ(repaired("a\"b\\\n\xC3\xA9"), "<a\"b\\\n\xC3\xA9");  // valid: copied as is
  EXPECT_EQ(repaired("a\x80z"), "<a" + kFFFD + "z");
  EXPECT_EQ(repaired("\xE2\x82x"), "<" + kFFFD + "x");
  EXPECT_EQ(repaired("\xC0\xAF"), "<" + kFFFD + kFFFD);
  EXPECT_EQ(repaired("\xF0\x9F\x98"), "<" + kFFFD);
  // The same replacements as the JSON escaping (which the HTTP API's text goes through).
  std::mt19937 rng(3);
  for (int iter = 0; iter < 500; ++iter) {
    std::string bytes(static_cast<size_t>(rng() % 12), '\0');
    for (auto& b : bytes) b = static_cast<char>(0x80 | (rng() % 0x80));
    std::string plain;
    append_utf8_replacing(plain, bytes);
    std::string escaped;
    append_json_escaped(escaped, bytes);
    EXPECT_EQ(plain, escaped);
  }
}

TEST(JsonWriterTest, RandomBytesAlwaysGiveValidJson) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 2000; ++iter) {
    std::string s(rng() % 40, '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);
    const std::string lit = literal(s);
    const json j = json::parse(lit, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "iteration " << iter;
    ASSERT_TRUE(j.is_string());
  }
}

TEST(JsonWriterTest, CountsCodePointsLikePythonLen) {
  EXPECT_EQ(utf8_code_points(""), 0);
  EXPECT_EQ(utf8_code_points("abc"), 3);
  EXPECT_EQ(utf8_code_points("h\xC3\xA9"), 2);
  EXPECT_EQ(utf8_code_points("\xF0\x9F\x98\x80!"), 2);
  EXPECT_EQ(utf8_code_points("\xE2\x82"), 1);      // one U+FFFD
  EXPECT_EQ(utf8_code_points("\xC0\xAF"), 2);      // two U+FFFD
}

TEST(JsonWriterTest, FormatsNumbers) {
  std::string out;
  append_json_int(out, -9223372036854775807LL - 1);
  EXPECT_EQ(out, "-9223372036854775808");
  out.clear();
  append_json_double(out, 0.1);
  EXPECT_EQ(out, "0.1");
  out.clear();
  append_json_double(out, std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(out, "null");
  out.clear();
  append_json_logprob(out, -0.25f);
  EXPECT_EQ(out, "-0.25");
  out.clear();
  append_json_logprob(out, -std::numeric_limits<float>::infinity());
  EXPECT_EQ(out, "-9999.0");
  out.clear();
  append_json_logprob(out, std::nanf(""));
  EXPECT_EQ(out, "-9999.0");
  // A float's shortest form reads back as the same float.
  out.clear();
  const float f = -1.2345678f;
  append_json_logprob(out, f);
  EXPECT_EQ(static_cast<float>(std::stod(out)), f);
}

TEST(JsonWriterTest, WriterPlacesCommas) {
  std::string out;
  JsonWriter w(out);
  w.begin_object();
  w.key("a").integer(1);
  w.key("b").begin_array().string("x").null().boolean(true).begin_object().end_object().end_array();
  w.key("c").begin_object().key("d").number(1.5).key("e").string_or_null("").end_object();
  w.key("f").raw("[1,2]");
  w.key("we\"ird").begin_array().end_array();
  w.end_object();
  EXPECT_EQ(out, R"({"a":1,"b":["x",null,true,{}],"c":{"d":1.5,"e":null},"f":[1,2],"we\"ird":[]})");
  const json j = json::parse(out);
  EXPECT_EQ(j["b"].size(), 4u);
  EXPECT_TRUE(j["we\"ird"].is_array());
}

}  // namespace
}  // namespace cleave::openai
