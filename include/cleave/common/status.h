// Status and Result<T>: the error currency of every cleave library.
//
// Library code never lets an exception escape; it returns Status (or Result<T>, a value or an
// error). Conversion to gRPC / HTTP / process exit codes happens in one place per frontend.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace cleave {

enum class StatusCode : int {
  kOk = 0,
  kCancelled,
  kInvalidArgument,     // the caller passed something wrong (bad flag, bad request field)
  kDeadlineExceeded,
  kNotFound,
  kAlreadyExists,
  kPermissionDenied,
  kResourceExhausted,   // out of KV blocks, queue full, allocation limit
  kFailedPrecondition,
  kAborted,
  kOutOfRange,
  kUnimplemented,
  kInternal,
  kUnavailable,
  kDataLoss,            // a file or message is corrupt or truncated
  kUnauthenticated,
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message" (or "OK").
  std::string to_string() const;
  // Returns a copy whose message is "context: message".
  Status with_context(std::string_view context) const;

  void ignore_error() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status OutOfRange(std::string message);
Status DataLoss(std::string message);
Status Internal(std::string message);
Status Unimplemented(std::string message);
Status ResourceExhausted(std::string message);
Status FailedPrecondition(std::string message);
Status Unavailable(std::string message);
Status DeadlineExceeded(std::string message);
Status Cancelled(std::string message);
Status AlreadyExists(std::string message);
Status Unauthenticated(std::string message);
Status PermissionDenied(std::string message);
Status Aborted(std::string message);

// A value of type T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}                  // NOLINT: implicit by design
  // An OK status carries no value: the Result holds an Internal error saying so (in every build
  // type), so that a caller never sees ok() false with an OK status().
  Result(Status status)                                      // NOLINT: implicit by design
      : v_(status.ok() ? Internal("Result built from an OK status") : std::move(status)) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace cleave

#define CLEAVE_CONCAT_INNER(a, b) a##b
#define CLEAVE_CONCAT(a, b) CLEAVE_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the current function when it is not OK.
#define CLEAVE_RETURN_IF_ERROR(expr)                   \
  do {                                                 \
    ::cleave::Status cleave_status_ = (expr);          \
    if (!cleave_status_.ok()) return cleave_status_;   \
  } while (0)

// `lhs = value of expr`, or returns its Status from the current function.
#define CLEAVE_ASSIGN_OR_RETURN(lhs, expr) \
  CLEAVE_ASSIGN_OR_RETURN_IMPL(CLEAVE_CONCAT(cleave_result_, __LINE__), lhs, expr)
#define CLEAVE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
