// WorkerSupervisor with real child processes: /bin/sh scripts that behave like `cleave worker`
// (print the listening line for the address they were given, then wait), so that starting,
// restarting on the same address, failing and stopping are exercised without a model.
#include "cleave/router/worker_supervisor.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

namespace cleave::router {
namespace {

using std::chrono::milliseconds;

// sh -c SCRIPT sh --listen HOST:PORT: port 0 becomes a fixed fake port per id (a real worker
// binds a free one); a later start gets the port it printed first.
constexpr const char* kWorkerScript =
    "addr=$2; host=${addr%:*}; port=${addr##*:}; "
    "if [ \"$port\" = 0 ]; then port=$FAKE_PORT; fi; "
    "echo \"cleave worker $ROLE $ID listening on $host:$port\"; "
    "echo extra line; exec sleep 60";

WorkerProcessSpec sh_worker(const std::string& pool, const std::string& id, int fake_port,
                            const std::string& script = kWorkerScript) {
  WorkerProcessSpec s;
  s.pool = pool;
  s.id = id;
  s.args = {
      "-c",
      "FAKE_PORT=" + std::to_string(fake_port) + " ROLE=" + pool + " ID=" + id + "; " + script,
      "sh"};
  return s;
}

struct Events {
  std::mutex mu;
  std::vector<ChildEvent> all;
  void add(const ChildEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    all.push_back(e);
  }
  std::vector<ChildEvent> snapshot() {
    std::lock_guard<std::mutex> lock(mu);
    return all;
  }
};

SupervisorOptions sh_options(Events* events) {
  SupervisorOptions o;
  o.executable = "/bin/sh";
  o.start_timeout = milliseconds(5000);
  o.stop_grace = milliseconds(2000);
  o.restart_backoff = milliseconds(50);
  o.restart_backoff_max = milliseconds(200);
  o.on_event = [events](const ChildEvent& e) { events->add(e); };
  return o;
}

bool process_gone(pid_t pid) {
  // Reaped by the supervisor: the pid no longer names a process (or names a different one).
  return ::kill(pid, 0) != 0;
}

TEST(WorkerSupervisorTest, StartsReportsAddressesRestartsOnTheSameAddressAndStops) {
  Events events;
  auto sup = WorkerSupervisor::start(
      {sh_worker("prefill", "prefill-0", 41001), sh_worker("decode", "decode-0", 41002),
       sh_worker("decode", "decode-1", 41003)},
      sh_options(&events));
  ASSERT_TRUE(sup.ok()) << sup.status().to_string();
  ASSERT_TRUE((*sup)->wait_started(milliseconds(10000)).ok());
  EXPECT_EQ((*sup)->addresses("prefill"), std::vector<std::string>{"127.0.0.1:41001"});
  EXPECT_EQ((*sup)->addresses("decode"),
            (std::vector<std::string>{"127.0.0.1:41002", "127.0.0.1:41003"}));
  EXPECT_TRUE((*sup)->addresses("unified").empty());

  // wait_started() can return before the listening event has reached `events`: wait for it.
  pid_t victim = 0;
  for (int i = 0; i < 500 && victim == 0; ++i) {
    for (const auto& e : events.snapshot()) {
      if (e.id == "decode-1" && e.kind == ChildEvent::Kind::kListening) victim = e.pid;
    }
    if (victim == 0) std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);

  // The supervisor logs the death and starts it again with --listen on the port it had.
  pid_t again = 0;
  bool exited = false;
  for (int i = 0; i < 500 && again == 0; ++i) {
    for (const auto& e : events.snapshot()) {
      if (e.id != "decode-1") continue;
      if (e.kind == ChildEvent::Kind::kExited && e.pid == victim) {
        exited = true;
        EXPECT_NE(e.reason.find("SIGKILL"), std::string::npos) << e.reason;
      }
      if (e.kind == ChildEvent::Kind::kListening && e.pid != victim) {
        again = e.pid;
        EXPECT_EQ(e.address, "127.0.0.1:41003");
        EXPECT_EQ(e.restarts, 1);
      }
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_TRUE(exited);
  ASSERT_GT(again, 0) << "decode-1 was not restarted";

  std::vector<pid_t> pids;
  for (const auto& e : events.snapshot()) {
    if (e.kind == ChildEvent::Kind::kListening) pids.push_back(e.pid);
  }
  const auto t0 = std::chrono::steady_clock::now();
  (*sup)->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(1500));  // SIGINT ends sleep
  for (pid_t p : pids) EXPECT_TRUE(process_gone(p)) << p;
  (*sup)->stop();  // idempotent
}

TEST(WorkerSupervisorTest, AChildThatFailsItsFirstStartIsAnError) {
  Events events;
  auto sup = WorkerSupervisor::start(
      {sh_worker("prefill", "prefill-0", 41011),
       sh_worker("decode", "decode-0", 41012, "echo cannot load the model >&2; exit 3")},
      sh_options(&events));
  ASSERT_TRUE(sup.ok());
  Status s = (*sup)->wait_started(milliseconds(10000));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("decode-0"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("exit status 3"), std::string::npos) << s.message();
  (*sup)->stop();
}

TEST(WorkerSupervisorTest, SilentChildIsKilledAfterTheStartTimeout) {
  Events events;
  SupervisorOptions o = sh_options(&events);
  o.start_timeout = milliseconds(300);
  auto sup = WorkerSupervisor::start({sh_worker("unified", "unified-0", 41021, "exec sleep 60")},
                                     std::move(o));
  ASSERT_TRUE(sup.ok());
  Status s = (*sup)->wait_started(milliseconds(10000));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no listening line"), std::string::npos) << s.message();
}

TEST(WorkerSupervisorTest, StopEscalatesToSigkill) {
  Events events;
  SupervisorOptions o = sh_options(&events);
  o.stop_grace = milliseconds(200);
  const std::string stubborn =
      "trap '' INT TERM; echo \"cleave worker unified u listening on 127.0.0.1:41031\"; "
      "while :; do sleep 0.05; done";
  auto sup =
      WorkerSupervisor::start({sh_worker("unified", "unified-0", 41031, stubborn)}, std::move(o));
  ASSERT_TRUE(sup.ok());
  ASSERT_TRUE((*sup)->wait_started(milliseconds(10000)).ok());
  const auto t0 = std::chrono::steady_clock::now();
  (*sup)->stop();
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, milliseconds(200));
  EXPECT_LT(took, milliseconds(3000));
}

TEST(WorkerSupervisorTest, ChildrenDieWithTheSupervisor) {
  // A process that runs a supervisor and is then SIGKILLed: its child gets SIGTERM
  // (PR_SET_PDEATHSIG) and ends. The child's pid comes back through a pipe.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t holder = ::fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    ::close(fds[0]);
    SupervisorOptions o;
    o.executable = "/bin/sh";
    o.on_event = [fd = fds[1]](const ChildEvent& e) {
      if (e.kind == ChildEvent::Kind::kListening) {
        [[maybe_unused]] ssize_t w = ::write(fd, &e.pid, sizeof(e.pid));
      }
    };
    auto sup = WorkerSupervisor::start({sh_worker("unified", "unified-0", 41041)}, std::move(o));
    if (!sup.ok()) ::_exit(1);
    for (;;) ::pause();
  }
  ::close(fds[1]);
  pid_t child = 0;
  ASSERT_EQ(::read(fds[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  ::close(fds[0]);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::kill(child, 0), 0);
  ::kill(holder, SIGKILL);
  int status = 0;
  ::waitpid(holder, &status, 0);
  // The orphan is re-parented (to init or a subreaper) and reaped there; wait until it is gone
  // or is a zombie nobody reaps (this test process may be the subreaper).
  bool gone = false;
  for (int i = 0; i < 300 && !gone; ++i) {
    if (::kill(child, 0) != 0) {
      gone = true;
      break;
    }
    if (::waitpid(child, &status, WNOHANG) == child) gone = true;
    char path[64];
    std::snprintf(path, sizeof(path), "/proc/%d/stat", child);
    if (FILE* f = std::fopen(path, "r")) {
      char buf[256] = {};
      size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
      std::fclose(f);
      const char* close_paren = std::strrchr(buf, ')');
      if (n > 0 && close_paren && close_paren[1] == ' ' && close_paren[2] == 'Z') gone = true;
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_TRUE(gone) << "child " << child << " outlived its supervisor";
  if (!gone) ::kill(child, SIGKILL);
}

}  // namespace
}  // namespace cleave::router
