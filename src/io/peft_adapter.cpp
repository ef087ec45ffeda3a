// LoRA targets, spec and shapes in nibble's fused layout, the fused-to-PEFT module table, and merging
// an adapter into HF-named FP32 weights (W + scale * B A, FP64 accumulation, one rounding).
#include "io/peft_adapter.h"
#include <algorithm>
#include <charconv>
#include <cmath>
#include <thread>

namespace nb {

namespace {
constexpr LoraTarget kAllTargets[kLoraTargetCount] = {LoraTarget::linear_qkv, LoraTarget::linear_proj,
                                                      LoraTarget::linear_fc1, LoraTarget::linear_fc2};

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

bool has_target(const std::vector<LoraTarget>& ts, LoraTarget t) {
  return std::find(ts.begin(), ts.end(), t) != ts.end();
}

// "model.layers.{i}.{module path}.weight" of an adapted-able module: its layer, target and rows.
bool match_hf_linear(const std::string& name, const LlamaConfig& c, int64_t* layer, LoraTarget* target,
                     PeftModule* module) {
  static const std::string kPrefix = "model.layers.";
  if (name.compare(0, kPrefix.size(), kPrefix) != 0) return false;
  const char* first = name.c_str() + kPrefix.size();
  const char* last = name.c_str() + name.size();
  int64_t l = -1;
  const auto [end, ec] = std::from_chars(first, last, l);
  if (ec != std::errc() || end == first || end == last || *end != '.' || l < 0 || l >= c.layers) return false;
  const std::string rest(end + 1, last);
  for (LoraTarget t : kAllTargets)
    for (const PeftModule& m : peft_modules(c, t))
      if (rest == std::string(m.path) + ".weight") {
        *layer = l;
        *target = t;
        *module = m;
        return true;
      }
  return false;
}

// values[i, :] += scale * B[row0 + i, :] @ A for rows [r0, r1) of the module; FP64 accumulation.
void merge_rows(const LoraLinear& L, int64_t rank, double scale, int64_t row0, int64_t r0, int64_t r1, float* values) {
  const int64_t in = L.in;
  std::vector<double> acc(size_t(in), 0.0);
  for (int64_t i = r0; i < r1; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0);
    const float* brow = L.b.data() + (row0 + i) * rank;
    for (int64_t k = 0; k < rank; ++k) {
      const double bk = brow[k];
      const float* arow = L.a.data() + k * in;
      for (int64_t j = 0; j < in; ++j) acc[size_t(j)] += bk * double(arow[j]);
    }
    float* w = values + i * in;
    for (int64_t j = 0; j < in; ++j) w[j] = float(double(w[j]) + scale * acc[size_t(j)]);
  }
}
}  // namespace

const char* lora_target_name(LoraTarget t) {
  switch (t) {
    case LoraTarget::linear_qkv: return "linear_qkv";
    case LoraTarget::linear_proj: return "linear_proj";
    case LoraTarget::linear_fc1: return "linear_fc1";
    case LoraTarget::linear_fc2: return "linear_fc2";
  }
  return "?";
}

Status parse_lora_targets(const std::string& csv, std::vector<LoraTarget>* out) {
  out->clear();
  if (trim(csv) == "all-linear") {
    out->assign(std::begin(kAllTargets), std::end(kAllTargets));
    return Status::ok();
  }
  bool seen[kLoraTargetCount] = {};
  size_t pos = 0;
  while (pos <= csv.size()) {
    const size_t comma = std::min(csv.find(',', pos), csv.size());
    const std::string name = trim(csv.substr(pos, comma - pos));
    pos = comma + 1;
    if (name.empty())
      return errorf(
          "LoRA targets '%s' hold an empty name; name some of linear_qkv, linear_proj, linear_fc1, "
          "linear_fc2 separated by commas, or all-linear",
          csv.c_str());
    int found = -1;
    for (int i = 0; i < kLoraTargetCount; ++i)
      if (name == lora_target_name(kAllTargets[i])) found = i;
    if (found < 0)
      return errorf(
          "LoRA target '%s' in '%s' is not one nibble knows; name some of linear_qkv, linear_proj, linear_fc1, "
          "linear_fc2 (comma-separated), or all-linear",
          name.c_str(), csv.c_str());
    if (seen[found]) return errorf("LoRA targets '%s' name %s twice; name each target once", csv.c_str(), name.c_str());
    seen[found] = true;
  }
  for (int i = 0; i < kLoraTargetCount; ++i)
    if (seen[i]) out->push_back(kAllTargets[i]);
  return Status::ok();
}

