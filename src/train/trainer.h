// The training job as a small Trainer with explicit phases, each with one obvious place:
//   setup      configuration, tokenizer check, device, recipe, memory estimate, model, data  (trainer_setup.cpp)
//   load       a checkpoint (--load: resume or --finetune) or Hugging Face weights (--load-hf)
//                                                                                  (trainer_checkpoint.cpp)
//   step       one optimizer step: micro-batches, gradient norm, clipping, AdamW      (trainer.cpp)
//   evaluate   validation loss over --eval-iters global batches (Megatron's meaning)  (trainer.cpp)
//   save       checkpoint: device-to-host copy, then files on a background thread     (trainer_checkpoint.cpp)
//   summary    the end-of-run table                                                   (trainer.cpp)
// run_training() is setup + train loop + summary. Every failure is one sentence; nothing saved is lost.
#pragma once
#include <fstream>
#include <memory>
#include <string>
#include <vector>
#include "core/status.h"
#include "data/sft_dataset.h"
#include "data/token_source.h"
#include "distributed/communicator.h"
#include "distributed/parallel_layout.h"
#include "model/llama_model.h"
#include "optim/adamw_stream.h"
#include "recipe/recipe.h"
#include "tokenizer/bpe_tokenizer.h"
#include "distributed/fsdp.h"
#include "distributed/grad_sync.h"
#include "train/checkpoint.h"
#include "train/comm_groups.h"
#include "train/lr_schedule.h"
#include "train/memory_estimate.h"
#include "train/metrics.h"
#include "train/pipeline_schedule.h"
#include "train/tensorboard_log.h"
#include "train/train_config.h"
#include "train/update_gates.h"

namespace nb {

// A MoR statistic's mean relative error for a metrics.jsonl record, null when it saw no non-zero element (the tensor
// rule's records, trainer_mor.cpp, and the block rule's, trainer_mor_block.cpp).
nlohmann::json mor_error_json(const mor::ErrorStat& s);

struct TrainSummary {
  int64_t steps = 0, skipped = 0;
  int64_t start_iteration = 0, end_iteration = 0;  // resumed from / stopped at
  double first_loss = 0, final_loss = 0, final_val_loss = -1;
  double mean_step_ms = 0, tokens_per_s = 0, tflops = 0, mfu = 0, peak_mem_gib = 0;
  std::vector<double> stage_peak_mem_gib;  // under pipeline parallelism: each stage's peak (its first rank's)
  double optimizer_ms = 0;                 // mean AdamW update time on the compute stream after step 1
  int64_t saves = 0;
  double save_stall_ms_max = 0, save_write_s_max = 0, checkpoint_gib = 0;  // async save figures
  std::string device, stopped_by;  // stopped_by: "", "exit-interval" or "SIGTERM"
  std::vector<double> losses;      // per step run here
};

class Trainer {
 public:
  Trainer();
  ~Trainer();
  Status setup(TrainConfig cfg);
  // `nibble train --dry-run`: resolves the configuration and prints the memory estimate per rank for a
  // planned machine, with no GPU, no weights and no data read; *fits says whether the job fits.
  struct DryRun {
    int ranks = 1, ranks_per_node = 1;
    double gpu_bytes = 0;   // the card's memory (a CUDA context is taken off it)
    double host_bytes = 0;  // one machine's memory for page-locked state and checkpoint copies
  };
  Status dry_run(TrainConfig cfg, const DryRun& plan, bool* fits);
  Status train(TrainSummary* summary);  // load, loop (step, evaluate, save), final save

