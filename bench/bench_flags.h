// The benches' command lines: "--flag value" and "--switch" arguments, walked in order. A
// missing or bad value, or an unknown argument, prints the bench's name and the problem, then
// its usage line, to stderr and exits 2; --help and -h print the usage line and exit 2.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fmt/format.h"

namespace cleave::bench {

class BenchFlags {
 public:
  // `usage`: the whole usage line, e.g. "usage: x_bench [--model FILE] [--json FILE]".
  BenchFlags(std::string name, std::string usage, int argc, char** argv)
      : name_(std::move(name)), usage_(std::move(usage)), argc_(argc), argv_(argv) {}

  // Moves to the next argument; false when there is none. --help and -h end the program.
  bool next() {
    if (++i_ >= argc_) return false;
    arg_ = argv_[i_];
    if (arg_ == "--help" || arg_ == "-h") fail("");
    return true;
  }

  bool is(std::string_view flag) const { return arg_ == flag; }
  const std::string& arg() const { return arg_; }

  // The argument after the current flag.
  std::string value() {
    if (i_ + 1 >= argc_) fail(arg_ + " needs a value");
    return argv_[++i_];
  }

  // value() split at commas ("f32,f16" -> {"f32", "f16"}; "" -> {""}).
  std::vector<std::string> values() {
    const std::string list = value();
    std::vector<std::string> out;
    for (size_t start = 0; start <= list.size();) {
      const size_t comma = std::min(list.find(',', start), list.size());
      out.push_back(list.substr(start, comma - start));
      start = comma + 1;
    }
    return out;
  }

  // value() as an integer >= min.
  int64_t integer(int64_t min) { return integer_of(value(), min); }

  // `text` (a value of the current flag, or a piece of one) as an integer >= min.
  int64_t integer_of(const std::string& text, int64_t min) const {
    char* end = nullptr;
    const long long n = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || n < min) {
      fail(fmt::format("{} wants an integer >= {}, got '{}'", arg_, min, text));
    }
    return n;
  }

  [[noreturn]] void unknown() const { fail("unknown argument '" + arg_ + "'"); }

  [[noreturn]] void fail(const std::string& problem) const {
    if (!problem.empty()) fmt::print(stderr, "{}: {}\n", name_, problem);
    fmt::print(stderr, "{}\n", usage_);
    std::exit(2);
  }

 private:
  std::string name_, usage_;
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string arg_;
};

}  // namespace cleave::bench
