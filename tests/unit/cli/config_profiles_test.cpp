// Config directories (a mounted ConfigMap), the profiles section and a worker's choice of
// profile: defaults < file < profile < env < flags.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "cleave/cli/config.h"

namespace cleave {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("cleave-config-test-" + std::to_string(::getpid()) + "-" + std::to_string(next_++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path p = path_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }
  std::string str() const { return path_.string(); }
  const fs::path& path() const { return path_; }

 private:
  static inline int next_ = 0;
  fs::path path_;
};

struct Loaded {
  Config c;
  SettingsRegistry r;
  Loaded() { register_settings(c, r); }
};

constexpr const char* kProfiles = R"(
profiles:
  p5e.48xlarge:
    engine: {threads: 16, kv_cache_bytes: 103079215104}
    transfer: {rails: 4}
    decode:
      engine: {max_num_seqs: 512, threads: 24}
    prefill:
      engine: {max_tokens_per_step: 8192}
  default:
    engine: {threads: 2}
)";

TEST(ConfigDirectoryTest, ReadsYamlThenOneFilePerSetting) {
  TempDir d;
  d.write("cleave.yaml", "router: {max_queue: 99}\nengine: {threads: 3}\n");
  d.write("pools.prefill.replicas", "4\n");
  d.write("model.path", "");
  d.write("transfer.provider", "tcp;ofi_rxm");
  // What a mounted ConfigMap also holds: its atomic-update links.
  fs::create_directories(d.path() / "..2026_01_01_00_00_00.000000001");
  d.write("..data/cleave.yaml", "garbage: [");
  Loaded l;
  Status s = l.r.load_yaml_file(d.str());
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(l.c.router.max_queue, 99);
  EXPECT_EQ(l.c.engine.threads, 3);
  EXPECT_EQ(l.c.pools.prefill.replicas, 4);
  EXPECT_EQ(l.c.transfer.provider, "tcp;ofi_rxm");
  EXPECT_EQ(l.c.model.path, "");
  EXPECT_EQ(l.r.find("pools.prefill.replicas")->source,
            (d.path() / "pools.prefill.replicas").string());
  // load_config takes the directory as its file, and env still wins over it.
  Loaded l2;
  ::setenv("CLEAVE_POOLS_PREFILL_REPLICAS", "6", 1);
  s = load_config(l2.r, d.str(), {});
  ::unsetenv("CLEAVE_POOLS_PREFILL_REPLICAS");
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(l2.c.pools.prefill.replicas, 6);
}

TEST(ConfigDirectoryTest, SeveralYamlFilesAndTheirProfiles) {
  TempDir d;
  d.write("cleave.yaml", "engine: {threads: 3}\n");
  d.write("profiles.yaml", kProfiles);
  Loaded l;
  Status s = l.r.load_yaml_file(d.str());
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(l.r.profiles().size(), 2u);
  EXPECT_EQ(l.c.engine.threads, 3);  // not applied by loading
}

TEST(ConfigDirectoryTest, ASettingGivenTwiceOrAFileNamingNoSettingIsAnError) {
  {
    TempDir d;
    d.write("cleave.yaml", "pools: {prefill: {replicas: 2}}\n");
    d.write("pools.prefill.replicas", "4");
    Loaded l;
    Status s = l.r.load_yaml_file(d.str());
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("set twice"), std::string::npos) << s.message();
  }
  {
    TempDir d;
    d.write("a.yaml", "engine: {threads: 3}\n");
    d.write("b.yaml", "engine: {threads: 4}\n");
    Loaded l;
    Status s = l.r.load_yaml_file(d.str());
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("set twice"), std::string::npos) << s.message();
  }
  {
    TempDir d;
    d.write("pools.prefil.replicas", "4");
    Loaded l;
    Status s = l.r.load_yaml_file(d.str());
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("pools.prefil.replicas"), std::string::npos) << s.message();
  }
  {
    TempDir d;
    d.write("engine.threads", "many");
    Loaded l;
    Status s = l.r.load_yaml_file(d.str());
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("engine.threads"), std::string::npos) << s.message();
  }
}

TEST(ConfigProfilesTest, ProfileKeysAndValuesAreCheckedWhenRead) {
  const std::pair<const char*, const char*> bad[] = {
      {"profiles: {x: {engine: {thread: 4}}}", "engine.thread"},
      {"profiles: {x: {decode: {engine: {max_num_seqs: lots}}}}", "max_num_seqs"},
      {"profiles: {x: {worker: {role: decode}}}", "worker.role"},
      {"profiles: {x: {worker: {instance_type: y}}}", "worker.instance_type"},
      {"profiles: [a, b]", "profiles"},
      {"profiles: {x: 3}", "profiles.x"},
  };
  for (const auto& [yaml, want] : bad) {
    Loaded l;
    Status s = l.r.load_yaml_string(yaml, "t.yaml");
    EXPECT_FALSE(s.ok()) << yaml;
    EXPECT_NE(s.message().find(want), std::string::npos) << yaml << ": " << s.message();
  }
  // The check leaves the settings as they were.
  Loaded l;
  ASSERT_TRUE(l.r.load_yaml_string(kProfiles, "t.yaml").ok());
  EXPECT_EQ(l.c.engine.threads, 0);
  EXPECT_EQ(l.r.find("engine.threads")->source, "default");
}

