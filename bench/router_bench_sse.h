// HTTP/SSE client side of router_bench: an incremental HTTP/1.1 response parser that yields the
// SSE events of a streamed completion, a blocking keep-alive client (for TTFT and /health) and
// a single-threaded Boost.Asio load of many concurrent streams. Loopback only.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace cleave::bench {

using Clock = std::chrono::steady_clock;

// One HTTP/1.1 response, fed as it arrives. Chunked, Content-Length and close-delimited bodies.
// A 200 text/event-stream body is split into SSE events: each "data:" payload goes to the
// callback; any other body is kept (its first 4 KiB) for error messages.
class HttpResponseParser {
 public:
  using EventFn = std::function<void(std::string_view data)>;

  // Ready for the next response on the same connection.
  void reset();
  // False (and error() says why) on bytes that are not an HTTP/1.1 response.
  bool feed(const char* data, size_t size, const EventFn& on_event);
  // The peer closed: completes a close-delimited body; false when the response was cut short.
  bool on_eof();

  bool head_done() const { return state_ > State::kHead; }
  bool done() const { return state_ == State::kDone; }
  int status() const { return status_; }
  bool keep_alive() const { return keep_alive_; }
  bool event_stream() const { return event_stream_; }
  const std::string& body() const { return body_; }
  const std::string& error() const { return error_; }

 private:
  enum class State { kHead, kChunkSize, kChunkData, kChunkEnd, kTrailer, kLength, kUntilClose, kDone };
  bool parse_head(std::string_view head);
  void on_body(std::string_view bytes, const EventFn& on_event);
  bool fail(std::string why);

  State state_ = State::kHead;
  std::string in_;   // bytes not consumed yet
  std::string sse_;  // SSE text not yet ended by a blank line
  std::string body_;
  std::string error_;
  int status_ = 0;
  bool keep_alive_ = true;
  bool event_stream_ = false;
  uint64_t left_ = 0;  // of the current chunk or of a Content-Length body
};

// What one SSE payload of a completions stream is.
struct SseEvent {
  enum class Kind { kChunk, kUsage, kError, kDone, kOther };
  Kind kind = Kind::kOther;
  int64_t completion_tokens = -1;  // kUsage
};
SseEvent classify_sse(std::string_view data);

// A blocking HTTP/1.1 client on one keep-alive connection to 127.0.0.1:port; every call is
// bounded by its deadline (the connection is closed and reopened after a failure).
class BlockingHttpClient {
 public:
  explicit BlockingHttpClient(int port) : port_(port) {}
  ~BlockingHttpClient();
  BlockingHttpClient(const BlockingHttpClient&) = delete;
  BlockingHttpClient& operator=(const BlockingHttpClient&) = delete;

  struct Response {
    bool ok = false;  // a whole response arrived (whatever its status)
    std::string error;
    int status = 0;
    std::string body;  // a non-SSE body
    // Streams: from the request's first byte sent to the first chunk with a choice.
    double first_chunk_seconds = -1;
    int64_t chunks = 0;
    int64_t completion_tokens = -1;
    bool error_event = false;
    bool done_event = false;
  };
  Response request(std::string_view method, std::string_view target, std::string_view body,
                   Clock::time_point deadline);
  int connects() const { return connects_; }  // connections opened so far

 private:
  bool ensure_connected(Clock::time_point deadline, std::string* error);
  void close_connection();
  int port_;
  int fd_ = -1;
  int connects_ = 0;
  HttpResponseParser parser_;
};

// Opens `streams` TCP connections to 127.0.0.1:port from this thread (at most `max_connecting`
// connects pending at once); once all are connected, sends a POST of `body` to `target` on
// each, reads every SSE chunk to [DONE] and checks each stream's usage against
// `expected_tokens`. Streams still open at `deadline` are closed and counted as timeouts.
struct StreamLoadOptions {
  int port = 0;
  std::string target = "/v1/completions";
  std::string body;
  int64_t streams = 0;
  int64_t expected_tokens = 0;
  int64_t max_connecting = 256;
  Clock::time_point deadline;
};
struct StreamLoadResult {
  int64_t started = 0;     // connections attempted
  int64_t completed = 0;   // 200, [DONE], usage.completion_tokens == expected, no error event
  int64_t wrong_tokens = 0;
  int64_t http_errors = 0;  // status != 200
  int64_t error_events = 0;
  int64_t connect_errors = 0;
  int64_t io_errors = 0;    // resets, EOF before [DONE], malformed responses
  int64_t timeouts = 0;
  int64_t peak_connected = 0;  // TCP connections open at once
  int64_t peak_open = 0;       // streams with their 200 head in and no [DONE] yet, at once
  int64_t all_sent_before_first_done = 0;  // 1 when every request was sent before any ended
  int64_t chunks = 0;      // SSE chunks with a choice, all streams
  double wall_seconds = 0;
  double connect_seconds = 0;    // from the start until every connect had ended
  double all_open_seconds = -1;  // from the first request sent until every head was in (or -1)
  std::string first_error;       // one example
  std::string status_counts;     // "429 x12, 503 x3" for non-200 answers
};
StreamLoadResult run_stream_load(const StreamLoadOptions& options);

}  // namespace cleave::bench
