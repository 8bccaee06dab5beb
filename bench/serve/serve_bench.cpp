// The run of `cleave bench serve`: arrivals, the concurrency cap, dependencies between turns,
// the run's time bound, and the progress bar.
#include "cleave/bench/serve_bench.h"

#include <unistd.h>

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <cmath>
#include <cstdio>
#include <deque>

#include <fmt/format.h>

#include "serve_client.h"

namespace cleave::bench {
namespace {

constexpr auto kAwait = net::as_tuple(net::use_awaitable);

std::string request_body(const ServeBenchOptions& o, const WorkloadRequest& r) {
  nlohmann::ordered_json j;
  j["model"] = o.model;
  if (o.endpoint == "chat") {
    j["messages"] = nlohmann::ordered_json::array({{{"role", "user"}, {"content", r.prompt}}});
    j["max_completion_tokens"] = r.output_len;
  } else {
    j["prompt"] = r.prompt;
    j["max_tokens"] = r.output_len;
  }
  j["temperature"] = o.temperature;
  j["stream"] = true;
  j["stream_options"] = {{"include_usage", true}};
  if (o.ignore_eos) j["ignore_eos"] = true;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// One run's state; everything runs on one io_context thread.
class Runner {
 public:
  Runner(const ServeBenchOptions& o, const Workload& w, const HttpTarget& target)
      : o_(o), w_(w), target_(target), pool_(target), progress_timer_(ioc_), records_(w.requests.size()),
        finished_(w.requests.size(), false), dependents_(w.requests.size()) {
    path_ = o.endpoint == "chat" ? "/v1/chat/completions" : "/v1/completions";
  }

  ServeBenchRun run() {
    const size_t n = w_.requests.size();
    // Arrivals: the workload's own, or gamma draws for the requests that start independently.
    int64_t independent = 0;
    for (const auto& r : w_.requests) independent += r.depends_on < 0 && !r.arrival_s;
    const auto drawn = gamma_arrivals(independent, o_.request_rate, o_.burstiness, o_.seed);
    size_t next = 0;
    t0_ = Clock::now();
    run_deadline_ = t0_ + o_.max_duration;
    for (size_t i = 0; i < n; ++i) {
      const auto& r = w_.requests[i];
      if (r.depends_on >= 0 && static_cast<size_t>(r.depends_on) < i) {
        dependents_[static_cast<size_t>(r.depends_on)].push_back(i);
        continue;
      }
      const double at = r.arrival_s ? *r.arrival_s : drawn[next++];
      spawn(i, t0_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at)));
    }
    if (o_.progress) tick();
    ioc_.run();
    ServeBenchRun out;
    out.model = o_.model;
    out.duration_s = std::chrono::duration<double>(end_ - t0_).count();
    out.records = std::move(records_);
    out.metrics = compute_metrics(out.records, out.duration_s, o_.goodput, o_.percentiles);
    return out;
  }

 private:
  void spawn(size_t i, Clock::time_point at) {
    net::co_spawn(ioc_, request(i, at), [this, i](std::exception_ptr e) {
      if (!e || finished_[i]) return;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        fail(i, fmt::format("client error: {}", ex.what()));
      } catch (...) {
        fail(i, "client error");
      }
    });
  }

  net::awaitable<void> request(size_t i, Clock::time_point at) {
    const auto& r = w_.requests[i];
    if (at >= run_deadline_) {
      fail(i, "not sent: its arrival is after the run's --max-duration");
      co_return;
    }
    net::steady_timer arrival(ioc_);
    arrival.expires_at(at);
    co_await arrival.async_wait(kAwait);
    // A finishing request hands its slot to the first waiter by cancelling the waiter's timer;
    // a waiter whose timer reached the run's deadline gives up.
    if (o_.max_concurrency > 0 && in_flight_ >= o_.max_concurrency) {
      auto slot = std::make_shared<net::steady_timer>(ioc_);
      slot->expires_at(run_deadline_);
      waiting_.push_back(slot);
      auto [ec] = co_await slot->async_wait(kAwait);
      if (!ec) {
        fail(i, "not sent: no free slot (--max-concurrency) before the run's --max-duration");
        co_return;
      }
    } else {
      ++in_flight_;
    }
    const auto deadline = std::min(run_deadline_, Clock::now() + o_.request_timeout);
    RequestRecord rec = co_await stream_completion(pool_, target_, path_, request_body(o_, r),
                                                   r.input_len, t0_, deadline);
    bool handed = false;
    while (!handed && !waiting_.empty()) {
      auto w = waiting_.front();
      waiting_.pop_front();
      handed = w->cancel() > 0;
    }
    if (!handed) --in_flight_;
    done(i, std::move(rec));
  }

  void fail(size_t i, std::string why) {
    RequestRecord rec;
    rec.error = std::move(why);
    rec.input_len = w_.requests[i].input_len;
    rec.start_s = std::chrono::duration<double>(Clock::now() - t0_).count();
    done(i, std::move(rec));
  }

