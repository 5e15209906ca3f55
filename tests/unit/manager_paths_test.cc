// Where the manager lives and how it is found, from the environment.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "manager/paths.h"
#include "shmtensor/error.h"
#include "support/expect_error.h"

namespace shmtensor::internal::manager {
namespace {

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      ::setenv(name_, old_.c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(ManagerPathsTest, LocationIsInTheDirectoryAndNamesGroupAndDevShm) {
  auto loc = manager_location("/tmp/x", "g1");
  // "+2": beside an older installation's daemon of the group (paths.h).
  EXPECT_EQ(loc.socket_path.rfind("/tmp/x/g1+2-", 0), 0u) << loc.socket_path;
  EXPECT_EQ(loc.socket_path.substr(loc.socket_path.size() - 5), ".sock");
  EXPECT_EQ(loc.lock_path.substr(0, loc.lock_path.size() - 5),
            loc.socket_path.substr(0, loc.socket_path.size() - 5));
}

TEST(ManagerPathsTest, TooLongASocketPathIsAnErrorThatSaysWhatToSet) {
  try {
    manager_location("/tmp/" + std::string(120, 'd'), "default");
    ADD_FAILURE() << "a 130-byte socket path was accepted";
  } catch (const ConfigurationError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("107"), std::string::npos) << what;
    EXPECT_NE(what.find("SHMTENSOR_MANAGER_DIR"), std::string::npos) << what;
  }
}

TEST(ManagerPathsTest, GroupNamesAreChecked) {
  EXPECT_TRUE(is_valid_group("default"));
  EXPECT_TRUE(is_valid_group("job-1.a_b"));
  EXPECT_FALSE(is_valid_group(""));
  EXPECT_FALSE(is_valid_group("a/b"));
  EXPECT_FALSE(is_valid_group(".."));
  EXPECT_FALSE(is_valid_group(std::string(65, 'a')));
  EXPECT_ERROR(manager_location("/tmp", "../x"), ConfigurationError,
               "invalid shmtensor-manager group \"../x\" (SHMTENSOR_MANAGER_GROUP): use 1 to 64 "
               "characters of A-Z a-z 0-9 _ . -, other than \".\" and \"..\"");
  EXPECT_ERROR(manager_location("/tmp", ".."), ConfigurationError,
               "invalid shmtensor-manager group \"..\"");
}

TEST(ManagerPathsTest, EnvironmentChoosesDirectoryGroupProgramAndGrace) {
  ScopedEnv dir("SHMTENSOR_MANAGER_DIR", "/tmp/mydir");
  ScopedEnv group("SHMTENSOR_MANAGER_GROUP", "mygroup");
  ScopedEnv prog("SHMTENSOR_MANAGER", "/opt/bin/shmtensor-manager");
  ScopedEnv grace("SHMTENSOR_MANAGER_GRACE_MS", "250");
  auto loc = manager_location();
  EXPECT_EQ(loc.dir, "/tmp/mydir");
  EXPECT_EQ(loc.group, "mygroup");
  EXPECT_EQ(manager_program_candidates(), std::vector<std::string>{"/opt/bin/shmtensor-manager"});
  EXPECT_EQ(manager_grace_ms(), 250);
}

TEST(ManagerPathsTest, DefaultsNeedNoSetting) {
  ScopedEnv dir("SHMTENSOR_MANAGER_DIR", nullptr);
  ScopedEnv group("SHMTENSOR_MANAGER_GROUP", nullptr);
  ScopedEnv prog("SHMTENSOR_MANAGER", nullptr);
  ScopedEnv grace("SHMTENSOR_MANAGER_GRACE_MS", "soon");
  ScopedEnv xdg("XDG_RUNTIME_DIR", nullptr);
  auto loc = manager_location();
  EXPECT_EQ(loc.dir, "/tmp/shmtensor-" + std::to_string(::geteuid()));
  EXPECT_EQ(loc.group, "default");
  auto candidates = manager_program_candidates();
  ASSERT_GE(candidates.size(), 2u);  // the build tree, then the install prefix
  for (const auto& c : candidates) EXPECT_EQ(c.substr(c.size() - 18), "/shmtensor-manager") << c;
  EXPECT_EQ(manager_grace_ms(), 2000) << "a malformed value falls back to the default";
}

}  // namespace
}  // namespace shmtensor::internal::manager
