// Micro-batching of log-likelihood requests (see loglik.h).
#include "eval/loglik.h"
#include <algorithm>
#include <cmath>

namespace nb::eval {
namespace {

// Rows [first, first + shape.batch) of `reqs` as one micro-batch: tokens (padding 0) and labels
// (< 0 except at the scored positions).
Status fill_batch(const std::vector<LoglikRequest>& reqs, size_t first, MicroBatchShape shape,
                  std::vector<int32_t>* tokens, std::vector<int32_t>* labels) {
  tokens->assign(size_t(shape.tokens()), 0);
  labels->assign(size_t(shape.tokens()), -1);
  for (int64_t b = 0; b < shape.batch && first + size_t(b) < reqs.size(); ++b) {
    const LoglikRequest& r = reqs[first + size_t(b)];
    const int64_t n = int64_t(r.input.size()), k = int64_t(r.targets.size());
    if (n < 1 || n > shape.seq || k < 1 || k > n)
      return errorf("internal: request %zu has %lld input and %lld target tokens for a sequence of %lld",
                    first + size_t(b), (long long)n, (long long)k, (long long)shape.seq);
    std::copy(r.input.begin(), r.input.end(), tokens->begin() + b * shape.seq);
    std::copy(r.targets.begin(), r.targets.end(), labels->begin() + b * shape.seq + (n - k));
  }
  return Status::ok();
}

// log-softmax of `row` at `target` in FP64, and whether `target` is the row's (first) argmax.
double log_softmax_at(const float* row, int64_t vocab, int32_t target, bool* argmax) {
  int64_t best = 0;
  for (int64_t v = 1; v < vocab; ++v)
    if (row[v] > row[best]) best = v;
  const double m = row[best];
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(row[v]) - m);
  *argmax = best == target;
  return double(row[target]) - m - std::log(sum);
}

}  // namespace

Status score_requests(EvalModel& m, const std::vector<LoglikRequest>& reqs, std::vector<LoglikResult>* out) {
  const int64_t V = m.model->config().vocab, S = m.shape.seq;
  out->assign(reqs.size(), LoglikResult{});
  std::vector<int32_t> tokens, labels;
  std::vector<float> logits(size_t(m.shape.tokens() * V));
  for (size_t first = 0; first < reqs.size(); first += size_t(m.shape.batch)) {
    NB_TRY(fill_batch(reqs, first, m.shape, &tokens, &labels));
    double loss_sum = 0;
    NB_TRY(m.model->forward_logits(tokens.data(), labels.data(), logits.data(), &loss_sum));
    for (int64_t b = 0; b < m.shape.batch && first + size_t(b) < reqs.size(); ++b) {
      const LoglikRequest& r = reqs[first + size_t(b)];
      LoglikResult& res = (*out)[first + size_t(b)];
      const int64_t n = int64_t(r.input.size()), k = int64_t(r.targets.size());
      res.greedy = true;
      for (int64_t i = 0; i < k; ++i) {
        bool top = false;
        const float* row = logits.data() + (b * S + n - k + i) * V;
        res.loglik += log_softmax_at(row, V, r.targets[size_t(i)], &top);
        res.greedy = res.greedy && top;
      }
    }
  }
  return Status::ok();
}

Status sum_nll(EvalModel& m, const std::vector<LoglikRequest>& reqs, double* nll, int64_t* tokens) {
  *nll = 0;
  *tokens = 0;
  std::vector<int32_t> ids, labels;
  for (size_t first = 0; first < reqs.size(); first += size_t(m.shape.batch)) {
    NB_TRY(fill_batch(reqs, first, m.shape, &ids, &labels));
    NB_TRY(m.model->forward_loss(ids.data(), labels.data(), nll));
    for (int32_t l : labels) *tokens += l >= 0 ? 1 : 0;
  }
  return Status::ok();
}

Status check_request_tokens(const std::vector<LoglikRequest>& reqs, int64_t vocab, const char* what) {
  for (const LoglikRequest& r : reqs)
    for (const auto* v : {&r.input, &r.targets})
      for (int32_t t : *v)
        if (t < 0 || t >= vocab)
          return errorf("%s: token %d is outside the model's vocabulary of %lld (is the tokenizer the model's?)", what,
                        t, (long long)vocab);
  return Status::ok();
}

int64_t longest_input(const std::vector<LoglikRequest>& reqs) {
  size_t n = 0;
  for (const LoglikRequest& r : reqs) n = std::max(n, r.input.size());
  return int64_t(n);
}

}  // namespace nb::eval