  void done(size_t i, RequestRecord rec) {
    const bool ok = rec.success;
    records_[i] = std::move(rec);
    finished_[i] = true;
    ++finished_count_;
    failed_count_ += ok ? 0 : 1;
    end_ = Clock::now();
    for (size_t d : dependents_[i]) {
      const auto& r = w_.requests[d];
      if (!ok) {
        fail(d, fmt::format("not sent: the turn before it (request {}) failed", i));
        continue;
      }
      spawn(d, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(r.delay_s)));
    }
    if (finished_count_ == w_.requests.size()) {
      progress_timer_.cancel();
      pool_.close_all();
      if (o_.progress) draw(true);
    }
  }

  void tick() {
    draw(false);
    progress_timer_.expires_after(std::chrono::milliseconds(isatty(2) ? 200 : 5000));
    progress_timer_.async_wait([this](beast::error_code ec) {
      if (!ec && finished_count_ < w_.requests.size()) tick();
    });
  }

  void draw(bool last) {
    const size_t n = w_.requests.size();
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0_).count();
    constexpr int kWidth = 30;
    const int filled = n ? static_cast<int>(kWidth * finished_count_ / n) : kWidth;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "%s[%s] %zu/%zu requests, %zu failed, %.1f s%s", isatty(2) ? "\r" : "",
                 bar.c_str(), finished_count_, n, failed_count_, elapsed,
                 last || !isatty(2) ? "\n" : "");
    std::fflush(stderr);
  }

  const ServeBenchOptions& o_;
  const Workload& w_;
  const HttpTarget& target_;
  net::io_context ioc_;
  ConnectionPool pool_;
  net::steady_timer progress_timer_;
  std::string path_;
  Clock::time_point t0_, end_, run_deadline_;
  std::vector<RequestRecord> records_;
  std::vector<bool> finished_;
  std::vector<std::vector<size_t>> dependents_;
  std::deque<std::shared_ptr<net::steady_timer>> waiting_;
  int64_t in_flight_ = 0;
  size_t finished_count_ = 0, failed_count_ = 0;
};

}  // namespace

Result<BaseUrl> parse_base_url(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  if (!url.starts_with(kScheme)) {
    return InvalidArgument(fmt::format("--base-url '{}' does not start with http://", url));
  }
  std::string_view rest = url.substr(kScheme.size());
  BaseUrl out;
  const size_t slash = rest.find('/');
  std::string_view hostport = rest.substr(0, slash);
  if (slash != std::string_view::npos) {
    std::string_view prefix = rest.substr(slash);
    while (!prefix.empty() && prefix.back() == '/') prefix.remove_suffix(1);
    if (prefix.ends_with("/v1")) prefix.remove_suffix(3);  // "http://h:p/v1" names the same API
    out.prefix = std::string(prefix);
  }
  const size_t colon = hostport.rfind(':');
  if (colon != std::string_view::npos && hostport.find(']') == std::string_view::npos) {
    const std::string port(hostport.substr(colon + 1));
    char* end = nullptr;
    const long p = std::strtol(port.c_str(), &end, 10);
    if (port.empty() || end != port.c_str() + port.size() || p <= 0 || p > 65535) {
      return InvalidArgument(fmt::format("--base-url '{}': port '{}' is not in 1-65535", url, port));
    }
    out.port = static_cast<uint16_t>(p);
    hostport = hostport.substr(0, colon);
  }
  if (hostport.empty()) return InvalidArgument(fmt::format("--base-url '{}' has no host", url));
  out.host = std::string(hostport);
  return out;
}

Status validate(const ServeBenchOptions& o) {
  CLEAVE_RETURN_IF_ERROR(parse_base_url(o.base_url).status());
  if (o.endpoint != "completions" && o.endpoint != "chat") {
    return InvalidArgument(fmt::format("--endpoint '{}' is not completions or chat", o.endpoint));
  }
  if (!(o.request_rate > 0)) {
    return InvalidArgument(fmt::format("--request-rate {} is not positive (or inf)", o.request_rate));
  }
  if (!(o.burstiness > 0) || !std::isfinite(o.burstiness)) {
    return InvalidArgument(fmt::format("--burstiness {} is not a positive number", o.burstiness));
  }
  if (o.max_concurrency < 0) {
    return InvalidArgument(fmt::format("--max-concurrency {} is negative", o.max_concurrency));
  }
  if (o.request_timeout.count() <= 0 || o.max_duration.count() <= 0) {
    return InvalidArgument("--request-timeout and --max-duration must be positive");
  }
  return Status::Ok();
}

Result<std::string> first_served_model(const ServeBenchOptions& o) {
  CLEAVE_ASSIGN_OR_RETURN(BaseUrl url, parse_base_url(o.base_url));
  CLEAVE_ASSIGN_OR_RETURN(HttpTarget target, resolve_target(url, o.api_key));
  CLEAVE_ASSIGN_OR_RETURN(HttpReply reply, http_get(target, "/v1/models", std::chrono::seconds(30)));
  if (reply.status != 200) {
    return Unavailable(fmt::format("GET /v1/models answered {}: {}", reply.status,
                                   reply.body.substr(0, 300)));
  }
  const auto j = nlohmann::json::parse(reply.body, nullptr, false);
  if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].contains("id") || !j["data"][0]["id"].is_string()) {
    return Unavailable(fmt::format("GET /v1/models lists no model: {}", reply.body.substr(0, 300)));
  }
  return j["data"][0]["id"].get<std::string>();
}

Result<ServeBenchRun> run_serve_bench(const ServeBenchOptions& o, const Workload& w) {
  CLEAVE_RETURN_IF_ERROR(validate(o));
  if (o.model.empty()) return InvalidArgument("no model to request (see first_served_model())");
  if (w.requests.empty()) return InvalidArgument("the workload has no requests");
  CLEAVE_ASSIGN_OR_RETURN(BaseUrl url, parse_base_url(o.base_url));
  CLEAVE_ASSIGN_OR_RETURN(HttpTarget target, resolve_target(url, o.api_key));
  Runner runner(o, w, target);
  return runner.run();
}

}  // namespace cleave::bench
