#include "manager/report.h"

#include "os/shm.h"

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <sstream>

namespace shmtensor::internal::manager {

namespace {

constexpr std::uint64_t kMiB = 1024 * 1024;
constexpr std::uint64_t kGiB = 1024 * kMiB;

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string join_pids(const std::vector<pid_t>& pids, const char* sep) {
  std::string out;
  for (std::size_t i = 0; i < pids.size(); ++i) {
    if (i) out += sep;
    out += std::to_string(pids[i]);
  }
  return out;
}

std::string limit_text(std::uint64_t v) {
  return v == UINT64_MAX ? "unlimited" : std::to_string(v);
}

}  // namespace

std::string human_size(std::uint64_t n) { return internal::human_bytes(n); }

std::vector<Check> cuda_checks(const cuda::CudaProbe& p) {
  std::vector<Check> out;
  if (!p.available) {
    out.push_back({"CUDA driver", "not available: " + p.why, "n/a",
                   "CUDA tensors need an NVIDIA driver (libcuda.so.1, 11.3 or newer); CPU "
                   "tensors do not"});
    return out;
  }
  out.push_back({"CUDA driver",
                 p.library + ", CUDA " + std::to_string(p.version / 1000) + "." +
                     std::to_string(p.version % 1000 / 10),
                 "ok", ""});
  for (const auto& d : p.devices) {
    Check c{"cuda:" + std::to_string(d.ordinal) + " " + d.name,
            d.uuid + ", VMM " + (d.vmm ? "yes" : "no") + ", POSIX fd export " +
                (d.posix_fd ? "yes" : "no") + ", granularity " + human_size(d.granularity) +
                ", trial export: " + d.trial,
            "ok", ""};
    if (d.trial != "ok") {
      c.verdict = "missing";
      c.fix =
          "shmtensor shares CUDA tensors through cuMemCreate allocations exported as POSIX "
          "fds: it needs virtual memory management and POSIX-fd export (not available under "
          "vGPU, MPS or WSL); CPU tensors are unaffected";
    }
    out.push_back(c);
  }
  return out;
}

std::vector<Check> doctor_checks(const SystemLimits& l) {
  std::vector<Check> out;
  {
    Check c{"kernel", l.kernel_release, "ok", ""};
    if (!l.pidfd) {
      c.verdict = "low";
      c.fix =
          "no pidfds (Linux < 5.3): the manager polls /proc every 250 ms instead of learning "
          "of a process's death at once; upgrade the kernel";
    }
    out.push_back(c);
  }
  {
    Check c{"memfd_create + sealing", l.memfd ? (l.memfd_sealing ? "yes" : "no sealing") : "no",
            "ok", ""};
    if (!l.memfd || !l.memfd_sealing) {
      c.verdict = "missing";
      c.fix =
          "the file_descriptor strategy needs memfd_create with sealing (Linux >= 3.17, "
          "not blocked by seccomp); use set_sharing_strategy(\"file_system\")";
    }
    out.push_back(c);
  }
  if (!l.dev_shm_total) {
    out.push_back({"/dev/shm", "missing", "missing",
                   "mount a tmpfs on /dev/shm (mount -t tmpfs -o size=8G tmpfs /dev/shm), or keep "
                   "the default file_descriptor strategy, which does not use it"});
  } else {
    std::uint64_t want = 1 * kGiB;
    if (l.mem_total && *l.mem_total / 4 < want) want = *l.mem_total / 4;
    Check size{"/dev/shm size", human_size(*l.dev_shm_total), "ok", ""};
    if (*l.dev_shm_total < want) {
      size.verdict = "low";
      size.fix =
          "file_system segments live in /dev/shm: enlarge it (docker run --shm-size=8g, "
          "or mount -o remount,size=8G /dev/shm), or keep the default file_descriptor "
          "strategy, which /dev/shm does not limit";
    }
    out.push_back(size);
    Check free{"/dev/shm free", human_size(*l.dev_shm_free), "ok", ""};
    if (*l.dev_shm_free < 256 * kMiB || *l.dev_shm_free < *l.dev_shm_total / 10) {
      free.verdict = "low";
      free.fix =
          "see what fills it: `shmtensor ls` (and `shmtensor gc` to remove what crashed "
          "processes left), `ls -la /dev/shm` for other programs";
    }
    out.push_back(free);
  }
  {
    Check c{"vm.max_map_count", l.max_map_count ? std::to_string(*l.max_map_count) : "unknown",
            "ok", ""};
    if (l.max_map_count && *l.max_map_count < 65530) {
      c.verdict = "low";
      c.fix = "each received segment is a mapping: sysctl -w vm.max_map_count=262144";
    }
    if (l.map_count) c.value += " (this process: " + std::to_string(*l.map_count) + ")";
    out.push_back(c);
  }
  {
    Check c{"ulimit -n (open files)",
            limit_text(l.nofile_soft) + " soft, " + limit_text(l.nofile_hard) + " hard", "ok", ""};
    if (l.nofile_soft < 4096) {
      c.verdict = "low";
      c.fix = l.nofile_hard >= 4096
                  ? "raise the soft limit: ulimit -n " + limit_text(l.nofile_hard) +
                        " (file_descriptor passes one fd per segment in flight)"
                  : "raise the hard limit (/etc/security/limits.conf, or docker run --ulimit "
                    "nofile=65536:65536), then ulimit -n 65536; or use the file_system strategy";
    }
    out.push_back(c);
  }
  {
    Check c{"transparent huge pages (shmem)", l.thp_shmem.empty() ? "unknown" : l.thp_shmem, "ok",
            ""};
    if (l.thp_shmem == "never" || l.thp_shmem == "deny") {
      c.verdict = "low";
      c.fix =
          "large shared tensors use 4 KiB pages (more page faults and TLB misses): echo "
          "within_size > /sys/kernel/mm/transparent_hugepage/shmem_enabled";
    }
    out.push_back(c);
  }
  return out;
}

std::string format_checks(const std::vector<Check>& checks) {
  std::ostringstream os;
  for (const auto& c : checks) {
    char line[256];
    std::snprintf(line, sizeof line, "%-8s %-32s %s", ("[" + c.verdict + "]").c_str(),
                  c.what.c_str(), c.value.c_str());
    os << line << "\n";
    if (!c.fix.empty()) os << "         fix: " << c.fix << "\n";
  }
  return os.str();
}

std::string checks_json(const std::vector<Check>& checks) {
  std::string out = "[";
  for (std::size_t i = 0; i < checks.size(); ++i) {
    const auto& c = checks[i];
    out += i ? ",\n " : "\n ";
    out += "{\"check\": " + json_string(c.what) + ", \"value\": " + json_string(c.value) +
           ", \"verdict\": " + json_string(c.verdict) + ", \"fix\": " + json_string(c.fix) + "}";
  }
  return out + "\n]\n";
}

std::string format_segments(const std::vector<SegmentInfo>& segments) {
  std::ostringstream os;
  char line[512];
  std::snprintf(line, sizeof line, "%-44s %10s %8s %-6s %8s  %s", "NAME", "SIZE", "CREATOR",
                "ALIVE", "REFCOUNT", "HOLDERS");
  os << line << "\n";
  std::uint64_t total = 0;
  for (const auto& s : segments) {
    total += s.facts.size;
    std::string refs = s.facts.header_valid ? std::to_string(s.facts.refcount) : "-";
    std::string holders = s.holders.empty() ? "-" : join_pids(s.holders, ",");
    std::snprintf(line, sizeof line, "%-44s %10s %8d %-6s %8s  %s", s.name.c_str(),
                  human_size(s.facts.size).c_str(), static_cast<int>(s.facts.creator_pid),
                  s.creator_alive ? "yes" : "no", refs.c_str(), holders.c_str());
    os << line << "\n";
  }
  os << segments.size() << " segment" << (segments.size() == 1 ? "" : "s") << ", "
     << human_size(total) << "\n";
  return os.str();
}

std::string segments_json(const std::vector<SegmentInfo>& segments) {
  std::string out = "[";
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    out += i ? ",\n " : "\n ";
    out += "{\"name\": " + json_string(s.name) + ", \"size\": " + std::to_string(s.facts.size) +
           ", \"creator_pid\": " + std::to_string(s.facts.creator_pid) +
           ", \"creator_alive\": " + (s.creator_alive ? "true" : "false") +
           ", \"header_valid\": " + (s.facts.header_valid ? "true" : "false") +
           ", \"refcount\": " + (s.facts.header_valid ? std::to_string(s.facts.refcount) : "null") +
           ", \"holders\": [" + join_pids(s.holders, ", ") + "]" +
           ", \"mtime\": " + std::to_string(s.mtime) + "}";
  }
  return out + (segments.empty() ? "]\n" : "\n]\n");
}

