// The memory estimate of a training job, per rank, part by part (core/memory_ledger.h's parts, so a run's
// measured high-water marks line up with it row by row). Each row comes from the function that sizes the
// allocation at run time, called without allocating: parameters (LlamaModel::parameter_bytes and its LoRA
// and FSDP variants), activations (the arena's plan), the Linears' copies and workspace (their own
// placement code run dry), the emulated GEMMs' scratch (gemm's plan_emulation), step inputs, data-parallel
// buffers. Two rows are measured constants, named as such: the attention workspace cuDNN asks for and the
// CUDA libraries' own memory outside nibble's allocator (handles, NCCL's buffers, the stream-ordered pool).
//
// The job's knobs (micro-batch, recompute, offload, sharding, ranks, tensor and context parallelism) are fields
// of MemoryJob, so the advice (advise_memory) can try each change and suggest only what the estimate says fits,
// cheapest first. Under tensor parallelism every row is one rank's: the model of tp::local_config(model, T).
#pragma once
#include <algorithm>
#include <string>
#include <vector>
#include "core/memory_ledger.h"
#include "model/llama_model.h"
#include "model/lora.h"
#include "model/pipeline_split.h"
#include "recipe/recipe.h"

namespace nb {

struct MemoryJob {
  LlamaConfig model;
  Device dev = Device::cuda;
  recipe::Recipe recipe;       // the run's recipe (the Linears' copies)
  recipe::Recipe params_plan;  // the weights' plan (compute copies; annealing keeps them all)
  recipe::Recipe acts_plan;    // the activation plan (covers both recipes of an anneal)
  bool anneal = false;         // a precision switch is planned: the old copies go before the new ones come
  recipe::Recipe anneal_recipe;
  int64_t micro_batch = 1, seq = 1, global_batch = 1;
  Recompute recompute = Recompute::none;
  int ranks = 1, local_ranks = 1;  // world size, and ranks on this machine (host memory is shared)
  int context_parallel = 1;        // --context-parallel-size: each rank holds seq / C tokens of a row
  int tensor_parallel = 1;         // --tensor-model-parallel-size: each rank holds 1/T of every layer
  // --pipeline-model-parallel-size: each rank holds its chunks of the split's P x V virtual stages (V chunks per rank
  // under the interleaved schedule), the embedding on the first stage, the final norm and LM head on the last, and
  // its schedule's most passes in flight. estimate_memory sizes rank pipeline_rank's stage, or (-1) every rank's and
  // reports the largest; without the split (pipeline_stages empty) an even share of the layers stands for a rank's.
  int pipeline = 1, virtual_stages = 1;
  std::vector<pp::LayerRange> pipeline_stages;
  int pipeline_rank = -1;
  int64_t pipeline_layers() const;    // the layers rank pipeline_rank holds
  bool sequence_parallel = false;     // --sequence-parallel: the residual stream on 1/T of the tokens
  std::string strategy = "no_shard";  // no_shard | optim | optim_grads | optim_grads_params
  optim::Placement placement;         // --optimizer-cpu-offload
  int64_t offload_chunk_elems = 0;    // its streaming chunk (--optimizer-state-offload-chunk-size-mb), offloaded or not
  bool lora = false;
  LoraSpec lora_spec;
  bool embeddings_per_step = false, grad_reduce_in_bf16 = false, overlap = false;
  int64_t ddp_bucket_size = 0;
  bool training_format_gather = false;  // Megatron-FSDP gathers quantized weights in their format
  bool quant_stats = false, packed = false;
  bool deterministic = false;  // --deterministic-mode: the attention backward without the dQ accumulator
  bool saves = false;          // checkpoints are written (rank 0 keeps host copies of master, m and v)
  // --sample-interval: the generator's context and prompt (its KV cache and buffers exist while it samples).
  int64_t sample_len = 0, sample_prompt_tokens = 0;
  // Quantized layers keep no compute copy of their weights (the weight stage; generation casts them on use).
  bool master_only() const;