double LoraSpec::scale() const { return use_rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank); }

Status validate(const LoraSpec& s) {
  if (s.rank < 1)
    return errorf("LoRA rank %lld is not positive; choose a rank of 1 or more (e.g. 32)", (long long)s.rank);
  if (!std::isfinite(s.alpha) || s.alpha <= 0)
    return errorf("LoRA alpha %g is not a positive number; choose e.g. alpha = rank (scale 1)", s.alpha);
  if (!(s.dropout >= 0 && s.dropout < 1))
    return errorf("LoRA dropout %g is outside [0, 1); choose a probability such as 0 or 0.1", s.dropout);
  if (s.targets.empty())
    return errorf(
        "the LoRA spec has no targets; name at least one of linear_qkv, linear_proj, "
        "linear_fc1, linear_fc2");
  for (size_t i = 0; i < s.targets.size(); ++i)
    if (std::find(s.targets.begin() + long(i) + 1, s.targets.end(), s.targets[i]) != s.targets.end())
      return errorf("the LoRA spec names %s twice; name each target once", lora_target_name(s.targets[i]));
  return Status::ok();
}

void lora_target_shape(const LlamaConfig& c, LoraTarget t, int64_t* in, int64_t* out) {
  switch (t) {
    case LoraTarget::linear_qkv: *in = c.hidden, *out = c.q_dim() + 2 * c.kv_dim(); return;
    case LoraTarget::linear_proj: *in = c.q_dim(), *out = c.hidden; return;
    case LoraTarget::linear_fc1: *in = c.hidden, *out = 2 * c.ffn; return;
    case LoraTarget::linear_fc2: *in = c.ffn, *out = c.hidden; return;
  }
}

std::vector<PeftModule> peft_modules(const LlamaConfig& c, LoraTarget t) {
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  switch (t) {
    // Row order of the fused weights: params.cpp keeps q, k, v adjacent; gate_up is [gate; up].
    case LoraTarget::linear_qkv:
      return {{"self_attn.q_proj", 0, qd}, {"self_attn.k_proj", qd, kvd}, {"self_attn.v_proj", qd + kvd, kvd}};
    case LoraTarget::linear_proj: return {{"self_attn.o_proj", 0, c.hidden}};
    case LoraTarget::linear_fc1: return {{"mlp.gate_proj", 0, c.ffn}, {"mlp.up_proj", c.ffn, c.ffn}};
    case LoraTarget::linear_fc2: return {{"mlp.down_proj", 0, c.hidden}};
  }
  return {};
}

void lora_allocate(const LlamaConfig& c, const LoraSpec& spec, LoraAdapter* out) {
  out->spec = spec;
  out->linears.clear();
  for (int64_t l = 0; l < c.layers; ++l)
    for (LoraTarget t : spec.targets) {
      LoraLinear L;
      L.layer = l;
      L.target = t;
      lora_target_shape(c, t, &L.in, &L.out);
      L.a.assign(size_t(spec.rank * L.in), 0.0f);
      L.b.assign(size_t(L.out * spec.rank), 0.0f);
      out->linears.push_back(std::move(L));
    }
}

const LoraLinear* lora_find(const LoraAdapter& ad, int64_t layer, LoraTarget t) {
  for (const LoraLinear& L : ad.linears)
    if (L.layer == layer && L.target == t) return &L;
  return nullptr;
}

