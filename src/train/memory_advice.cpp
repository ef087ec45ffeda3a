// advise_memory (memory_estimate.h): the changes to a job that make it fit, each applied to the job and
// checked by the estimate, so nothing is suggested that the estimate says would not fit. Single changes
// first, in order of what they cost in step time; then pairs, when no single change fits.
#include <algorithm>
#include <functional>
#include "optim/optimizer_state.h"
#include "train/memory_estimate.h"

namespace nb {

namespace {

struct Change {
  int cost;   // rank: lower is cheaper in step time
  int group;  // changes of one group (recompute, micro-batch, sharding and ranks, offload) never pair
  std::string flags, what;
  std::function<bool(MemoryJob*)> apply;  // false: does not apply to this job
};

void add_more_rank_changes(const MemoryJob& job, int gpus, std::vector<Change>* out);
void add_tensor_parallel_changes(const MemoryJob& job, int gpus, std::vector<Change>* out);

bool fits(const MemoryJob& j, double free, double host, MemoryEstimate* e) {
  if (!estimate_memory(j, e)) return false;
  return e->device() <= free && (host <= 0 || e->host <= 0.95 * host);
}

std::string fsdp_flags(const std::string& strategy) {
  if (strategy == "optim") return "--use-distributed-optimizer";
  return "--use-megatron-fsdp --data-parallel-sharding-strategy " + strategy;
}

// The sharding the advice pairs with `tensor` tensor-parallel ranks: the distributed optimizer (Megatron-FSDP
// runs under tensor parallelism too, but its per-layer weight gathers add traffic beside TP's; a LoRA job, which
// refuses that optimizer, takes optim_grads_params instead), and the strongest, optim_grads_params, without TP.
const char* strongest_sharding(int tensor) { return tensor > 1 ? "optim" : "optim_grads_params"; }

// T divides the heads, KV heads and FFN (the vocabulary is padded instead; dist::check_model_fits_layout).
bool splits_model(const LlamaConfig& m, int t) { return m.heads % t == 0 && m.kv_heads % t == 0 && m.ffn % t == 0; }

std::vector<Change> candidate_changes(const MemoryJob& job, double free, double host, int gpus) {
  std::vector<Change> c;
  if (job.recompute == Recompute::none)
    c.push_back({1, 0, "--recompute selective", "recomputes norms and SwiGLU: a few % of step time",
                 [](MemoryJob* j) { return (j->recompute = Recompute::selective), true; }});
  for (int64_t mbs = job.micro_batch / 2; mbs >= 1; mbs /= 2) {
    MemoryJob j = job;
    j.micro_batch = mbs;
    MemoryEstimate e;
    if (!fits(j, free, host, &e) && mbs > 1) continue;
    c.push_back({2, 1, "--micro-batch-size " + std::to_string(mbs), "more accumulation steps, smaller GEMMs",
                 [mbs](MemoryJob* x) { return (x->micro_batch = mbs), true; }});
    break;
  }
  if (job.recompute != Recompute::full)
    c.push_back({3, 0, "--recompute full", "each layer's forward runs twice: about a third more compute",
                 [](MemoryJob* j) { return (j->recompute = Recompute::full), true; }});
  // Stronger sharding over the same ranks: each strategy past the current one (LoRA: only the base's).
  const char* kStrategies[] = {"no_shard", "optim", "optim_grads", "optim_grads_params"};
  int now = 0;
  for (int s = 0; s < 4; ++s) now = job.strategy == kStrategies[s] ? s : now;
  if (job.dp_cp_ranks() > 1)
    for (int s = std::max(now + 1, job.lora ? 3 : 1); s < (job.tensor_parallel > 1 ? 2 : 4); ++s)
      c.push_back({3 + s, 2, fsdp_flags(kStrategies[s]), "shards over the ranks: more communication per step",
                   [st = std::string(kStrategies[s])](MemoryJob* j) { return (j->strategy = st), true; }});
  if (!job.lora && !(job.placement.offload_fraction > 0)) {
    const double f = least_offload_fraction(job, free, host);
    if (f > 0)
      c.push_back({7, 3, "--optimizer-cpu-offload --optimizer-offload-fraction " + strprintf("%.2f", f),
                   "the optimizer state streams from host memory each step", [f](MemoryJob* j) {
                     j->placement = {f, j->offload_chunk_elems};
                     return true;
                   }});
  }
  add_more_rank_changes(job, gpus, &c);
  add_tensor_parallel_changes(job, gpus, &c);
  return c;
}

// More ranks of one machine (gpus bounds them), sharded: weights, gradients and state shrink with N, and
// activations too when the new ranks split the sequence (context parallelism, sharded over data x context).
// The job's tensor-parallel size stays; under it the distributed optimizer is the sharding.
void add_more_rank_changes(const MemoryJob& job, int gpus, std::vector<Change>* out) {
  std::vector<Change>& c = *out;
  const int per_cp = job.data_ranks() * job.tensor_parallel;  // ranks per context-parallel index
  const std::string cp_st = strongest_sharding(job.tensor_parallel);
  for (int cp = job.context_parallel * 2; per_cp * cp <= gpus && job.seq % (int64_t(2) * cp) == 0; cp *= 2) {
    const int n = per_cp * cp;
    c.push_back({9 + n, 2,
                 "--nproc-per-node " + std::to_string(n) + " --context-parallel-size " + std::to_string(cp) + " " +
                     fsdp_flags(cp_st),
                 std::to_string(n) + " GPUs, each holding 1/" + std::to_string(cp) + " of every sequence",
                 [n, cp, cp_st](MemoryJob* j) {
                   j->ranks = n;
                   j->local_ranks = n;
                   j->context_parallel = cp;
                   j->strategy = cp_st;
                   return true;
                 }});
  }
  const int split = job.tensor_parallel * job.context_parallel;
  for (int n = std::max(2, job.ranks * 2); n <= gpus; n *= 2) {
    if (n % split != 0 || job.global_batch % (job.micro_batch * (n / split)) != 0) continue;
    const std::string st = job.lora || job.shards() > 1 ? strongest_sharding(job.tensor_parallel) : "optim";
    for (const std::string& strategy : {st, std::string(strongest_sharding(job.tensor_parallel))}) {
      c.push_back({8 + n, 2, "--nproc-per-node " + std::to_string(n) + " " + fsdp_flags(strategy),
                   std::to_string(n) + " GPUs, sharded", [n, strategy](MemoryJob* j) {
                     j->ranks = n;
                     j->local_ranks = n;
                     j->strategy = strategy;
                     return true;
                   }});
      if (strategy == strongest_sharding(job.tensor_parallel)) break;
    }
  }
}

// Tensor parallelism (T = 2, 4, 8 dividing the heads, KV heads and FFN): weights, gradients, state and the
// attention and FFN activations shrink with T. Over the same ranks (fewer data-parallel replicas), or over more
// that keep the replicas; several data x context ranks shard with the distributed optimizer (a LoRA job's
// adapters have little state to shard, and LoRA refuses that optimizer). Not offered over a Megatron-FSDP job
// (its own strategy already shards what the distributed optimizer would).
void add_tensor_parallel_changes(const MemoryJob& job, int gpus, std::vector<Change>* out) {
  if (job.strategy == "optim_grads" || job.strategy == "optim_grads_params") return;
  const int cp = job.context_parallel;
  for (int t = job.tensor_parallel * 2; t <= 8; t *= 2) {
    if (!splits_model(job.model, t)) continue;
    for (const int n : {job.ranks, job.data_ranks() * cp * t}) {
      const int data = n / (t * cp);
      const bool same = n == job.ranks;
      if (n % (t * cp) != 0 || data < 1 || (!same && n > gpus)) continue;
      if (job.global_batch % (job.micro_batch * data) != 0) continue;
      const bool shard = data * cp > 1 && job.strategy == "no_shard" && !job.lora;
      std::string flags = same ? "" : "--nproc-per-node " + std::to_string(n) + " ";
      flags += "--tensor-model-parallel-size " + std::to_string(t);
      if (shard) flags.append(" ").append(fsdp_flags("optim"));
      out->push_back({same ? 8 + t : 10 + n, 2, flags,
                      (same ? "the same " : "") + std::to_string(n) + " GPUs, each holding 1/" + std::to_string(t) +
                          " of every layer: two all-reduces of its activations per layer each way",
                      [n, t, same, shard](MemoryJob* j) {
                        j->ranks = n;
                        if (!same) j->local_ranks = n;
                        j->tensor_parallel = t;
                        if (shard) j->strategy = "optim";
                        return true;
                      }});
    }
  }
}

}  // namespace

// In steps of 1%, the first share that fits by the estimate (each a whole estimate: cheap, no allocation).
double least_offload_fraction(const MemoryJob& job, double free, double host) {
  for (int pct = 1; pct <= 100; ++pct) {
    MemoryJob j = job;
    j.placement = {pct / 100.0, job.offload_chunk_elems};
    MemoryEstimate e;
    if (fits(j, free, host, &e)) return pct / 100.0;
  }
  return 0;
}

std::vector<MemoryAdvice> advise_memory(const MemoryJob& job, double free, double host, int gpus, size_t limit) {
  const std::vector<Change> changes = candidate_changes(job, free, host, gpus);
  std::vector<MemoryAdvice> out;
  auto try_apply = [&](const std::vector<const Change*>& set) {
    MemoryJob j = job;
    std::string flags, what;
    for (const Change* c : set) {
      if (!c->apply(&j)) return;
      flags += (flags.empty() ? "" : " ") + c->flags;
      what += (what.empty() ? "" : "; ") + c->what;
    }
    MemoryEstimate e;
    if (fits(j, free, host, &e)) out.push_back({flags, what, e.device(), e.host});
  };
  // Single changes and pairs of changes from different groups, by summed cost (a single change first on a
  // tie): two cheap local changes can beat more GPUs.
  std::vector<std::pair<int, std::vector<const Change*>>> sets;
  for (size_t a = 0; a < changes.size(); ++a) {
    sets.push_back({2 * changes[a].cost, {&changes[a]}});
    for (size_t b = a + 1; b < changes.size(); ++b)
      if (changes[a].group != changes[b].group)
        sets.push_back({2 * (changes[a].cost + changes[b].cost) + 1, {&changes[a], &changes[b]}});
  }
  std::stable_sort(sets.begin(), sets.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  for (const auto& entry : sets) {
    const std::vector<const Change*>& set = entry.second;
    if (out.size() >= limit) break;
    // A pair whose first change fits alone says nothing more than that change.
    if (set.size() == 2 && std::any_of(out.begin(), out.end(), [&](const MemoryAdvice& a) {
          return a.flags == set[0]->flags || a.flags == set[1]->flags;
        }))
      continue;
    try_apply(set);
  }
  return out;
}

// Splits by their GPU count, then by the memory they need; each with the job's data-parallel replicas (ranks
// D x T x C), sharded as strongly as T allows.
ParallelSplit smallest_parallel_split(const MemoryJob& job, double free, double host, int max_gpus) {
  ParallelSplit best;
  for (int gpus = 1; gpus <= std::min(64, max_gpus); gpus *= 2) {
    for (int t = 1; t <= std::min(8, gpus); t *= 2) {
      const int c = gpus / t;
      if (c > 8 || (c > 1 && job.seq % (int64_t(2) * c) != 0)) continue;
      if (!splits_model(job.model, t)) continue;
      MemoryJob j = job;
      j.ranks = job.data_ranks() * gpus;
      j.local_ranks = std::min(j.ranks, std::max(max_gpus, job.local_ranks));
      j.tensor_parallel = t;
      j.context_parallel = c;
      j.strategy = job.lora ? "optim_grads_params" : strongest_sharding(t);  // LoRA shards its base under FSDP
      MemoryEstimate e;
      if (!fits(j, free, host, &e) || (best.tensor > 0 && e.device() >= best.device_bytes)) continue;
      best.tensor = t;
      best.context = c;
      best.device_bytes = e.device();
      best.flags = (t > 1 ? "--tensor-model-parallel-size " + std::to_string(t) + " " : std::string()) +
                   (c > 1 ? "--context-parallel-size " + std::to_string(c) + " " : std::string()) +
                   (j.ranks > 1 ? fsdp_flags(j.strategy) : "one GPU");
    }
    if (best.tensor > 0) break;
  }
  return best;
}

std::string parallel_split_line(const MemoryJob& job, double free, double host, int max_gpus) {
  const ParallelSplit s = smallest_parallel_split(job, free, host, max_gpus);
  if (s.tensor == 0)
    return strprintf("no tensor x context parallel split of up to %d GPUs fits seq %lld", max_gpus, (long long)job.seq);
  return strprintf(
      "smallest tensor x context parallel split that fits seq %lld: T%d x C%d (%.2f GiB per GPU on %d "
      "GPUs per model replica: %s)",
      (long long)job.seq, s.tensor, s.context, s.device_bytes / 1073741824.0, s.tensor * s.context, s.flags.c_str());
}

}  // namespace nb