  // What strategy and ranks set: one rule, which Trainer::apply_world applies to the model too. Gradients, the
  // optimizer's shards and Megatron-FSDP run over the data x context ranks of one tensor-parallel index.
  int dp_cp_ranks() const { return std::max(1, ranks / (tensor_parallel * pipeline)); }
  int data_ranks() const { return std::max(1, ranks / (tensor_parallel * context_parallel * pipeline)); }  // replicas
  int shards() const;
  LlamaModel::Fsdp fsdp() const;
  int64_t bucket_elems() const;
  int64_t accumulation() const { return global_batch / (micro_batch * data_ranks()); }
  int64_t local_seq() const { return seq / context_parallel; }  // a rank's tokens per row
  LlamaConfig local_model() const {                             // what a rank holds
    LlamaConfig m = tp::local_config(model, tensor_parallel);
    m.layers = pipeline_layers();
    return m;
  }
};

struct MemoryEstimate {
  struct Row {
    MemPart part;
    double bytes;
    std::string how;  // where the figure comes from, in a few words
  };
  std::vector<Row> rows;             // nibble's device allocations per rank, by part
  double libraries = 0;              // the CUDA libraries' own device memory (not nibble's allocator)
  int pipeline_rank = -1;            // under pipeline parallelism: the rank whose stage this is (the largest)
  std::vector<double> stage_totals;  // under pipeline parallelism: every rank's stage's device() total, by rank
  double host = 0;                   // host memory on one machine: offloaded state of its ranks, checkpoint copies
  double nibble() const;             // sum of rows
  double device() const { return nibble() + libraries; }
  double part(MemPart p) const;
};

// Measured constants (docs/MEMORY.md): what a CUDA context and the driver take of a GPU's memory before
// nibble starts (an H100 80GB: 79.65 GiB total, 78.66 free), and the libraries' memory beyond nibble's allocations on
// one GPU and with NCCL.
constexpr double kCudaContextBytes = 1.0 * 1073741824.0;
constexpr double kLibraryBytes = 0.5 * 1073741824.0;
constexpr double kNcclBytes = 0.75 * 1073741824.0;

Status estimate_memory(const MemoryJob& job, MemoryEstimate* out);
// The table printed before step 1 (and by --dry-run): one line per part, the total, the free memory.
std::string format_memory_table(const MemoryEstimate& e, double free_bytes);

// The largest micro-batch (a power of two dividing the batch per rank, or 0) that fits `free_bytes`.
int64_t largest_fitting_micro_batch(const MemoryJob& job, double free_bytes);

// With --optimizer-cpu-offload: the least share of the state in host memory (1% steps) with which the job fits
// `free_bytes` per GPU and `host_bytes` per machine; 0 when even all of it does not fit.
double least_offload_fraction(const MemoryJob& job, double free_bytes, double host_bytes);

// One change to the job that the estimate says fits: the flags to pass and the estimate with it.
struct MemoryAdvice {
  std::string flags;  // "--recompute selective", "--nproc-per-node 2 --use-megatron-fsdp ..."
  std::string what;   // in words, with the cost it brings
  double device_bytes = 0, host_bytes = 0;
};
// Changes that make `job` fit `free_bytes` per GPU and `host_bytes` per machine, cheapest first (at most
// `limit`); each one checked by the estimate. gpus_per_node bounds the ranks suggested on one machine.
std::vector<MemoryAdvice> advise_memory(const MemoryJob& job, double free_bytes, double host_bytes, int gpus_per_node,
                                        size_t limit = 4);

// The smallest tensor x context parallel split of one model replica (T and C in 1, 2, 4, 8, T x C at most
// max_gpus; T dividing the heads, KV heads and FFN, 2 x C the sequence) with which the job fits, its data-parallel
// replicas kept, sharded over the data x context ranks (Megatron-FSDP's optim_grads_params without tensor
// parallelism, the distributed optimizer with it); of equal products, the one needing least memory. tensor == 0
// when none fits.
struct ParallelSplit {
  int tensor = 0, context = 0;
  std::string flags;  // "--tensor-model-parallel-size 2 --context-parallel-size 4 --use-distributed-optimizer"
                      // (the sizes above 1 and the sharding)
  double device_bytes = 0;
};
ParallelSplit smallest_parallel_split(const MemoryJob& job, double free_bytes, double host_bytes, int max_gpus);
// "smallest tensor x context parallel split that fits seq 131072: T2 x C4 (...)", or one saying none does.
std::string parallel_split_line(const MemoryJob& job, double free_bytes, double host_bytes, int max_gpus);

}  // namespace nb
