// The router's settings (router.*, pools.*, model.*) and what RouterApp builds from them.
#include "cleave/router/router_app.h"

#include <gtest/gtest.h>

#include "cleave/model/model_settings.h"
#include "cleave/router/router_settings.h"

namespace cleave::router {
namespace {

struct Settings {
  RouterAppConfig config;
  SettingsRegistry registry;
  Settings() {
    register_model_settings(config.model, registry);
    register_router_settings(config.router, registry);
    register_pools_settings(config.pools, registry);
  }
};

TEST(RouterAppTest, SplitCommaList) {
  EXPECT_EQ(split_comma_list(""), std::vector<std::string>{});
  EXPECT_EQ(split_comma_list(" , ,"), std::vector<std::string>{});
  EXPECT_EQ(split_comma_list("a"), std::vector<std::string>{"a"});
  EXPECT_EQ(split_comma_list(" a:1, b:2 ,,c:3 "), (std::vector<std::string>{"a:1", "b:2", "c:3"}));
}

TEST(RouterAppTest, DefaultsAreDisaggregatedAndNeedWorkers) {
  Settings s;
  EXPECT_EQ(s.config.router.port, 8000);
  EXPECT_EQ(s.config.router.mode, "disaggregated");
  EXPECT_EQ(s.config.pools.prefill.replicas, 1);
  EXPECT_EQ(s.config.pools.decode.replicas, 1);
  EXPECT_EQ(s.config.pools.unified.replicas, 1);
  auto o = dispatcher_options_from_config(s.config.router, s.config.pools);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("pools.prefill.workers"), std::string::npos)
      << o.status().message();
}

TEST(RouterAppTest, NestedYamlPoolsAndRouterSettings) {
  Settings s;
  ASSERT_TRUE(s.registry
                  .load_yaml_string(R"(
router: {max_queue: 7, request_timeout_ms: 1234, health_interval_ms: 250, policy_prefill: round_robin}
pools:
  prefill:
    workers: "127.0.0.1:7001, 127.0.0.1:7002"
  decode:
    dns: decode.cleave.svc:7100
)",
                                    "test.yaml")
                  .ok());
  ASSERT_TRUE(s.registry.set("router.dns_refresh_ms", "500", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.health_timeout_ms", "2500", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.health_failures", "5", "flag").ok());
  EXPECT_EQ(s.config.router.max_migrations, 2);
  ASSERT_TRUE(s.registry.set("router.max_migrations", "0", "flag").ok());
  EXPECT_FALSE(s.registry.set("router.max_migrations", "-1", "flag").ok());
  auto o = dispatcher_options_from_config(s.config.router, s.config.pools);
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->mode, DispatchMode::kDisaggregated);
  EXPECT_EQ(o->prefill.workers, (std::vector<std::string>{"127.0.0.1:7001", "127.0.0.1:7002"}));
  EXPECT_EQ(o->prefill.policy, DispatchPolicyKind::kRoundRobin);
  EXPECT_TRUE(o->decode.workers.empty());
  EXPECT_EQ(o->decode.dns_name, "decode.cleave.svc");
  EXPECT_EQ(o->decode.dns_port, 7100);
  EXPECT_EQ(o->decode.dns_refresh.count(), 500);
  EXPECT_EQ(o->decode.policy, DispatchPolicyKind::kLeastLoaded);
  EXPECT_EQ(o->queue_limit, 7);
  EXPECT_EQ(o->health_interval.count(), 250);
  EXPECT_EQ(o->timeouts.probe.count(), 2500);
  EXPECT_EQ(o->probe_failures, 5);
  EXPECT_EQ(o->max_migrations, 0);
  EXPECT_EQ(o->timeouts.first_token.count(), 1234);
  EXPECT_EQ(o->timeouts.prefill.count(), 1234);
}