TEST(ConfigProfilesTest, TheRoleSectionWinsAndEnvAndFlagsWinOverTheProfile) {
  Loaded l;
  ASSERT_TRUE(
      l.r.load_yaml_string(std::string("engine: {max_num_seqs: 8, max_context: 100}\n") + kProfiles,
                           "t.yaml")
          .ok());
  std::map<std::string, std::string> env = {{"CLEAVE_ENGINE_KV_CACHE_BYTES", "1048576"}};
  ASSERT_TRUE(l.r.load_env([&](const char* k) -> const char* {
                   auto it = env.find(k);
                   return it == env.end() ? nullptr : it->second.c_str();
                 })
                  .ok());
  ASSERT_TRUE(l.r.set_assignment("transfer.rails=2", "flag").ok());
  ASSERT_TRUE(l.r.set_assignment("worker.role=decode", "flag").ok());
  ASSERT_TRUE(l.r.set_assignment("worker.instance_type=p5e.48xlarge", "flag").ok());
  Result<std::string> line = select_worker_profile(l.r, l.c.worker.instance_type, l.c.worker.role, l.c.worker.profile);
  ASSERT_TRUE(line.ok()) << line.status().to_string();
  EXPECT_EQ(l.c.worker.profile, "p5e.48xlarge");
  EXPECT_EQ(l.c.engine.threads, 24);               // decode: section beats the profile's own
  EXPECT_EQ(l.c.engine.max_num_seqs, 512);         // profile beats the file
  EXPECT_EQ(l.c.engine.max_context, 100);          // the file where the profile is silent
  EXPECT_EQ(l.c.engine.max_tokens_per_step, 256);  // the prefill section is not for decode
  EXPECT_EQ(l.c.engine.kv_cache_bytes, 1048576);   // env beats the profile
  EXPECT_EQ(l.c.transfer.rails, 2);                // a flag beats the profile
  EXPECT_EQ(l.r.find("engine.threads")->source, "profile p5e.48xlarge (t.yaml)");
  EXPECT_NE(line->find("profile 'p5e.48xlarge'"), std::string::npos) << *line;
  EXPECT_NE(line->find("engine.max_num_seqs=512"), std::string::npos) << *line;
}

TEST(ConfigProfilesTest, UnknownOrMissingInstanceTypeTakesTheDefaultProfile) {
  for (const std::string type : {"", "m7i.large"}) {
    Loaded l;
    ASSERT_TRUE(l.r.load_yaml_string(kProfiles, "t.yaml").ok());
    l.c.worker.instance_type = type;
    Result<std::string> line = select_worker_profile(l.r, l.c.worker.instance_type, l.c.worker.role, l.c.worker.profile);
    ASSERT_TRUE(line.ok());
    EXPECT_EQ(l.c.worker.profile, "default");
    EXPECT_EQ(l.c.engine.threads, 2);
  }
  // No profiles, or none matching and no default: nothing applied, not an error.
  Loaded l;
  ASSERT_TRUE(
      l.r.load_yaml_string("profiles: {p5.48xlarge: {engine: {threads: 4}}}", "t.yaml").ok());
  l.c.worker.instance_type = "g6e.48xlarge";
  Result<std::string> line = select_worker_profile(l.r, l.c.worker.instance_type, l.c.worker.role, l.c.worker.profile);
  ASSERT_TRUE(line.ok());
  EXPECT_EQ(l.c.worker.profile, "");
  EXPECT_EQ(l.c.engine.threads, 0);
  EXPECT_NE(line->find("no profile"), std::string::npos) << *line;
}

TEST(ConfigProfilesTest, InstanceTypeFromAFile) {
  TempDir d;
  const std::string file = d.write("instance-type", "p5e.48xlarge\n");
  Loaded l;
  ASSERT_TRUE(l.r.load_yaml_string(kProfiles, "t.yaml").ok());
  l.c.worker.role = "prefill";
  l.c.worker.instance_type = "@" + file;
  ASSERT_TRUE(select_worker_profile(l.r, l.c.worker.instance_type, l.c.worker.role, l.c.worker.profile).ok());
  EXPECT_EQ(l.c.worker.instance_type, "p5e.48xlarge");
  EXPECT_EQ(l.c.worker.profile, "p5e.48xlarge");
  EXPECT_EQ(l.c.engine.max_tokens_per_step, 8192);
  EXPECT_EQ(l.c.engine.threads, 16);
  // An empty file (the node-info step found no label): the default profile.
  d.write("instance-type", "");
  Loaded l2;
  ASSERT_TRUE(l2.r.load_yaml_string(kProfiles, "t.yaml").ok());
  l2.c.worker.instance_type = "@" + file;
  ASSERT_TRUE(select_worker_profile(l2.r, l2.c.worker.instance_type, l2.c.worker.role, l2.c.worker.profile).ok());
  EXPECT_EQ(l2.c.worker.profile, "default");
  // A missing file is an error naming it.
  Loaded l3;
  l3.c.worker.instance_type = "@" + d.str() + "/absent";
  Result<std::string> r = select_worker_profile(l3.r, l3.c.worker.instance_type, l3.c.worker.role, l3.c.worker.profile);
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("absent"), std::string::npos);
}

}  // namespace
}  // namespace cleave
