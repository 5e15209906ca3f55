// What `shmtensor doctor` concludes from a machine's limits, and how gc reports.
#include <gtest/gtest.h>

#include "manager/report.h"

namespace shmtensor::internal::manager {
namespace {

SystemLimits healthy() {
  SystemLimits l;
  l.kernel_release = "6.1.0";
  l.memfd = l.memfd_sealing = l.pidfd = true;
  l.dev_shm_total = 16ull << 30;
  l.dev_shm_free = 15ull << 30;
  l.max_map_count = 65530;
  l.nofile_soft = l.nofile_hard = 1048576;
  l.thp_shmem = "within_size";
  l.mem_total = 64ull << 30;
  return l;
}

const Check& check(const std::vector<Check>& v, const std::string& what) {
  for (const auto& c : v)
    if (c.what == what) return c;
  ADD_FAILURE() << "no check " << what;
  static Check none;
  return none;
}

TEST(ManagerReportTest, HealthyMachineIsAllOk) {
  auto checks = doctor_checks(healthy());
  EXPECT_EQ(checks.size(), 7u);
  for (const auto& c : checks) EXPECT_EQ(c.verdict, "ok") << c.what << ": " << c.value;
  std::string text = format_checks(checks);
  EXPECT_EQ(text.find("fix:"), std::string::npos) << text;
}

TEST(ManagerReportTest, DockerDefaultsAreLowWithTheirFixes) {
  SystemLimits l = healthy();
  l.dev_shm_total = 64ull << 20;  // docker's default --shm-size
  l.dev_shm_free = 60ull << 20;
  l.nofile_soft = 1024;
  l.nofile_hard = 4096;
  l.thp_shmem = "never";
  l.max_map_count = 4096;
  l.pidfd = false;
  auto checks = doctor_checks(l);
  EXPECT_EQ(check(checks, "/dev/shm size").verdict, "low");
  EXPECT_EQ(check(checks, "/dev/shm size").value, "64.0 MiB");
  EXPECT_NE(check(checks, "/dev/shm size").fix.find("--shm-size"), std::string::npos);
  EXPECT_EQ(check(checks, "/dev/shm free").verdict, "low");
  EXPECT_EQ(check(checks, "ulimit -n (open files)").verdict, "low");
  EXPECT_NE(check(checks, "ulimit -n (open files)").fix.find("ulimit -n 4096"), std::string::npos);
  EXPECT_EQ(check(checks, "transparent huge pages (shmem)").verdict, "low");
  EXPECT_EQ(check(checks, "vm.max_map_count").verdict, "low");
  EXPECT_NE(check(checks, "vm.max_map_count").fix.find("sysctl -w vm.max_map_count"),
            std::string::npos);
  EXPECT_EQ(check(checks, "kernel").verdict, "low");
  std::string json = checks_json(checks);
  EXPECT_NE(json.find("\"verdict\": \"low\""), std::string::npos) << json;
}

TEST(ManagerReportTest, LowHardLimitNeedsMoreThanUlimit) {
  SystemLimits l = healthy();
  l.nofile_soft = l.nofile_hard = 1024;
  EXPECT_NE(check(doctor_checks(l), "ulimit -n (open files)").fix.find("--ulimit nofile"),
            std::string::npos);
}

TEST(ManagerReportTest, MissingMemfdAndDevShm) {
  SystemLimits l = healthy();
  l.memfd = l.memfd_sealing = false;
  l.dev_shm_total.reset();
  l.dev_shm_free.reset();
  auto checks = doctor_checks(l);
  EXPECT_EQ(check(checks, "memfd_create + sealing").verdict, "missing");
  EXPECT_EQ(check(checks, "/dev/shm").verdict, "missing");
}

TEST(ManagerReportTest, SweepReportSaysWhatItRemoved) {
  SweepReport r;
  SegmentInfo s;
  s.name = "/shmtensor_1_ab_0";
  s.facts.size = 2048;
  s.facts.creator_pid = 1;
  r.removed.push_back(s);
  EXPECT_EQ(format_sweep(r, false),
            "removed /shmtensor_1_ab_0 (2.0 KiB, creator 1 gone, no process maps it)\n"
            "removed 1 name (2.0 KiB); kept 0 in use\n");
  EXPECT_NE(format_sweep(r, true).find("would remove 1 name"), std::string::npos);
}

}  // namespace
}  // namespace shmtensor::internal::manager