TEST(RouterAppTest, UnifiedModeUsesTheUnifiedPoolOnly) {
  Settings s;
  ASSERT_TRUE(s.registry.set("router.mode", "unified", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.policy_unified", "round_robin", "flag").ok());
  EXPECT_FALSE(dispatcher_options_from_config(s.config.router, s.config.pools).ok());  // no unified worker named
  ASSERT_TRUE(s.registry.set("pools.unified.workers", "[::1]:7000", "flag").ok());
  auto o = dispatcher_options_from_config(s.config.router, s.config.pools);
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->mode, DispatchMode::kUnified);
  EXPECT_EQ(o->unified.workers, std::vector<std::string>{"[::1]:7000"});
  EXPECT_EQ(o->unified.policy, DispatchPolicyKind::kRoundRobin);
}

TEST(RouterAppTest, BadEntriesAreErrorsNamingTheSetting) {
  Settings s;
  ASSERT_TRUE(s.registry.set("pools.prefill.workers", "127.0.0.1:7001", "flag").ok());
  ASSERT_TRUE(s.registry.set("pools.decode.dns", "no-port-here", "flag").ok());
  auto o = dispatcher_options_from_config(s.config.router, s.config.pools);
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("pools.decode.dns"), std::string::npos)
      << o.status().message();

  ASSERT_TRUE(s.registry.set("pools.decode.dns", "", "flag").ok());
  ASSERT_TRUE(s.registry.set("pools.decode.workers", "127.0.0.1:0", "flag").ok());
  EXPECT_FALSE(dispatcher_options_from_config(s.config.router, s.config.pools).ok());  // port 0 cannot be dialled

  // Enum settings refuse unknown values when they are set.
  EXPECT_FALSE(s.registry.set("router.mode", "both", "flag").ok());
  EXPECT_FALSE(s.registry.set("router.policy_decode", "random", "flag").ok());
  EXPECT_FALSE(s.registry.set("router.port", "70000", "flag").ok());
  EXPECT_FALSE(s.registry.set("pools.decode.replicas", "-1", "flag").ok());
}

TEST(RouterAppTest, HttpOptions) {
  Settings s;
  ASSERT_TRUE(s.registry.set("router.api_keys", " k1 ,k2,", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.port", "0", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.io_threads", "3", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.max_body_bytes", "4096", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.host", "127.0.0.1", "flag").ok());
  auto o = http_server_options_from_config(s.config.router);
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->api_keys, (std::vector<std::string>{"k1", "k2"}));
  EXPECT_EQ(o->port, 0);
  EXPECT_EQ(o->io_threads, 3);
  EXPECT_EQ(o->max_body_bytes, 4096u);
  EXPECT_EQ(o->host, "127.0.0.1");
}

TEST(RouterAppTest, GrpcOptions) {
  Settings s;
  auto on = grpc_server_options_from_config(s.config.router);
  ASSERT_TRUE(on.has_value());
  EXPECT_EQ(on->port, 8001);
  EXPECT_EQ(on->host, "0.0.0.0");
  ASSERT_TRUE(s.registry.set("router.api_keys", "k1", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.grpc_port", "0", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.max_body_bytes", "4096", "flag").ok());
  on = grpc_server_options_from_config(s.config.router);
  ASSERT_TRUE(on.has_value());
  EXPECT_EQ(on->port, 0);
  EXPECT_EQ(on->api_keys, (std::vector<std::string>{"k1"}));
  EXPECT_EQ(on->max_message_bytes, 4096u);
  ASSERT_TRUE(s.registry.set("router.grpc_port", "-1", "flag").ok());
  EXPECT_FALSE(grpc_server_options_from_config(s.config.router).has_value());
  EXPECT_FALSE(s.registry.set("router.grpc_port", "-2", "flag").ok());
}

TEST(RouterAppTest, ClientUrl) {
  EXPECT_EQ(client_url("0.0.0.0", 8000), "http://127.0.0.1:8000/");
  EXPECT_EQ(client_url("", 80), "http://127.0.0.1:80/");
  EXPECT_EQ(client_url("10.1.2.3", 8080), "http://10.1.2.3:8080/");
  EXPECT_EQ(client_url("::", 8000), "http://[::1]:8000/");
  EXPECT_EQ(client_url("::1", 8000), "http://[::1]:8000/");
  EXPECT_EQ(client_url("fe80::2", 9), "http://[fe80::2]:9/");
}

TEST(RouterAppTest, StartFailsCleanlyOnABadModelOrSettings) {
  Settings s;
  ASSERT_TRUE(s.registry.set("pools.prefill.workers", "127.0.0.1:1", "flag").ok());
  ASSERT_TRUE(s.registry.set("pools.decode.workers", "127.0.0.1:2", "flag").ok());
  ASSERT_TRUE(s.registry.set("model.path", "/nonexistent/model.gguf", "flag").ok());
  ASSERT_TRUE(s.registry.set("router.port", "0", "flag").ok());
  auto app = RouterApp::start(s.config);
  ASSERT_FALSE(app.ok());
  EXPECT_NE(app.status().message().find("/nonexistent/model.gguf"), std::string::npos)
      << app.status().message();

  Settings t;
  ASSERT_TRUE(t.registry.set("router.mode", "unified", "flag").ok());
  auto none = RouterApp::start(t.config);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cleave::router
