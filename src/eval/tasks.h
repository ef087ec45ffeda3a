// Multiple-choice tasks scored by log-likelihood with lm-evaluation-harness's semantics (docs/EVAL.md).
//
// A task is a JSONL file, one document per line: {"context": str, "choices": [str, ...], "label": int}.
// Choices carry no leading space: the continuation scored is target_delimiter + choice (the harness's
// default delimiter " "), exactly as the harness builds (context, continuation) requests from a task's
// doc_to_text / doc_to_choice. Each request is encoded as the harness's causal _encode_pair: trailing
// whitespace of the context moves to the continuation, then context_enc = encode(context) and
// continuation_enc = encode(context + continuation)[len(context_enc):]; the model input is
// (context_enc + continuation_enc)[-(max_length + 1):][:-1] and the log-likelihood is the sum of the
// continuation tokens' log-softmax. acc = argmax of the log-likelihoods, acc_norm = argmax of
// loglik / len(choice) in code points (the harness's acc_norm), acc_bytes = of loglik / len(choice) in
// UTF-8 bytes (the harness's acc_bytes); ties go to the first choice (numpy's argmax).
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "eval/loglik.h"
#include "tokenizer/bpe_tokenizer.h"

namespace nb::eval {

struct McDoc {
  std::string context;
  std::vector<std::string> choices;
  int64_t label = 0;
  int64_t line = 0;  // 1-based line in the file
};

struct McTask {
  std::string name;  // the file's stem
  std::string path;
  std::vector<McDoc> docs;
};

// Reads a task file; any bad line is one sentence with the file and line number.
Status read_mc_task(const std::string& path, McTask* out);
// The same from text already in memory (`where` names it in messages).
Status parse_mc_task(const std::string& text, const std::string& where, McTask* out);

// How text becomes tokens, as the harness's HFLM.tok_encode with its default add_bos_token (None):
// the tokenizer's own convention adds the BOS unless the text already starts with the BOS token's text;
// special-token strings in the text are matched as HF tokenizers match added tokens.
struct TaskEncoder {
  const BpeTokenizer* tok = nullptr;
  bool add_bos = false;  // prepend the BOS when the text does not start with it
  std::string target_delimiter = " ";
  int64_t max_length = 2048;  // the harness's max_length: inputs are truncated from the left to it
  // BOS, or the end-of-text token when there is none (the harness's prefix_token_id), -1 if neither.
  int32_t prefix_token() const;
  std::vector<int32_t> encode(const std::string& text, bool special) const;
  // The harness's (context_enc, continuation_enc) of one request, with its empty-context rule.
  Status encode_pair(const std::string& context, const std::string& continuation, std::vector<int32_t>* ctx,
                     std::vector<int32_t>* cont) const;
};

// One request per (document, choice), in document order; *first[i] is document i's first request.
Status build_mc_requests(const McTask& task, const TaskEncoder& enc, std::vector<LoglikRequest>* reqs,
                         std::vector<size_t>* first);

struct McMetrics {
  int64_t n = 0;
  double acc = 0, acc_stderr = 0, acc_norm = 0, acc_norm_stderr = 0, acc_bytes = 0, acc_bytes_stderr = 0;
};
// Each document's predictions from its choices' log-likelihoods (lls[first[i] + c]).
struct McPrediction {
  int64_t pred = 0, pred_norm = 0, pred_bytes = 0;
};
McPrediction predict(const McDoc& doc, const double* lls);
// The harness's mean and mean_stderr (sample standard deviation / sqrt(n) = sqrt(p(1-p)/(n-1)) for 0/1
// scores; NaN for n < 2).
McMetrics mc_metrics(const McTask& task, const std::vector<double>& lls, const std::vector<size_t>& first);

}  // namespace nb::eval
