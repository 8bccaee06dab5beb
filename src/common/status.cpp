#include "cleave/common/status.h"

namespace cleave {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  std::string s(status_code_name(code_));
  s += ": ";
  s += message_;
  return s;
}

Status Status::with_context(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

#define CLEAVE_STATUS_FN(name, code) \
  Status name(std::string message) { return Status(StatusCode::code, std::move(message)); }
CLEAVE_STATUS_FN(InvalidArgument, kInvalidArgument)
CLEAVE_STATUS_FN(NotFound, kNotFound)
CLEAVE_STATUS_FN(OutOfRange, kOutOfRange)
CLEAVE_STATUS_FN(DataLoss, kDataLoss)
CLEAVE_STATUS_FN(Internal, kInternal)
CLEAVE_STATUS_FN(Unimplemented, kUnimplemented)
CLEAVE_STATUS_FN(ResourceExhausted, kResourceExhausted)
CLEAVE_STATUS_FN(FailedPrecondition, kFailedPrecondition)
CLEAVE_STATUS_FN(Unavailable, kUnavailable)
CLEAVE_STATUS_FN(DeadlineExceeded, kDeadlineExceeded)
CLEAVE_STATUS_FN(Cancelled, kCancelled)
CLEAVE_STATUS_FN(AlreadyExists, kAlreadyExists)
CLEAVE_STATUS_FN(Unauthenticated, kUnauthenticated)
CLEAVE_STATUS_FN(PermissionDenied, kPermissionDenied)
CLEAVE_STATUS_FN(Aborted, kAborted)
#undef CLEAVE_STATUS_FN

}  // namespace cleave