 private:
  Status train_loop(TrainSummary* summary);  // train() without the out-of-memory explanation
  // setup phases (trainer_setup.cpp)
  Status resolve_config();
  Status check_tokenizer();
  Status pick_device();
  void print_plan();
  // memory phases (trainer_memory.cpp)
  MemoryJob memory_job() const;  // the job as the estimate sees it (train/memory_estimate.h)
  Status estimate_memory();
  Status check_host_memory();  // --optimizer-cpu-offload: the host part fits this machine's memory
  std::string offload_fraction_advice() const;
  std::string does_not_fit_message(const MemoryJob& job, double free, double host, int gpus) const;
  Status explain_out_of_memory(const Status& st) const;
  void report_memory() const;
  Status allocate_and_load();  // setup after the estimate: the model, the reductions, a checkpoint, the data
  Status build_model();
  Status build_data();
  Status build_sft_data();
  // LoRA phases (trainer_lora.cpp)
  Status resolve_lora();
  Status open_lora_base();
  void print_lora_plan() const;
  double lora_flops_per_token() const;
  Status write_lora_adapter();
  bool lora() const { return cfg_.peft == "lora"; }
  // precision annealing phases (trainer_anneal.cpp)
  Status resolve_anneal();  // in resolve_config: the anneal recipe, the switch step S, the refusals
  void print_anneal_plan() const;
  recipe::Recipe param_plan_recipe() const;                    // the estimate's recipe for weights (compute copies)
  recipe::Recipe activation_plan_recipe() const;               // ... and for activations (covers both recipes)
  void plan_anneal();                                          // before model init: what the switch will need
  Status check_anneal_resume(const TrainConfig& saved) const;  // the anneal keys match the checkpoint's
  Status resume_anneal(const nlohmann::json& state);  // a checkpoint past S: the anneal recipe before its state
  Status anneal_if_due();                             // at a step boundary: the switch when iteration_ reaches S
  nlohmann::json anneal_state() const;                // for trainer_state.json
  bool anneal_configured() const { return anneal_step_ > 0; }
  // checkpoint phases (trainer_checkpoint.cpp)
  Status load();
  Status load_checkpoint(const CheckpointRef& ref);
  Status check_resume_compatible(const TrainConfig& saved, const LlamaConfig& saved_model) const;
  Status restore_state(const nlohmann::json& state);
  nlohmann::json trainer_state() const;
  Status prepare_saves();
  Status save(TrainSummary* summary);
  Status finish_saves(TrainSummary* summary);  // waits for the save in flight and reports it
  void note_written(const CheckpointWriteStats& ws, TrainSummary* summary);
  Status with_surviving_checkpoint(const Status& failed) const;
  // data-parallel phases (trainer_dist.cpp)
  Status detect_ranks();            // before resolve_config: rank, world size (= data-parallel size)
  Status apply_world();             // ... and what the world size sets (also --dry-run's planned ranks)
  Status connect_ranks();           // after pick_device: the rendezvous store and the communicator
  Status reduce_gradients();        // sum over ranks: all-reduce (DDP) or reduce-scatter into the shard
  Status gather_updated_weights();  // distributed optimizer: every rank's updated compute-copy shard
  Status gather_optimizer_state(optim::StateArray a, float* host);  // for a save: the whole of master, m or v
  Status prepare_grad_sync();  // after build_model: buckets, overlap hooks, the BF16 scratch
  Status prepare_fsdp();       // ... or Megatron-FSDP's gathers and reductions (with LoRA: the base's gathers)
  // The parts of the flat space this rank's optimizer updates: its slices (distributed optimizer) or all.
  std::vector<ParamStore::Slice> optimizer_slices();
  Status sum_over_ranks(double* values, int n);
  struct GradPiece {
    Tensor grad;
    // Whole on every tensor-parallel rank: the norms' weights, LoRA's A of a column-parallel base and B of a
    // row-parallel one (their gradients each rank's partial sum until reduce_replicated_grads).
    bool replicated;
  };
  std::vector<GradPiece> grad_pieces();                 // this rank's optimizer slices' gradients (trainer_dist.cpp)
  Status grad_squares(double* out);                     // this rank's part of the squared gradient norm
  Status reduce_over_tensor_parallel(double* figures);  // trainer_dist.cpp
  Status reduce_amax_over_ranks();  // FP8 delayed scaling: step amaxes -> MAX over ranks (trainer_amax.cpp)
  // The trained parameters' optimizer state is sharded (set by detect_ranks; LoRA's adapters never are).
  bool sharded() const { return model_.optimizer_shard_count > 1 && !lora(); }
  bool logging_rank() const { return world_.rank == 0; }
  // Saves and loads use the offloaded state's host arrays directly (unsharded offload).
  bool saves_from_state() const { return model_.params().optimizer_state().offloaded() && !sharded(); }
  // loop phases (trainer.cpp)
  Status step(StepMetrics* m);
  struct StepFigures {
    double loss = 0, grad_norm = 0;
    std::string nonfinite_where;  // the first quantizer that saw a non-finite input, or empty
    // Mixture of Representations: the shares of GEMM operands and of GEMMs that ran in FP8 (E4M3) this step, and on
    // the NVFP4 ladder in NVFP4 (-1: no MoR, or no ladder).
    double mor_fp8_operands = -1, mor_fp8_gemms = -1;
    double mor_nvfp4_operands = -1, mor_nvfp4_gemms = -1;
    double mor_fp8_blocks = -1, mor_e5m2_blocks = -1, mor_nvfp4_blocks = -1;
  };
  // Mixture of Representations (trainer_mor.cpp): the step's shares, and after the first step of each decision
  // interval the statistics summed over the data-parallel ranks, the next decisions, a metrics.jsonl record and a
  // clear board.
  Status mor_after_step(StepFigures* f);
  // Whether step `it` (0-based) is the first of its decision interval: the one step that measures and decides.
  bool mor_decision_step(int64_t it) const { return it % recipe_.mor.interval == 0; }
  nlohmann::json mor_state() const;                // for trainer_state.json (null without MoR)
  Status load_mor_state(const nlohmann::json& s);  // resume: the decisions and the interval's statistics so far
  Status run_micro_batches(double* loss_sum, double* wait_ms);
  Status reduce_step_figures(double loss_sum, StepFigures* f);
  Status apply_update(double lr, const StepFigures& f);
  Status adamw_update(double lr, double grad_norm);
  Status prepare_update();
  std::vector<optim::UpdateSegment> build_update_segments();
  Status evaluate(int64_t iteration, TrainSummary* summary);
  // samples while training (trainer_sample.cpp): the tokenizer and prompt checked at setup, and a greedy
  // continuation printed and recorded at every --sample-interval step (rank 0)
  Status setup_sampling();
  Status sample(int64_t iteration);
  void fill_summary(const StepMetrics& m, double mean_step_ms, double optimizer_ms, TrainSummary* summary) const;
  void report(const TrainSummary& s) const;

