#include "cleave/common/log.h"

#include "spdlog/sinks/stdout_color_sinks.h"

namespace cleave {

Status init_logging(const LogOptions& opts) {
  auto level = spdlog::level::from_str(opts.level);
  if (level == spdlog::level::off && opts.level != "off")
    return InvalidArgument("unknown log level '" + opts.level +
                           "' (trace, debug, info, warn, error, off)");
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("cleave", sink);
  std::string tag = opts.role;
  if (!opts.worker_id.empty()) tag += "/" + opts.worker_id;
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [" + tag + "] %v");
  logger->set_level(level);
  spdlog::set_default_logger(logger);
  return Status::Ok();
}

}  // namespace cleave
