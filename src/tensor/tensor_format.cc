// Printing, following torch's _tensor_str.py (threshold 1000, edgeitems 3, precision 4,
// linewidth 80) so that output can be compared with Python's side by side. Differences: the
// dtype is always printed, without "torch.", and "tensor(undefined)" for an undefined tensor.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "shmtensor/tensor.h"

namespace shmtensor {

namespace {

constexpr std::int64_t kThreshold = 1000;
constexpr std::int64_t kEdgeItems = 3;
constexpr std::int64_t kLineWidth = 80;

enum class Kind { kBool, kInteger, kFloat, kComplex };

Kind kind_of(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return Kind::kBool;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kFloat32:
    case DType::kFloat64:
      return Kind::kFloat;
    case DType::kComplex64:
    case DType::kComplex128:
      return Kind::kComplex;
    default:
      return Kind::kInteger;
  }
}

// torch's _Formatter for floating values: integers print as "3.", otherwise 4 decimals,
// scientific when the magnitudes span too much.
class FloatFormatter {
 public:
  explicit FloatFormatter(const std::vector<double>& values) {
    double min = 0;
    double max = 0;
    bool any = false;
    bool integral = true;
    for (double v : values) {
      if (!std::isfinite(v) || v == 0) continue;
      const double a = std::fabs(v);
      min = any ? std::min(min, a) : a;
      max = any ? std::max(max, a) : a;
      any = true;
      if (v != std::ceil(v)) integral = false;
    }
    if (any) {
      if (integral) {
        mode_ = max / min > 1000.0 || max > 1.0e8 ? Mode::kScientific : Mode::kIntegral;
      } else {
        mode_ =
            max / min > 1000.0 || max > 1.0e8 || min < 1.0e-4 ? Mode::kScientific : Mode::kFixed;
      }
    }
    for (double v : values) width_ = std::max(width_, format_unpadded(v).size());
  }

  std::size_t width() const { return width_; }
  std::string format(double v) const {
    std::string s = format_unpadded(v);
    return std::string(width_ - std::min(width_, s.size()), ' ') + s;
  }

 private:
  enum class Mode { kIntegral, kFixed, kScientific };

  std::string format_unpadded(double v) const {
    // Python prints every NaN as "nan"; printf may print "-nan".
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    char buf[64];
    switch (mode_) {
      case Mode::kIntegral:
        std::snprintf(buf, sizeof buf, "%.0f.", v);
        break;
      case Mode::kFixed:
        std::snprintf(buf, sizeof buf, "%.4f", v);
        break;
      case Mode::kScientific:
        std::snprintf(buf, sizeof buf, "%.4e", v);
        break;
    }
    return buf;
  }

  Mode mode_ = Mode::kIntegral;
  std::size_t width_ = 1;
};

class Printer {
 public:
  explicit Printer(const Tensor& t)
      : kind_(kind_of(t.dtype())), summarize_(t.numel() > kThreshold) {}

  std::string print(const Tensor& t) {
    // Pass 1 gathers the printed values (formatting depends on all of them), pass 2 renders.
    render(t, 7, [this](const Tensor& e) {
      collect(e);
      return std::string();
    });
    prepare();
    std::size_t next = 0;
    return render(t, 7, [this, &next](const Tensor&) { return strings_[next++]; });
  }

 private:
  using ElementFn = std::function<std::string(const Tensor&)>;

  void collect(const Tensor& e) {
    switch (kind_) {
      case Kind::kBool:
        strings_.push_back(e.item<bool>() ? "True" : "False");
        break;
      case Kind::kInteger:
        strings_.push_back(std::to_string(e.item<std::int64_t>()));
        break;
      case Kind::kFloat:
        real_.push_back(e.item<double>());
        break;
      case Kind::kComplex: {
        const auto c = e.item<std::complex<double>>();
        real_.push_back(c.real());
        imag_.push_back(c.imag());
        break;
      }
    }
  }

  // Turns the collected values into padded strings and fixes element_length_.
  void prepare() {
    if (kind_ == Kind::kBool || kind_ == Kind::kInteger) {
      std::size_t width = 1;
      for (const auto& s : strings_) width = std::max(width, s.size());
      for (auto& s : strings_) s.insert(0, width - s.size(), ' ');
      element_length_ = width + 2;
    } else if (kind_ == Kind::kFloat) {
      FloatFormatter f(real_);
      for (double v : real_) strings_.push_back(f.format(v));
      element_length_ = f.width() + 2;
    } else {
      FloatFormatter re(real_);
      FloatFormatter im(imag_);
      for (std::size_t i = 0; i < real_.size(); ++i) {
        std::string imag = im.format(imag_[i]);
        imag.erase(0, imag.find_first_not_of(' '));
        imag += 'j';
        const bool signed_imag = imag[0] == '-' || imag[0] == '+';
        strings_.push_back(re.format(real_[i]) + (signed_imag ? "" : "+") + imag);
      }
      element_length_ = re.width() + 2 + im.width() + 1;
    }
  }

  std::string render(const Tensor& t, std::int64_t indent, const ElementFn& element) {
    if (t.dim() == 0) return element(t);
    const std::int64_t n = t.size(0);
    const bool cut = summarize_ && n > 2 * kEdgeItems;
    std::vector<std::string> parts;
    for (std::int64_t i = 0; i < n; ++i) {
      if (cut && i == kEdgeItems) {
        parts.push_back(t.dim() == 1 ? " ..." : "...");
        i = n - kEdgeItems;
      }
      parts.push_back(t.dim() == 1 ? element(t.select(0, i)) : render(t[i], indent + 1, element));
    }
    std::string separator = ",";
    std::int64_t per_line = static_cast<std::int64_t>(parts.size());
    if (t.dim() == 1) {
      per_line = std::max<std::int64_t>(
          1, (kLineWidth - indent) / static_cast<std::int64_t>(element_length_));
      separator += '\n';
    } else {
      per_line = 1;
      separator.append(static_cast<std::size_t>(t.dim() - 1), '\n');
    }
    separator.append(static_cast<std::size_t>(indent + 1), ' ');
    std::string out = "[";
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (i > 0) out += i % static_cast<std::size_t>(per_line) == 0 ? separator : ", ";
      out += parts[i];
    }
    return out + "]";
  }

  Kind kind_;
  bool summarize_;
  std::vector<double> real_;
  std::vector<double> imag_;
  std::vector<std::string> strings_;
  std::size_t element_length_ = 3;
};

}  // namespace

std::string Tensor::to_string() const {
  if (!defined()) return "tensor(undefined)";
  if (is_cuda()) {
    // As torch prints it: the values, then the device before the dtype.
    std::string host = cpu().to_string();
    const std::size_t at = host.rfind(", dtype=");
    return host.insert(at, ", device='" + device().to_string() + "'");
  }
  std::string out = "tensor(";
  if (numel() == 0) {
    out += "[]";
    if (dim() != 1) {
      out += ", size=(";
      for (std::int64_t d = 0; d < dim(); ++d)
        out += (d > 0 ? ", " : "") + std::to_string(sizes_[d]);
      out += ")";
    }
  } else {
    out += Printer(*this).print(*this);
  }
  return out + ", dtype=" + std::string(shmtensor::to_string(dtype_)) + ")";
}

std::ostream& operator<<(std::ostream& os, const Tensor& tensor) {
  return os << tensor.to_string();
}

}  // namespace shmtensor