  TrainConfig cfg_;
  dist::World world_;
  std::unique_ptr<dist::TcpStore> store_;
  std::unique_ptr<dist::Communicator> comm_;
  // Context parallelism (trainer_cp.cpp): groups of C consecutive ranks share their rows; data parallelism
  // runs over world / C groups (data_rank() of data_ranks()), gradients and the optimizer over the whole world.
  dist::ParallelLayout layout_;
  int cp_size() const { return layout_.sizes.context; }
  int data_rank() const { return layout_.dp; }
  int data_ranks() const { return layout_.data; }
  // Tensor parallelism (trainer_tp.cpp): groups of T consecutive ranks split each layer; comm_ is then the
  // data x context ranks of this rank's tensor-parallel index (world_comm_ the whole world).
  int tp_size() const { return layout_.sizes.tensor; }
  int dp_cp_rank() const;  // this rank's place among the ranks comm_ joins
  bool state_rank() const { return layout_.dp == 0 && layout_.cp == 0; }  // gathers state for saves
  std::unique_ptr<dist::Communicator> world_comm_, tp_comm_, tp_cp_comm_;
  std::unique_ptr<CommReduceGroup> tp_group_;
  std::unique_ptr<recipe::AmaxGroup> tp_amax_, tp_cp_amax_;
  Status connect_tensor_parallel();  // connect_ranks' part: the groups' communicators and the model's views
  Status reduce_replicated_grads();  // the replicated pieces' gradients summed over the group (trainer_tp.cpp)
  // Checkpoints stay whole tensors: a save gathers the tensor-parallel ranks' arrays into whole ones on rank 0
  // (the ranks of its tensor-parallel group take part); a load keeps this rank's slices (ParamStore::slice_whole).
  Status gather_tensor_parallel(const float* local, float* whole);
  // The whole model's (or adapters') array on rank 0 from this rank's part: gather_tensor_parallel or gather_pipeline.
  Status gather_whole(const float* local, float* whole);  // (trainer_pp.cpp)
  std::vector<float> whole_[3];  // rank 0: whole master, m and v for the writer (tensor or pipeline parallelism)
  std::unique_ptr<dist::Communicator> cp_comm_;
  std::unique_ptr<ops::cp::RingLink> cp_link_;
  std::unique_ptr<recipe::AmaxGroup> cp_amax_;
  Status set_parallel_layout();       // apply_world's part: the groups' sizes and this rank's place
  Status connect_context_parallel();  // connect_ranks' part: the group's communicator and the model's ring
  // Pipeline parallelism (trainer_pp.cpp): this rank's stage of P (the outermost index), its chunks' layers, the
  // schedule in place of the micro-batch loop; comm_ is then this stage's data x context ranks, pp_comm_ the stages
  // of this rank's data x context x tensor index. Checkpoints stay whole: a save gathers the stages' arrays.
  int pp_size() const { return layout_.sizes.pipeline; }
  bool whole_differs() const { return tp_size() > 1 || pp_size() > 1; }  // checkpoints hold more than this rank
  int virtual_stages_ = 1;
  std::vector<pp::LayerRange> pp_stages_;  // every virtual stage's layers
  std::unique_ptr<dist::Communicator> pp_comm_;
  std::unique_ptr<PipelineSchedule> pp_schedule_;
  Status plan_pipeline();  // before the model's init: the split, this stage's chunks and slots
  LlamaModel::PipelineStage pipeline_stage(int r) const;  // stage r's chunks (of pp_stages_) and ends
  Status connect_pipeline();  // connect_ranks' part: the pipeline and data x context communicators
  Status start_pipeline();    // after the model's init: the schedule
  Status check_pipeline_job() const;
  void print_pipeline_plan() const;
  Status reduce_over_pipeline(double* values, int n);  // sums host scalars over the stages
  Status gather_stage_peaks(TrainSummary* summary);    // every stage's peak memory, for rank 0's summary
  Status gather_pipeline(const float* local, float* whole);
  // FP8 delayed scaling under pipeline parallelism (trainer_pp_scaling.cpp): every stage's Linears' scaling state in
  // the whole model's order, into pipeline_scaling_ (which trainer_state() saves), over pp_comm_.
  Status gather_pipeline_scaling();
  // Mixture of Representations under pipeline parallelism (trainer_pp_mor.cpp): each stage decides its own Linears
  // from the whole model's summed statistics; the log line, the records and checkpoints speak of the whole model.
  std::vector<size_t> mor_positions() const;  // each own MoR Linear's index among the whole model's
  size_t whole_mor_linears() const;
  Status mor_blocks_after_step(StepFigures* f);  // the block rule's counts and records (trainer_mor_block.cpp)
  Status refuse_mor_splits() const;              // what MoR does not run beside yet (trainer_setup.cpp)
  Status refuse_mor_blocks_cp() const;           // the block rule beside context parallelism (trainer_setup.cpp)
  Status refuse_mor_channel_stat() const;        // where --mor-channel-statistic cannot measure whole rows
  Status gather_mor_over_stages(std::vector<double>* values, size_t width);  // own -> whole model's, every stage
  // The whole model's decisions in effect: this model's own without stages; under pipeline parallelism the list every
  // stage decided (or resumed) last, each operand on the top rung before the first decision.
  std::vector<uint8_t> whole_mor_choices();
  std::vector<uint8_t> mor_in_effect_;
  std::vector<std::string> whole_mor_names() const;
  // This stage's entries of a list laid out by the whole model's MoR Linears, `width` per Linear.
  template <class T>
  std::vector<T> own_mor_slice(const std::vector<T>& whole, size_t width) const {
    if (pp_size() == 1) return whole;
    std::vector<T> out;
    for (size_t p : mor_positions())
      out.insert(out.end(), whole.begin() + int64_t(p * width), whole.begin() + int64_t((p + 1) * width));
    return out;
  }
  Status gather_pipeline_mor();  // the stages' decisions and statistics into pipeline_mor_ (a save)
  nlohmann::json pipeline_mor_;
  std::vector<LlamaModel::LinearScaling> pipeline_scaling_;
  std::unique_ptr<GradSync> sync_;      // with a communicator: bucketed reductions and gathers
  Status choose_param_gather();         // trainer_dist.cpp: training-format or BF16 weight gathers
  bool training_format_gather() const;  // trainer_setup.cpp
  std::unique_ptr<FsdpSync> fsdp_;      // instead, with Megatron-FSDP's optim_grads or optim_grads_params
  void settle_collectives();            // the default stream waits for gathers and reductions in flight
  double fsdp_step_gathered_ = 0, fsdp_step_reduced_ = 0;
  double tp_step_gathered_ = 0,
         tp_step_reduced_ =
             0;  // the last step's tensor-parallel traffic, per rank  // the last step's FSDP traffic, bytes per rank
  bool stop_requested_ = false;  // SIGTERM reached some rank (agreed by all ranks at the end of a step)
  LlamaConfig model_cfg_;
  recipe::Recipe recipe_;
  std::string recipe_as_run_;      // the summary's name for what ran (print_plan: a recipe may quantize nothing)
  recipe::Recipe anneal_recipe_;   // precision annealing: the recipe after the switch (bf16_mixed when off)
  int64_t anneal_step_ = 0;        // S: steps 1..S run recipe_, steps S+1.. anneal_recipe_ (0 = no annealing)
  bool annealed_ = false;          // the model runs anneal_recipe_ now
  bool anneal_announced_ = false;  // the switch was logged (here, or by the run that wrote the checkpoint)
  Recompute recompute_ = Recompute::none;
  Device dev_ = Device::cpu;
  std::string device_name_;
  int cc_major_ = 0, cc_minor_ = 0;
  int64_t accum_ = 1, tokens_per_step_ = 0;
  double flops_per_token_ = 0, peak_tflops_ = 0;
  MemoryEstimate estimate_;      // before step 1, per rank (train/memory_estimate.h); the largest pipeline stage's
  MemoryEstimate own_estimate_;  // this rank's own stage's (estimate_ without pipeline parallelism): the end-of-run
                                 // check and an out-of-memory's parts compare it with this rank's allocations
  bool dry_run_ = false;         // --dry-run: nothing is written, no GPU touched
  size_t free_bytes_ = 0, total_bytes_ = 0, base_used_ = 0;
  LlamaModel model_;
  LoraSpec lora_spec_;
  std::unique_ptr<HfCheckpointReader> lora_base_;  // LoRA: the frozen base's weights (read during setup)
  bool lora_base_from_checkpoint_ = false;         // ... from --load's full-model checkpoint
  std::unique_ptr<TokenSource> train_src_, valid_src_;
  LrSchedule sched_;
  Buffer norm_sq_;
  optim::AdamWStreamer streamer_;                      // the update over master, m and v, wherever they live
  std::vector<optim::UpdateSegment> update_segments_;  // built at the first update
  std::unique_ptr<UpdateGates> gates_;                 // the next forward's waits on a gated (streamed) update
  bool grads_zeroed_ = false;                          // the last update zeroed the gradients on its own queue
  TimedSpan optimizer_span_;                           // the update's time on its queue (metrics: optimizer_ms)
  double optimizer_ms_ = 0;                            // the last update's time read back
  TrainSummary* summary_ = nullptr;                    // train()'s, for saves finished before an update
  Buffer amax_scratch_;  // reduce_amax_over_ranks: the step amaxes, gathered into one buffer
  std::vector<int32_t> step_tokens_, step_labels_;
  std::vector<std::vector<int32_t>> step_segments_;  // packed rows (SFT): each micro-batch's segment starts
  double step_trained_ = 0;   // trained tokens (labels >= 0) of this step over all ranks: the loss's divisor
  SftPacking train_packing_;  // SFT: the training split's packing, for the efficiency report
  std::ofstream jsonl_;
  std::unique_ptr<BpeTokenizer> sample_tok_;  // --sample-interval: the tokenizer and the encoded prompt
  std::vector<int32_t> sample_ids_;
  std::unique_ptr<TensorBoardLog> tb_;  // --tensorboard-dir, rank 0 only
  // Training state that a checkpoint carries (besides weights and AdamW moments).
  int64_t iteration_ = 0;       // completed optimizer steps
  int64_t consumed_valid_ = 0;  // validation samples read so far
  int64_t adam_step_ = 0;       // AdamW's bias-correction step count (reset by --no-load-optim)
  int64_t rng_step_ = 0;        // stochastic-rounding key counter (reset by --no-load-rng)
  int64_t skipped_ = 0, nan_iters_ = 0;
  double peak_mem_ = 0;
  // Checkpoint saving: host copies of master, m, v (page-locked on CUDA) and the writer thread.
  struct HostCopies {
    float* master = nullptr;
    float* m = nullptr;
    float* v = nullptr;
    bool pinned = false;  // page-locked (CUDA) or plain malloc (CPU backend)
    ~HostCopies();
    Status allocate(int64_t n, bool page_locked);
  };
  std::unique_ptr<HostCopies> host_;
  std::unique_ptr<AsyncCheckpointWriter> writer_;
  int64_t pending_save_ = -1;  // the iteration of the save in flight
};

// Runs the whole job. Every failure comes back as one sentence; nothing already saved is touched.
Status run_training(TrainConfig cfg, TrainSummary* summary);

}  // namespace nb