std::string format_channels(const std::vector<ChannelReport>& channels) {
  std::ostringstream out;
  if (!channels.empty()) out << "channels:\n";
  for (const auto& c : channels) {
    out << "  " << c.name << "  " << c.kind;
    if (!c.error.empty()) {
      out << "  (" << c.error << ")\n";
      continue;
    }
    if (c.kind == "queue") {
      out << "  depth " << c.depth;
      if (c.maxsize != 0) out << "/" << c.maxsize;
      out << "  creator " << c.creator << "  ends";
      for (auto pid : c.ends) out << " " << pid;
    } else if (c.kind == "broadcast") {
      out << "  readers";
      for (std::size_t i = 0; i < c.readers.size(); ++i) {
        out << " " << i << " (";
        if (c.readers[i].pid != 0) {
          out << "pid " << c.readers[i].pid;
        } else {
          out << "none";
        }
        out << ", " << c.readers[i].behind << " behind)";
      }
      out << "  creator " << c.creator;
    } else {
      out << "  creator " << c.creator << "  opened by";
      for (auto pid : c.ends) out << " " << pid;
    }
    out << "\n";
  }
  return out.str();
}

std::string listing_json(const std::vector<SegmentInfo>& segments,
                         const std::vector<ChannelReport>& channels) {
  std::string out = segments_json(segments);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  out = "{\"segments\": " + out + ",\n\"channels\": [";
  for (std::size_t i = 0; i < channels.size(); ++i) {
    const auto& c = channels[i];
    out += i ? ",\n " : "\n ";
    out += "{\"name\": " + json_string(c.name) + ", \"kind\": " + json_string(c.kind) +
           ", \"creator_pid\": " + std::to_string(c.creator);
    if (!c.error.empty()) {
      out += ", \"error\": " + json_string(c.error);
    } else if (c.kind == "queue") {
      out += ", \"depth\": " + std::to_string(c.depth) + ", \"maxsize\": " +
             std::to_string(c.maxsize) + ", \"ends\": [" + join_pids(c.ends, ", ") + "]";
    } else if (c.kind == "broadcast") {
      out += ", \"readers\": [";
      for (std::size_t r = 0; r < c.readers.size(); ++r) {
        if (r) out += ", ";
        out += "{\"index\": " + std::to_string(r) + ", \"pid\": " +
               (c.readers[r].pid != 0 ? std::to_string(c.readers[r].pid) : "null") +
               ", \"behind\": " + std::to_string(c.readers[r].behind) + "}";
      }
      out += "]";
    } else {
      out += ", \"ends\": [" + join_pids(c.ends, ", ") + "]";
    }
    out += "}";
  }
  return out + (channels.empty() ? "]}\n" : "\n]}\n");
}

std::string format_sweep(const SweepReport& r, bool dry_run) {
  std::ostringstream os;
  std::uint64_t bytes = 0;
  for (const auto& s : r.removed) {
    bytes += s.facts.size;
    os << (dry_run ? "would remove " : "removed ") << s.name << " (" << human_size(s.facts.size)
       << ", creator " << s.facts.creator_pid << " gone, no process maps it)\n";
  }
  os << (dry_run ? "would remove " : "removed ") << r.removed.size() << " name"
     << (r.removed.size() == 1 ? "" : "s") << " (" << human_size(bytes) << "); kept "
     << r.kept.size() << " in use";
  if (dry_run) os << "; nothing was removed (--dry-run)";
  os << "\n";
  return os.str();
}

}  // namespace shmtensor::internal::manager
