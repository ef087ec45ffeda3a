#!/usr/bin/env python3
"""Builds a "continue this passage" instruction set from the project's English corpus.

  python3 scripts/sft_pairs.py -i ~/.cache/nibble/corpus.jsonl -o runs/sft/pairs.jsonl \
      [--prompt-words 128] [--answer-words 64] [--max-pairs 12000] [--max-per-doc 32] [--seed 1234]

Input: JSONL lines {"text": ...} (scripts/setup_data.sh writes the corpus). Output: one NeMo sample per line,
{"input": "Continue this passage:\\n\\n<first part>", "output": "<the following part>"}, for
`nibble preprocess --sft`. Standard library only; the output depends only on the input and the flags.

Passages. Each document is cut into paragraphs at blank lines; consecutive paragraphs are gathered into a
passage until it holds at least prompt-words + answer-words words (a document's shorter tail is dropped),
and the next passage starts at the next paragraph. The prompt is the passage's first --prompt-words words;
the answer is the next --answer-words words, ended after its last sentence end (. ! or ? then whitespace or
its end) when that lies in the answer's second half (by characters). Whitespace inside both parts is kept.

Duplicates. A document whose text equals an earlier one's is skipped (the corpus that setup_data.sh wrote
holds every file twice, reached through /usr/share/doc/linux-doc and its target linux-doc-6.1), and so is
a passage whose text equals an earlier passage's, so no pair can sit in both the training and the
validation split.

Skipped passages (the rule, counted in the summary):
  code/table: more than 20% of its non-blank lines are code, table or markup lines, i.e. lines where
              fewer than 70% of the non-space characters are letters, or that end in ; { or }, or start
              with ".. " (reStructuredText directives), or hold a run of 3+ spaces or a tab between
              two words (aligned columns);
  not English: more than 1% of its characters are not ASCII, or fewer than 15% of its words are common
              English function words (the corpus holds translations of the kernel documentation).

Order. Documents are taken in a --seed shuffled order, at most --max-per-doc passages each (a seeded
choice, kept in document order), until --max-pairs. Pairs of one document stay together, so a contiguous
split such as nibble's --split 95,5,0 gives validation samples from documents the training split never
sees (but for the one document at the boundary).
"""
import argparse
import hashlib
import json
import random
import re
import sys

FUNCTION_WORDS = frozenset(
    "the a an of to and is in for that this it be are was with on as by or not can if when from at "
    "which will all there have has its".split())
INSTRUCTION = "Continue this passage:\n\n"
SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def is_code_line(line):
    s = line.strip()
    chars = [c for c in s if not c.isspace()]
    letters = sum(c.isalpha() for c in chars)
    return (letters < 0.7 * len(chars) or s.endswith((";", "{", "}")) or s.startswith(".. ")
            or re.search(r"\S( {3,}|\t)\S", s) is not None)


def skip_reason(text):
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if sum(map(is_code_line, lines)) > 0.2 * len(lines):
        return "code/table"
    words = text.split()
    if (sum(ord(c) > 127 for c in text) > 0.01 * len(text)
            or sum(w.lower().strip(".,;:()\"'") in FUNCTION_WORDS for w in words) < 0.15 * len(words)):
        return "not English"
    return None


def passages(text, min_words):
    """Runs of whole paragraphs of at least min_words words; a shorter tail is dropped."""
    run, words = [], 0
    for para in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        if not para.strip():
            continue
        run.append(para.rstrip())
        words += len(para.split())
        if words >= min_words:
            yield "\n\n".join(run).strip("\n")
            run, words = [], 0


def make_pair(passage, prompt_words, answer_words):
    spans = [m.span() for m in re.finditer(r"\S+", passage)]
    prompt = passage[:spans[prompt_words - 1][1]]
    start, end = spans[prompt_words][0], spans[prompt_words + answer_words - 1][1]
    answer = passage[start:end]
    cuts = [m.end() for m in SENTENCE_END.finditer(answer) if m.end() >= len(answer) // 2]
    if cuts:
        answer = answer[:cuts[-1]]
    return {"input": INSTRUCTION + prompt.strip(), "output": answer.strip()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-i", "--input", required=True, help="corpus JSONL, one {\"text\": ...} per line")
    ap.add_argument("-o", "--output", required=True, help="output JSONL of {\"input\", \"output\"} pairs")
    ap.add_argument("--prompt-words", type=int, default=128, help="words of passage in the prompt")
    ap.add_argument("--answer-words", type=int, default=64, help="most words in the answer")
    ap.add_argument("--max-pairs", type=int, default=12000, help="stop after this many pairs")
    ap.add_argument("--max-per-doc", type=int, default=32, help="most pairs taken from one document")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the document order and per-document choice")
    a = ap.parse_args()
    if min(a.prompt_words, a.answer_words, a.max_pairs, a.max_per_doc) <= 0:
        sys.exit("sft_pairs.py: --prompt-words, --answer-words, --max-pairs and --max-per-doc must be positive")

    with open(a.input, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    rng = random.Random(a.seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    counts = dict.fromkeys(["duplicate documents", "documents used", "passages", "duplicate", "code/table",
                            "not English", "over --max-per-doc"], 0)
    seen = set()  # hashes of the documents and passages taken so far
    pairs, answer_total = 0, 0
    with open(a.output, "w", encoding="utf-8") as out:
        for d in order:
            if pairs >= a.max_pairs:
                break
            key = hashlib.sha1(b"doc:" + docs[d].encode("utf-8")).digest()
            if key in seen:
                counts["duplicate documents"] += 1
                continue
            seen.add(key)
            kept = []
            for p in passages(docs[d], a.prompt_words + a.answer_words):
                counts["passages"] += 1
                key = hashlib.sha1(p.encode("utf-8")).digest()
                reason = "duplicate" if key in seen else skip_reason(p)
                seen.add(key)
                if reason:
                    counts[reason] += 1
                else:
                    kept.append(p)
            if len(kept) > a.max_per_doc:
                counts["over --max-per-doc"] += len(kept) - a.max_per_doc
                kept = [kept[i] for i in sorted(rng.sample(range(len(kept)), a.max_per_doc))]
            kept = kept[:a.max_pairs - pairs]
            counts["documents used"] += bool(kept)
            for p in kept:
                pair = make_pair(p, a.prompt_words, a.answer_words)
                out.write(json.dumps(pair, ensure_ascii=False) + "\n")
                pairs += 1
                answer_total += len(pair["output"].split())
    print(f"sft_pairs: {len(docs)} documents ({counts['duplicate documents']} duplicates skipped), "
          f"{counts['documents used']} used; {counts['passages']} passages, skipped: duplicate "
          f"{counts['duplicate']}, code/table {counts['code/table']}, not English {counts['not English']}, "
          f"over --max-per-doc {counts['over --max-per-doc']}")
    if pairs == 0:
        sys.exit("sft_pairs.py: no pairs written (is the corpus prose? are --prompt-words/--answer-words too large?)")
    print(f"sft_pairs: wrote {pairs} pairs to {a.output} (prompt {a.prompt_words} words, answer "
          f"{answer_total / pairs:.1f} words on average, at most {a.answer_words})")


if __name__ == "__main__":
    main()
