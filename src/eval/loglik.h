// Log-likelihood requests run through a LlamaModel in micro-batches. A request is the model's input
// (at most the micro-batch's sequence length) and the tokens its last positions must predict: position
// j of `input` predicts the next token, so the last targets.size() positions are scored against
// `targets` (a multiple-choice continuation, or a rolling window's predicted tokens). Rows shorter than
// the micro-batch are padded on the right with labels < 0, which the model ignores; causal attention
// keeps the padding from reaching the real positions.
#pragma once
#include <cstdint>
#include <vector>
#include "model/llama_model.h"

namespace nb::eval {

struct LoglikRequest {
  std::vector<int32_t> input;    // 1 <= size <= the micro-batch's sequence length
  std::vector<int32_t> targets;  // 1 <= size <= input.size()
};

struct LoglikResult {
  double loglik = 0;    // sum over the targets of log-softmax(logits)[target]
  bool greedy = false;  // every target is the argmax of its position's logits
};

// A model initialized for micro-batches of `shape` (its weights loaded).
struct EvalModel {
  LlamaModel* model = nullptr;
  MicroBatchShape shape;
};

// The requests' log-likelihoods from the model's FP32 host logits (log-softmax in FP64), shape.batch
// requests per forward.
Status score_requests(EvalModel& m, const std::vector<LoglikRequest>& reqs, std::vector<LoglikResult>* out);
// The summed negative log-likelihood of all the requests' targets and their count, from the model's own
// per-token loss (no logits leave the device): what the trainer's validation loss sums.
Status sum_nll(EvalModel& m, const std::vector<LoglikRequest>& reqs, double* nll, int64_t* tokens);
// Checks every token of the requests is inside the model's vocabulary (one sentence naming `what`).
Status check_request_tokens(const std::vector<LoglikRequest>& reqs, int64_t vocab, const char* what);
// The longest input of the requests.
int64_t longest_input(const std::vector<LoglikRequest>& reqs);

}  // namespace nb::eval
