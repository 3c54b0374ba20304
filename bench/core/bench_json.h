// Small helpers shared by the in-process benchmarks: medians, /proc memory
// figures and the figure records that scripts/bench.sh merges into
// bench/results/latest.json. Header-only, no LibTorch, no gRPC, so that both
// bench/core and bench/e2e can include it.
#ifndef REFIT_BENCH_CORE_BENCH_JSON_H_
#define REFIT_BENCH_CORE_BENCH_JSON_H_

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace refit::bench {

inline double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double Median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A field of /proc/<pid>/status in bytes ("VmRSS", "VmHWM"); -1 if absent.
inline int64_t ProcStatusBytes(const std::string& pid, const std::string& field) {
  std::ifstream in("/proc/" + pid + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) {
      std::istringstream fields(line.substr(field.size() + 1));
      int64_t kib = -1;
      fields >> kib;
      return kib < 0 ? -1 : kib * 1024;
    }
  }
  return -1;
}

// Resets the peak RSS (VmHWM) of `pid` to its current RSS (Linux >= 4.0).
inline bool ResetPeakRss(const std::string& pid) {
  std::ofstream out("/proc/" + pid + "/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

// One row of latest.json's "figures". `ratio` is value / reference_value
// unless the caller gives it; `met` is null when there is no target.
struct Figure {
  std::string name;
  double value = 0;
  std::string unit;
  std::string reference_name;
  double reference_value = 0;
  std::optional<double> ratio;
  std::string target;  // e.g. "<= 1.2", ">= 0.9"; "" for none
  std::optional<bool> met;
  std::string note;
};

inline nlohmann::json ToJson(const Figure& f) {
  nlohmann::json j;
  j["name"] = f.name;
  j["value"] = f.value;
  j["unit"] = f.unit;
  j["reference_name"] = f.reference_name;
  j["reference_value"] = f.reference_value;
  double ratio =
      f.ratio.has_value() ? *f.ratio : (f.reference_value != 0 ? f.value / f.reference_value : 0);
  j["ratio"] = ratio;
  j["target"] = f.target.empty() ? nlohmann::json(nullptr) : nlohmann::json(f.target);
  j["met"] = f.met.has_value() ? nlohmann::json(*f.met) : nlohmann::json(nullptr);
  if (!f.note.empty()) j["note"] = f.note;
  return j;
}

// "<= 1.2" / ">= 0.9" against `ratio`.
inline std::optional<bool> MeetsTarget(const std::string& target, double ratio) {
  if (target.size() < 3) return std::nullopt;
  const double bound = std::stod(target.substr(3));
  if (target.compare(0, 2, "<=") == 0) return ratio <= bound;
  if (target.compare(0, 2, ">=") == 0) return ratio >= bound;
  return std::nullopt;
}

inline Figure MakeFigure(std::string name, double value, std::string unit,
                         std::string reference_name, double reference_value, double ratio,
                         std::string target, std::string note = "") {
  Figure f;
  f.name = std::move(name);
  f.value = value;
  f.unit = std::move(unit);
  f.reference_name = std::move(reference_name);
  f.reference_value = reference_value;
  f.ratio = ratio;
  f.target = std::move(target);
  f.met = MeetsTarget(f.target, ratio);
  f.note = std::move(note);
  return f;
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

}  // namespace refit::bench

#endif  // REFIT_BENCH_CORE_BENCH_JSON_H_
