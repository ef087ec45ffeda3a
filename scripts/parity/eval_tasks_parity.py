#!/usr/bin/env python3
"""`nibble eval --tasks / --text` against transformers with lm-evaluation-harness's semantics (GPU machine or any
host with torch, transformers and safetensors; not run in CI).

    python3 scripts/parity/eval_tasks_parity.py NIBBLE_BINARY WORK_DIR [--skip-cuda]
    (NIBBLE_BINARY may be left out when $NIBBLE_BIN names the binary)

1. A tokenizer: `nibble tokenizer train` (Llama 3 regex) on a generated corpus, plus <|begin_of_text|> which a
   TemplateProcessing post-processor prepends (as Llama 3's tokenizer.json does); loaded by transformers'
   PreTrainedTokenizerFast and written with save_pretrained into each model folder.
2. Two random LlamaForCausalLM (GQA 8/2 heads, Llama 3.1 RoPE scaling with all three bands in use, weights scaled
   for O(1) activations, saved in BF16 with save_pretrained): untied and tied embeddings.
3. Two multiple-choice JSONL tasks (short contexts; long ones that the maximum length 64 truncates from the left,
   a context with a trailing space, an empty context, non-ASCII choices) and a text of several windows.
4. The reference is written here from the harness's rules (lm_eval/api/model.py _encode_pair and loglikelihood,
   models/huggingface.py _loglikelihood_tokens, utils.get_rolling_token_windows): the transformers tokenizer's
   encode with its default special tokens, whitespace moved from context to continuation, continuation_enc =
   whole[len(context_enc):], input (context_enc + continuation_enc)[-(L+1):][:-1], log-likelihood = sum of
   log-softmax (FP64 over transformers' FP32 logits, TF32 off, eager attention) over the continuation.
   Perplexity: rolling windows of L tokens of the text's tokens without BOS, the first after the BOS.
5. `nibble eval --log-samples` on the CPU (FP32) and on CUDA (bf16_mixed) is compared request by request.

Bounds (as scripts/hf_parity.py derives them; n = 10 * layers + 2 chained stages, K = max(hidden, ffn, seq),
u = 2^-24, u_bf = 2^-8):
  * CPU: per token the logits agree within c = 2 n K u max(1, max|logit|) and log-softmax is 2-Lipschitz in the
    max norm, so a continuation of k tokens within k * 2c, and the text's mean NLL within 2c.
  * CUDA: hf_parity's BF16 loss bound per token, 2 * r * rms(logits) with r = 3 u_bf / sqrt(3) * sqrt(n): a
    continuation of k tokens within k * 2 r rms, the mean NLL within 2 r rms.
  * Tokenization must be identical: every request's input and continuation token counts equal the reference's.
  * acc / acc_norm / acc_bytes: nibble's prediction may differ from the reference's only where the two choices'
    reference scores are closer than their bounds (a near-tie); on the CPU none is expected.
Every check prints one line, PASS or FAIL; the exit code is 1 when any fails.
"""
import json
import math
import os
import random
import shutil
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import hf_parity  # noqa: E402  (build_model, save_bf16, load_pretrained, U32, UBF)

MAX_LENGTH = 64
BOS = "<|begin_of_text|>"
EOS = "<|endoftext|>"
WORDS = ("the a of to and in is was for on that with as by at from it an be this are have which one all their "
         "were when there has more other what time some about would could into after first only new two years "
         "river mountain city music energy garden window letter question answer market winter science history "
         "café naïve résumé Zürich über 日本 東京 数据 größer señor").split()


