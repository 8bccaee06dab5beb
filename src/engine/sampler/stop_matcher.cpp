// StopMatcher: stop strings in streamed text, across token boundaries.
#include <algorithm>

#include "cleave/engine/sampler.h"

namespace cleave {

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

StopMatcher::Update StopMatcher::push(std::string_view text) {
  Update update;
  if (stopped_) {
    update.stopped = true;
    return update;
  }
  if (stops_.empty()) {
    update.emit.assign(text);
    return update;
  }
  held_.append(text);

  // The match that completes first (earliest end), then the one that starts first. held_ never
  // contains a whole stop string before this push, so any match ends inside the new text.
  size_t best_start = std::string::npos;
  size_t best_end = std::string::npos;
  const std::string* best = nullptr;
  for (const std::string& stop : stops_) {
    const size_t pos = held_.find(stop);
    if (pos == std::string::npos) continue;
    const size_t end = pos + stop.size();
    if (best == nullptr || end < best_end || (end == best_end && pos < best_start)) {
      best_start = pos;
      best_end = end;
      best = &stop;
    }
  }
  if (best != nullptr) {
    update.emit = held_.substr(0, best_start);
    update.stopped = true;
    update.matched = *best;
    held_.clear();
    stopped_ = true;
    return update;
  }

  // Hold back the longest suffix of held_ that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& stop : stops_) {
    const size_t max_len = std::min(stop.size() - 1, held_.size());
    for (size_t len = max_len; len > hold; --len) {
      if (std::string_view(held_).substr(held_.size() - len) ==
          std::string_view(stop).substr(0, len)) {
        hold = len;
        break;
      }
    }
  }
  update.emit = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  return update;
}

std::string StopMatcher::flush() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace cleave
