// The one factory of gRPC channels to workers: the router's pools and WorkerClient (hence
// `cleave client`) dial workers through it, with one set of settings:
//   - no HTTP proxy from the environment (the control plane is internal);
//   - keepalive pings every 10 s, 5 s to answer, none while no call is active;
//   - messages up to 64 MiB received (metrics texts, long prompts' logprobs);
//   - reconnect back-off 200 ms at first and at least, at most 2 s: a restarted worker is found
//     again within a probe or two, not after minutes of back-off.
// The channel connects lazily (on the first call, or WaitForConnected).
#pragma once

#include <memory>
#include <string>

#include "grpcpp/channel.h"

namespace cleave {

// A channel to `address` ("host:port"); null only when gRPC cannot make one.
std::shared_ptr<grpc::Channel> make_worker_channel(const std::string& address);

}  // namespace cleave