def model_config(tied):
    cfg = hf_parity.check_config()
    cfg["tie_word_embeddings"] = tied
    return cfg


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_tokenizer(nibble, work):
    """nibble-trained byte-level BPE + a BOS its post-processor prepends, saved as tokenizer.json."""
    rng = random.Random(5)
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(3000):
            f.write(sentence(rng, rng.randint(4, 16)).capitalize() + ".\n")
    raw = os.path.join(work, "tok_raw.json")
    run([nibble, "tokenizer", "train", "-i", corpus, "--vocab-size", "900", "--pattern", "llama3", "-o", raw])
    with open(raw, encoding="utf-8") as f:
        j = json.load(f)
    bos_id = max([t["id"] for t in j["added_tokens"]] + list(j["model"]["vocab"].values())) + 1
    j["added_tokens"].append({"id": bos_id, "content": BOS, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True})
    j["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}}}
    path = os.path.join(work, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)
    return path


def save_tokenizer(tok_file, model_dir):
    try:
        from transformers import PreTrainedTokenizerFast as Fast
    except ImportError:  # transformers 5.x may name the tokenizers-backed class only TokenizersBackend
        from transformers import TokenizersBackend as Fast
    tok = Fast(tokenizer_file=tok_file, bos_token=BOS, eos_token=EOS)
    tok.save_pretrained(model_dir)


def make_tasks(work):
    rng = random.Random(11)
    paths = {}
    for name, lo, hi in (("mc_short", 3, 10), ("mc_long", 40, 90)):
        docs = []
        for i in range(12):
            ctx = sentence(rng, rng.randint(lo, hi)).capitalize() + "?"
            if i == 3:
                ctx += " "  # the harness moves it into the continuation
            if name == "mc_short" and i == 5:
                ctx = ""  # conditioned on the BOS
            choices = [sentence(rng, rng.randint(1, 4)) for _ in range(rng.randint(2, 5))]
            docs.append({"context": ctx, "choices": choices, "label": rng.randrange(len(choices))})
        paths[name] = os.path.join(work, name + ".jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
    text = os.path.join(work, "text.txt")
    with open(text, "w", encoding="utf-8") as f:
        f.write(" ".join(sentence(rng, rng.randint(5, 15)).capitalize() + "." for _ in range(30)) + "\n")
    return paths, text


class Reference:
    """The harness's requests and transformers' log-likelihoods for one model folder."""

    def __init__(self, model_dir, device):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = hf_parity.load_pretrained(model_dir, torch.float32).to(device).eval()
        self.device = device
        self.prefix = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id
        self.max_abs = 0.0
        self.sum_sq, self.count = 0.0, 0

    def tok_encode(self, s, add_special=None):
        if add_special is None:  # HFLM.tok_encode: no special tokens when the text starts with the BOS text
            if s.startswith(self.tok.decode([self.prefix])):
                return self.tok.encode(s, add_special_tokens=False)
            return self.tok.encode(s)
        return self.tok.encode(s, add_special_tokens=add_special)

    def request(self, context, continuation):
        if context == "":
            cont = self.tok_encode(continuation, False)
            ctx, cont = ([self.prefix], cont) if self.prefix != cont[0] else (cont[:1], cont[1:])
        else:
            n = len(context) - len(context.rstrip())
            if n > 0:
                continuation = context[-n:] + continuation
                context = context[:-n]
            whole = self.tok_encode(context + continuation)
            ctx = self.tok_encode(context)
            cont = whole[len(ctx):]
        inp = (ctx + cont)[-(MAX_LENGTH + 1):][:-1]
        return inp, cont

    def loglik(self, inp, targets):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([inp], device=self.device)).logits[0].float()
        self.max_abs = max(self.max_abs, float(logits.abs().max()))
        self.sum_sq += float(logits.double().pow(2).sum())
        self.count += logits.numel()
        lp = torch.log_softmax(logits[-len(targets):].double(), dim=-1)
        rows = torch.arange(len(targets), device=self.device)
        return float(lp[rows, torch.tensor(targets, device=self.device)].sum())

    def rms(self):
        return math.sqrt(self.sum_sq / max(1, self.count))

    def rolling_nll(self, text):
        """(summed NLL, tokens): windows of MAX_LENGTH predictions, the first after the prefix token."""
        toks = self.tok.encode(text, add_special_tokens=False)
        nll, done, L = 0.0, 0, MAX_LENGTH
        first = min(L, len(toks))
        nll -= self.loglik([self.prefix] + toks[:first - 1], toks[:first])
        done = first
        while done < len(toks):
            k = min(len(toks) - done, L)
            end = done + k
            nll -= self.loglik(toks[end - L - 1:end - 1], toks[end - k:end])
            done = end
        return nll, len(toks)


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"command failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    return r.stdout


def predictions(lls, choices):
    """acc, acc_norm (code points) and acc_bytes predictions: numpy's argmax, the first of equals."""
    def arg(scores):
        return max(range(len(scores)), key=lambda i: (scores[i], -i))
    return (arg(lls), arg([l / len(c) for l, c in zip(lls, choices)]),
            arg([l / len(c.encode("utf-8")) for l, c in zip(lls, choices)]))


class Checks:
    def __init__(self):
        self.failed = 0

    def report(self, name, ok, text):
        print(f"{'PASS' if ok else 'FAIL'} {name}: {text}")
        self.failed += 0 if ok else 1


def reference_tasks(ref, task_paths):
    """Per task: its documents and, per document and choice, (input length, continuation length, loglik)."""
    out = {}
    for name, path in task_paths.items():
        with open(path, encoding="utf-8") as f:
            docs = [json.loads(line) for line in f if line.strip()]
        rows = []
        for d in docs:
            per = []
            for c in d["choices"]:
                inp, cont = ref.request(d["context"], " " + c)
                per.append((len(inp), len(cont), ref.loglik(inp, cont)))
            rows.append(per)
        out[name] = (docs, rows)
    return out


def compare(checks, label, got, refs, text_ref, per_token):
    """nibble's JSON `got` against the reference; per_token is the bound of one token's log-likelihood."""
    for name, (docs, rows) in refs.items():
        samples = got["tasks"][name]["samples"]
        tok_ok, worst, worst_ratio, flips, bad_flips = True, 0.0, 0.0, 0, 0
        for d, per, s in zip(docs, rows, samples):
            bounds = [k * per_token for _, k, _ in per]
            tok_ok &= [p[0] for p in per] == s["input_tokens"] and [p[1] for p in per] == s["continuation_tokens"]
            for (_, _, ll), g, b in zip(per, s["loglikelihoods"], bounds):
                worst = max(worst, abs(g - ll))
                worst_ratio = max(worst_ratio, abs(g - ll) / b)
            ref_lls = [p[2] for p in per]
            norms = (lambda c: 1.0, len, lambda c: len(c.encode("utf-8")))
            for which, (want, norm) in enumerate(zip(predictions(ref_lls, d["choices"]), norms)):
                have = (s["pred"], s["pred_norm"], s["pred_bytes"])[which]
                if have != want:
                    flips += 1
                    gap = abs(ref_lls[have] / norm(d["choices"][have]) - ref_lls[want] / norm(d["choices"][want]))
                    slack = bounds[have] / norm(d["choices"][have]) + bounds[want] / norm(d["choices"][want])
                    bad_flips += 0 if gap <= slack else 1
        checks.report(f"{label} {name} tokenization", tok_ok, "input and continuation token counts equal the harness's")
        checks.report(f"{label} {name} log-likelihoods", worst_ratio <= 1.0,
                      f"max |diff| {worst:.3g}, max diff/bound {worst_ratio:.3g} (bound k x {per_token:.3g})")
        checks.report(f"{label} {name} predictions", bad_flips == 0,
                      f"{flips} of {3 * len(docs)} acc/acc_norm/acc_bytes predictions differ, {bad_flips} outside a "
                      f"near-tie; acc {got['tasks'][name]['acc']:.4f}, acc_norm {got['tasks'][name]['acc_norm']:.4f}")
    nll, tokens = text_ref
    t = got["text"]
    d = abs(t["nll"] / t["tokens"] - nll / tokens) if t["tokens"] == tokens else float("inf")
    checks.report(f"{label} text perplexity", d <= 2 * per_token,
                  f"tokens {t['tokens']} vs {tokens}, mean NLL {t['nll'] / max(1, t['tokens']):.6f} vs "
                  f"{nll / tokens:.6f} diff {d:.3g} (bound {2 * per_token:.3g}), token ppl {t['token_perplexity']:.4f}")


def adds_bos_flag(model_dir, ref):
    """[] when nibble's reading of tokenizer.json (a TemplateProcessing post-processor that starts with the BOS)
    agrees with what transformers does, else the explicit --add-bos of transformers' behaviour."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        post = json.load(f).get("post_processor") or {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    in_json = any(p.get("type") == "TemplateProcessing" and p.get("single", [{}])[0].get("SpecialToken", {}).get("id")
                  == BOS for p in procs)
    hf = ref.tok.encode("the")[0] == ref.tok.bos_token_id
    print(f"tokenizer: the saved tokenizer.json {'adds' if in_json else 'does not add'} the BOS, transformers "
          f"{'adds' if hf else 'does not add'} it")
    if in_json == hf:
        return []
    print(f"NOTE: tokenizer.json {'adds' if in_json else 'does not add'} the BOS but transformers "
          f"{'does' if hf else 'does not'}; nibble is given --add-bos {str(hf).lower()}")
    return ["--add-bos", str(hf).lower()]


def main(argv):
    args = [a for a in argv[1:] if a != "--skip-cuda"]
    skip_cuda = "--skip-cuda" in argv
    if len(args) == 1 and os.environ.get("NIBBLE_BIN"):
        args = [os.environ["NIBBLE_BIN"]] + args
    if len(args) != 2:
        print(__doc__.split("\n\n")[1])
        return 2
    nibble, work = os.path.abspath(args[0]), os.path.abspath(args[1])
    os.makedirs(work, exist_ok=True)
    tok_file = make_tokenizer(nibble, work)
    task_paths, text_path = make_tasks(work)
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    ref_device = "cuda" if torch.cuda.is_available() else "cpu"
    checks = Checks()
    for tied in (False, True):
        cfg = model_config(tied)
        label = "tied" if tied else "untied"
        model_dir = os.path.join(work, label)
        shutil.rmtree(model_dir, ignore_errors=True)
        hf_parity.save_bf16(hf_parity.build_model(cfg, seed=21 if tied else 20), model_dir)
        save_tokenizer(tok_file, model_dir)
        ref = Reference(model_dir, ref_device)
        refs = reference_tasks(ref, task_paths)
        text_ref = ref.rolling_nll(text)
        n = 10 * cfg["num_hidden_layers"] + 2
        k = max(cfg["hidden_size"], cfg["intermediate_size"], MAX_LENGTH)
        cpu_token = 2 * (2 * n * k * hf_parity.U32 * max(1.0, ref.max_abs))
        cuda_token = 2 * (3 * hf_parity.UBF / math.sqrt(3) * math.sqrt(n)) * ref.rms()
        print(f"{label}: transformers FP32 on {ref_device}, max|logit| {ref.max_abs:.3f}, rms {ref.rms():.3f}; "
              f"per-token bounds cpu {cpu_token:.3g}, cuda {cuda_token:.3g}")
        extra = adds_bos_flag(model_dir, ref)
        for dev, per_token in (("cpu", cpu_token), ("cuda", cuda_token)):
            if dev == "cuda" and skip_cuda:
                print(f"SKIP {label} nibble cuda (bf16_mixed): --skip-cuda")
                continue
            out = os.path.join(work, f"{label}_{dev}.json")
            stdout = run([nibble, "eval", "--load-hf", model_dir, "--tasks", *task_paths.values(), "--text",
                          text_path, "--max-length", str(MAX_LENGTH), "--out", out, "--log-samples", "--device", dev,
                          *extra])
            print(stdout.rstrip())
            with open(out, encoding="utf-8") as f:
                compare(checks, f"{label} nibble {dev}", json.load(f), refs, text_ref, per_token)
    print(f"{checks.failed} check(s) failed" if checks.failed else "all checks passed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