Status check_lora_adapter(const LoraAdapter& ad, const LlamaConfig& c) {
  NB_TRY(validate(ad.spec));
  const size_t nt = ad.spec.targets.size();
  if (ad.linears.size() != size_t(c.layers) * nt)
    return errorf(
        "the LoRA adapter holds %zu linears but %lld layers x %zu targets need %zu; build it with lora_allocate",
        ad.linears.size(), (long long)c.layers, nt, size_t(c.layers) * nt);
  const int64_t r = ad.spec.rank;
  for (size_t i = 0; i < ad.linears.size(); ++i) {
    const LoraLinear& L = ad.linears[i];
    const int64_t layer = int64_t(i / nt);
    const LoraTarget t = ad.spec.targets[i % nt];
    if (L.layer != layer || L.target != t)
      return errorf("LoRA linear %zu is layer %lld %s, expected layer %lld %s; build the adapter with lora_allocate", i,
                    (long long)L.layer, lora_target_name(L.target), (long long)layer, lora_target_name(t));
    int64_t in = 0, out = 0;
    lora_target_shape(c, t, &in, &out);
    if (L.in != in || L.out != out || L.a.size() != size_t(r * in) || L.b.size() != size_t(out * r))
      return errorf(
          "LoRA linear of layer %lld %s is %lld -> %lld with %zu A and %zu B values, but model '%s' at rank %lld "
          "needs %lld -> %lld with %lld and %lld; the adapter was built for another model or rank",
          (long long)layer, lora_target_name(t), (long long)L.in, (long long)L.out, L.a.size(), L.b.size(),
          c.name.c_str(), (long long)r, (long long)in, (long long)out, (long long)(r * in), (long long)(out * r));
  }
  return Status::ok();
}

Status lora_merge_into(const LoraAdapter& ad, const LlamaConfig& c, const HfTensor& t, float* values) {
  int64_t layer = 0;
  LoraTarget target{};
  PeftModule m;
  if (!match_hf_linear(t.name, c, &layer, &target, &m) || !has_target(ad.spec.targets, target)) return Status::ok();
  const LoraLinear* L = lora_find(ad, layer, target);
  if (!L)
    return errorf("the LoRA adapter has no %s for layer %lld, which its targets name; it is incomplete",
                  lora_target_name(target), (long long)layer);
  const int64_t r = ad.spec.rank;
  if (t.shape != std::vector<int64_t>{m.rows, L->in} || t.numel != m.rows * L->in || L->a.size() != size_t(r * L->in) ||
      L->b.size() != size_t(L->out * r) || m.row0 + m.rows > L->out)
    return errorf(
        "cannot merge the LoRA of layer %lld %s (rank %lld, %lld -> %lld) into %s of %lld elements; the "
        "adapter and the model differ in shape",
        (long long)layer, lora_target_name(target), (long long)r, (long long)L->in, (long long)L->out, t.name.c_str(),
        (long long)t.numel);
  // Threads over row blocks: a 70B model's merge is about 2 T multiply-adds in FP64.
  const double scale = ad.spec.scale();
  const int64_t work = m.rows * L->in * r;
  const int64_t threads =
      std::clamp<int64_t>(std::min<int64_t>(std::thread::hardware_concurrency(), work >> 22), 1, m.rows);
  if (threads == 1) {
    merge_rows(*L, r, scale, m.row0, 0, m.rows, values);
    return Status::ok();
  }
  std::vector<std::thread> pool;
  for (int64_t p = 0; p < threads; ++p) {
    const int64_t r0 = m.rows * p / threads, r1 = m.rows * (p + 1) / threads;
    pool.emplace_back([&, r0, r1] { merge_rows(*L, r, scale, m.row0, r0, r1, values); });
  }
  for (std::thread& th : pool) th.join();
  return Status::ok();
}

HfTensorSource lora_merged_source(const LoraAdapter& ad, const LlamaConfig& c, HfTensorSource base) {
  return [&ad, c, base = std::move(base)](const HfTensor& t, float* dst) {
    NB_TRY(base(t, dst));
    return lora_merge_into(ad, c, t, dst);
  };
}

}  // namespace nb
