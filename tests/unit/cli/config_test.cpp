#include "cleave/cli/config.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>

namespace cleave {
namespace {

TEST(ConfigTest, DefaultsComeFromCode) {
  Config c;
  SettingsRegistry r;
  register_settings(c, r);
  EXPECT_EQ(r.find("engine.threads")->get(), "0");
  EXPECT_EQ(r.find("log.level")->get(), "info");
  EXPECT_EQ(r.find("engine.threads")->env, "CLEAVE_ENGINE_THREADS");
}

TEST(ConfigTest, PrecedenceFlagsOverEnvOverFileOverDefaults) {
  Config c;
  SettingsRegistry r;
  register_settings(c, r);
  ASSERT_TRUE(r.load_yaml_string("engine:\n  threads: 3\n  max_context: 100\nlog:\n  level: debug\n",
                                 "test.yaml").ok());
  EXPECT_EQ(c.engine.threads, 3);
  std::map<std::string, std::string> env = {{"CLEAVE_ENGINE_THREADS", "5"},
                                            {"CLEAVE_LOG_LEVEL", "warn"}};
  ASSERT_TRUE(r.load_env([&](const char* k) -> const char* {
                auto it = env.find(k);
                return it == env.end() ? nullptr : it->second.c_str();
              }).ok());
  EXPECT_EQ(c.engine.threads, 5);
  EXPECT_EQ(c.engine.max_context, 100);  // file value survives where env is silent
  ASSERT_TRUE(r.set_assignment("engine.threads=7", "flag").ok());
  EXPECT_EQ(c.engine.threads, 7);
  EXPECT_EQ(c.log.level, "warn");
  EXPECT_EQ(r.find("engine.threads")->source, "flag");
  EXPECT_EQ(r.find("engine.max_context")->source, "test.yaml");
}

TEST(ConfigTest, UnknownKeyInFileIsAnErrorNamingIt) {
  Config c;
  SettingsRegistry r;
  register_settings(c, r);
  Status s = r.load_yaml_string("engine:\n  threds: 3\n", "my.yaml");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("engine.threds"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("my.yaml"), std::string::npos) << s.message();
}

TEST(ConfigTest, BadValuesNameKeyAndValue) {
  Config c;
  SettingsRegistry r;
  register_settings(c, r);
  Status s = r.set("engine.threads", "many", "flag");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("many"), std::string::npos);
  s = r.set("engine.threads", "-1", "flag");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("out of range"), std::string::npos);
  s = r.set("log.level", "loud", "flag");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("trace"), std::string::npos);
  EXPECT_FALSE(r.set_assignment("novalue", "flag").ok());
  EXPECT_FALSE(r.load_yaml_string("engine: [1, 2]", "x.yaml").ok());
  EXPECT_FALSE(r.load_yaml_string("engine: {threads: [1]}", "x.yaml").ok());
  EXPECT_FALSE(r.load_yaml_string("engine: {threads: 1", "x.yaml").ok());  // YAML syntax error
  EXPECT_EQ(c.engine.threads, 0);  // nothing bad was applied
}

TEST(ConfigTest, FileLoadingAndMissingFile) {
  Config c;
  SettingsRegistry r;
  register_settings(c, r);
  EXPECT_EQ(r.load_yaml_file("/nonexistent/cleave.yaml").code(), StatusCode::kNotFound);
  std::string path = ::testing::TempDir() + "/cleave_config_test.yaml";
  {
    std::ofstream f(path);
    f << "model:\n  path: /models/x.gguf\n";
  }
  ASSERT_TRUE(load_config(r, path, {"engine.max_context=64"}).ok());
  EXPECT_EQ(c.model.path, "/models/x.gguf");
  EXPECT_EQ(c.engine.max_context, 64);
  std::remove(path.c_str());
}

TEST(ConfigTest, YamlAndTableListEverySetting) {
  Config c;
  SettingsRegistry r;
  register_settings(c, r);
  std::string yaml = r.to_yaml();
  std::string table = r.markdown_table();
  for (const auto& s : r.settings()) {
    EXPECT_NE(table.find("`" + s.key + "`"), std::string::npos) << s.key;
    EXPECT_NE(table.find(s.env), std::string::npos) << s.env;
  }
  EXPECT_NE(yaml.find("threads: 0"), std::string::npos) << yaml;
}

}  // namespace
}  // namespace cleave
