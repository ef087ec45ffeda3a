// Pipeline parallelism's layer split (model/pipeline_split.h): the decoder layers of each virtual stage as
// Megatron-Core counts them, its refusals as one sentence each, and the stages' ranges in model order.
#include "model/pipeline_split.h"
#include <string>
#include "model/pipeline_layout.h"
#include <utility>

namespace nb::pp {

namespace {

constexpr const char* kFirstFlag = "--decoder-first-pipeline-num-layers";
constexpr const char* kLastFlag = "--decoder-last-pipeline-num-layers";

// "30 decoder layers + the embedding (...) = 31 layers": what the even split divides, for its messages.
std::string counted_layers(int64_t layers, const SplitOptions& o) {
  std::string s = strprintf("%lld decoder layers", (long long)layers);
  if (o.account_for_embedding) s += " + the embedding (--account-for-embedding-in-pipeline-split)";
  if (o.account_for_loss) s += " + the loss (--account-for-loss-in-pipeline-split)";
  if (o.account_for_embedding || o.account_for_loss)
    s += strprintf(" = %lld layers", (long long)(layers + int64_t(o.account_for_embedding) + o.account_for_loss));
  return s;
}

// "--decoder-first-pipeline-num-layers 4 and --decoder-last-pipeline-num-layers 2": the uneven flags given.
std::string given_stage_flags(const SplitOptions& o) {
  std::string s;
  if (o.first_stage_layers > 0) s = strprintf("%s %lld", kFirstFlag, (long long)o.first_stage_layers);
  if (o.last_stage_layers > 0)
    s += strprintf("%s%s %lld", s.empty() ? "" : " and ", kLastFlag, (long long)o.last_stage_layers);
  return s;
}

// Megatron's even split (get_num_layers_to_build without first/last counts): the decoder layers, plus one for
// each accounted embedding / loss, over P ranks, then each rank's over its V chunks; the embedding (loss) then
// takes one layer's place in virtual stage 0 (P*V-1), which may leave that stage without decoder layers.
Status even_stage_counts(int64_t layers, const SplitOptions& o, std::vector<int64_t>* counts) {
  const int64_t P = o.pipeline, V = o.virtual_stages;
  const int64_t total = layers + int64_t(o.account_for_embedding) + int64_t(o.account_for_loss);
  if (total % P != 0)
    return errorf(
        "--pipeline-model-parallel-size %lld does not divide the %s to split evenly; choose a size that divides "
        "%lld%s",
        (long long)P, counted_layers(layers, o).c_str(), (long long)total,
        o.account_for_embedding || o.account_for_loss
            ? ", or count the embedding and loss in differently"
            : ", or give the first / last stage its own count with --decoder-first-pipeline-num-layers / "
              "--decoder-last-pipeline-num-layers");
  const int64_t per_rank = total / P;
  if (per_rank % V != 0)
    return errorf(
        "each of the %lld pipeline ranks holds %lld of the %s, which its %lld virtual stages (model chunks) do not "
        "divide; choose --num-virtual-stages-per-pipeline-rank dividing %lld",
        (long long)P, (long long)per_rank, counted_layers(layers, o).c_str(), (long long)V, (long long)per_rank);
  counts->assign(size_t(P * V), per_rank / V);
  if (o.account_for_embedding) counts->front() -= 1;
  if (o.account_for_loss) counts->back() -= 1;
  return Status::ok();
}

// Megatron's uneven split (transformer_config.py's checks, get_num_layers_to_build): the first (last) pipeline
// rank holds the given count, the middle ranks an equal share of the rest, and every rank's layers divide
// evenly over its V chunks, so chunk v of rank r is virtual stage v*P + r with a 1/V share of the rank's layers.
Status uneven_stage_counts(int64_t layers, const SplitOptions& o, std::vector<int64_t>* counts) {
  const int64_t P = o.pipeline, V = o.virtual_stages, first = o.first_stage_layers, last = o.last_stage_layers;
  const std::string given = given_stage_flags(o);
  if (o.account_for_embedding || o.account_for_loss)
    return errorf(
        "%s cannot be combined with --account-for-embedding-in-pipeline-split or "
        "--account-for-loss-in-pipeline-split (Megatron refuses both ways of evening out the stages at once); "
        "use one of them",
        given.c_str());
  if (P == 1)
    return errorf("%s sets the layers of a pipeline stage: add --pipeline-model-parallel-size > 1 or leave it out",
                  given.c_str());
  for (const auto& [flag, n] : {std::pair{kFirstFlag, first}, std::pair{kLastFlag, last}})
    if (n % V != 0)
      return errorf(
          "%s %lld is not a multiple of the %lld virtual stages per pipeline rank, whose model chunks share that "
          "rank's layers equally; choose a multiple of %lld",
          flag, (long long)n, (long long)V, (long long)V);
  const int64_t middle = layers - first - last;
  const int64_t middle_ranks = P - int64_t(first > 0) - int64_t(last > 0);
  if (middle < 0)
    return errorf("%s add up to more than the model's %lld decoder layers", given.c_str(), (long long)layers);
  if (middle_ranks == 0 && middle > 0)
    return errorf(
        "with --pipeline-model-parallel-size 2 there is no middle stage for the other %lld decoder layers: %s must "
        "add up to the model's %lld",
        (long long)middle, given.c_str(), (long long)layers);
  if (middle_ranks > 0 && middle == 0)
    return errorf(
        "%s leave no decoder layers for the other %lld pipeline ranks, which Megatron refuses; lower them so that "
        "every rank holds layers",
        given.c_str(), (long long)middle_ranks);
  const int64_t per_rank = middle_ranks > 0 ? middle / middle_ranks : 0;
  if (middle_ranks > 0 && middle % middle_ranks != 0)
    return errorf(
        "the %lld decoder layers left after %s do not divide evenly over the other %lld pipeline ranks; choose "
        "counts that leave a multiple of %lld",
        (long long)middle, given.c_str(), (long long)middle_ranks, (long long)middle_ranks);
  if (per_rank % V != 0)
    return errorf(
        "with %s each of the other %lld pipeline ranks holds %lld decoder layers, which its %lld virtual stages "
        "(model chunks) do not divide; choose counts that leave each a multiple of %lld",
        given.c_str(), (long long)middle_ranks, (long long)per_rank, (long long)V, (long long)V);
  counts->assign(size_t(P * V), 0);
  for (int64_t s = 0; s < P * V; ++s) {
    const int64_t r = s % P;
    int64_t n = per_rank;
    if (r == 0 && first > 0) n = first;
    if (r == P - 1 && last > 0) n = last;
    (*counts)[size_t(s)] = n / V;
  }
  return Status::ok();
}

// --pipeline-model-parallel-layout: each virtual stage's decoder layers as the layout spells them; every layer
// placed by it, so Megatron's other ways of evening out the stages are refused beside it.
Status layout_stage_counts(int64_t layers, const SplitOptions& o, std::vector<int64_t>* counts) {
  if (o.account_for_embedding || o.account_for_loss || o.first_stage_layers > 0 || o.last_stage_layers > 0)
    return errorf(
        "--pipeline-model-parallel-layout places every layer itself: leave out --account-for-embedding-in-pipeline-"
        "split, --account-for-loss-in-pipeline-split and --decoder-first/last-pipeline-num-layers");
  std::vector<LayoutStage> stages;
  NB_TRY(parse_pipeline_layout(o.layout, &stages));
  const int64_t want = int64_t(o.pipeline) * o.virtual_stages;
  if (int64_t(stages.size()) != want)
    return errorf(
        "--pipeline-model-parallel-layout \"%s\" has %zu stages, but %d pipeline ranks x %d virtual stages "
        "need %lld",
        o.layout.c_str(), stages.size(), o.pipeline, o.virtual_stages, (long long)want);
  counts->clear();
  int64_t placed = 0;
  for (const LayoutStage& s : stages) {
    counts->push_back(s.decoder_layers);
    placed += s.decoder_layers;
  }
  if (placed != layers)
    return errorf("--pipeline-model-parallel-layout \"%s\" places %lld decoder layers ('t'); the model has %lld",
                  o.layout.c_str(), (long long)placed, (long long)layers);
  return Status::ok();
}

}  // namespace

Status layout_virtual_stages(const std::string& layout, int pipeline, int* virtual_stages) {
  std::vector<LayoutStage> stages;
  NB_TRY(parse_pipeline_layout(layout, &stages));
  const auto n = int64_t(stages.size());
  if (pipeline < 1) return errorf("--pipeline-model-parallel-size must be at least 1; got %d", pipeline);
  if (pipeline == 1 && n > 1)
    return errorf(
        "--pipeline-model-parallel-layout \"%s\" has %lld stages, which need --pipeline-model-parallel-size > 1 "
        "to run on",
        layout.c_str(), (long long)n);
  if (n % pipeline != 0)
    return errorf(
        "--pipeline-model-parallel-layout \"%s\" has %lld stages, not a multiple of --pipeline-model-parallel-size "
        "%d (every pipeline rank runs as many virtual stages); give %d x V stages",
        layout.c_str(), (long long)n, pipeline, pipeline);
  *virtual_stages = int(n / pipeline);
  return Status::ok();
}

Status split_layers(int64_t layers, const SplitOptions& o, std::vector<LayerRange>* stages) {
  if (layers < 1) return errorf("a pipeline split needs decoder layers; the model has %lld", (long long)layers);
  if (o.pipeline < 1) return errorf("--pipeline-model-parallel-size must be at least 1; got %d", o.pipeline);
  if (o.virtual_stages < 1)
    return errorf("the virtual stages per pipeline rank must be at least 1; got %d", o.virtual_stages);
  if (o.virtual_stages > 1 && o.pipeline == 1)
    return errorf(
        "%d virtual stages per pipeline rank (--num-virtual-stages-per-pipeline-rank or "
        "--num-layers-per-virtual-pipeline-stage) run the interleaved schedule, which needs "
        "--pipeline-model-parallel-size > 1",
        o.virtual_stages);
  if (o.first_stage_layers < 0 || o.last_stage_layers < 0)
    return errorf("%s and %s must be positive (0 = an even split); got %lld and %lld", kFirstFlag, kLastFlag,
                  (long long)o.first_stage_layers, (long long)o.last_stage_layers);
  std::vector<int64_t> counts;
  if (!o.layout.empty())
    NB_TRY(layout_stage_counts(layers, o, &counts));
  else if (o.first_stage_layers > 0 || o.last_stage_layers > 0)
    NB_TRY(uneven_stage_counts(layers, o, &counts));
  else
    NB_TRY(even_stage_counts(layers, o, &counts));
  stages->clear();
  int64_t begin = 0;
  for (const int64_t n : counts) {
    NB_CHECK(n >= 0, "a virtual stage of %lld decoder layers", (long long)n);
    stages->push_back({begin, begin + n});
    begin += n;
  }
  NB_CHECK(begin == layers, "the stages hold %lld of %lld decoder layers", (long long)begin, (long long)layers);
  return Status::ok();
}

int chunk_holding(const std::vector<LayerRange>& chunks, int64_t l) {
  for (size_t c = 0; c < chunks.size(); ++c)
    if (l >= chunks[c].begin && l < chunks[c].end) return int(c);
  return -1;
}

std::vector<LayerRange> rank_chunks(const std::vector<LayerRange>& stages, int rank, int pipeline) {
  NB_CHECK(pipeline >= 1 && rank >= 0 && rank < pipeline && stages.size() % size_t(pipeline) == 0,
           "rank %d of %d pipeline ranks over %zu virtual stages", rank, pipeline, stages.size());
  std::vector<LayerRange> chunks;
  for (size_t s = size_t(rank); s < stages.size(); s += size_t(pipeline)) chunks.push_back(stages[s]);
  return chunks;
}

Status resolve_virtual_stages(int64_t layers, int pipeline, int64_t layers_per_virtual_stage,
                              int64_t virtual_stages_per_rank, int* virtual_stages) {
  const long long n = layers_per_virtual_stage, v = virtual_stages_per_rank;
  if (n < 0 || v < 0)
    return errorf(
        "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank must be positive (0 = "
        "not given); got %lld and %lld",
        n, v);
  if (n > 0 && v > 0)
    return errorf(
        "--num-layers-per-virtual-pipeline-stage %lld and --num-virtual-stages-per-pipeline-rank %lld both set the "
        "virtual stages per pipeline rank; give only one",
        n, v);
  if (pipeline < 1) return errorf("--pipeline-model-parallel-size must be at least 1; got %d", pipeline);
  *virtual_stages = 1;
  if (v > 0) {
    // Every virtual stage but the first and last holds a layer, so more than `layers` can never split (and
    // the bound keeps V an int).
    if (v > layers)
      return errorf("--num-virtual-stages-per-pipeline-rank %lld exceeds the %lld layers to split", v,
                    (long long)layers);
    *virtual_stages = int(v);
  } else if (n > 0) {
    if (layers < 1 || layers % pipeline != 0)
      return errorf(
          "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size %d to divide the %lld "
          "layers to split; choose a size that divides them, or give --num-virtual-stages-per-pipeline-rank",
          pipeline, (long long)layers);
    const int64_t per_rank = layers / pipeline;
    if (per_rank % n != 0)
      return errorf(
          "--num-layers-per-virtual-pipeline-stage %lld does not divide the %lld layers of each pipeline rank (%lld "
          "over --pipeline-model-parallel-size %d); choose a divisor of %lld",
          n, (long long)per_rank, (long long)layers, pipeline, (long long)per_rank);
    *virtual_stages = int(per_rank / n);
  }
  return Status::ok();
}

double bubble_fraction(int pipeline, int virtual_stages, int64_t micro_batches) {
  NB_CHECK(pipeline >= 1 && virtual_stages >= 1 && micro_batches >= 1, "P %d, V %d, M %lld", pipeline, virtual_stages,
           (long long)micro_batches);
  return double(pipeline - 1) / (double(virtual_stages) * double(micro_batches));
}

}  // namespace nb::pp
