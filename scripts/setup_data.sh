#!/usr/bin/env bash
# Fetches the real data the data/tokenizer tests and the preprocessing benchmark use, into a cache
# folder outside git (default ~/.cache/nibble, override with NIBBLE_DATA_DIR):
#   gpt2.tiktoken    GPT-2 ranks (r50k_base) from the npm package gpt-tokenizer (MIT)
#   llama3.tiktoken  Llama 3 ranks from the npm package llama3-tokenizer-js (MIT package; the data is
#                    under Meta's Llama 3 licence), converted from its base64 vocabulary
#   llama3-tokenizer.json  the same Llama 3 tokenizer in Hugging Face tokenizer.json form (vocab + merges)
#   corpus.jsonl     English prose: the Linux kernel documentation from the Debian package linux-doc,
#                    one JSON line {"text": ...} per document
# Needs: npm, python3 (standard library only), apt-get for the corpus. Safe to re-run.
set -euo pipefail
DIR="${NIBBLE_DATA_DIR:-$HOME/.cache/nibble}"
mkdir -p "$DIR/npm"
cd "$DIR/npm"

if [ ! -s "$DIR/gpt2.tiktoken" ]; then
  npm pack gpt-tokenizer@4.0.0 --silent >/dev/null
  tar -xzf gpt-tokenizer-4.0.0.tgz package/data/r50k_base.tiktoken
  cp package/data/r50k_base.tiktoken "$DIR/gpt2.tiktoken"
fi

if [ ! -s "$DIR/llama3.tiktoken" ] || [ ! -s "$DIR/llama3-tokenizer.json" ]; then
  npm pack llama3-tokenizer-js@1.2.0 --silent >/dev/null
  mkdir -p llama3 && tar -xzf llama3-tokenizer-js-1.2.0.tgz -C llama3 package/src/data-converted.js
  python3 - "$DIR/npm/llama3/package/src/data-converted.js" "$DIR/llama3.tiktoken" "$DIR/llama3-tokenizer.json" <<'PY'
import base64, json, re, sys
src = open(sys.argv[1], encoding="utf-8").read()
vocab_b64 = re.search(r'llama_vocab_base64\s*=\s*"([^"]*)"', src).group(1)
tokens = base64.b64decode(vocab_b64).decode("utf-8").split("\n")
# GPT-2's bytes-to-unicode table: printable bytes map to themselves, the rest to U+0100 onwards.
bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
cs = bs[:]
n = 0
for b in range(256):
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
decode = {chr(c): b for b, c in zip(bs, cs)}
with open(sys.argv[2], "w") as out:
    for rank, tok in enumerate(tokens):
        raw = bytes(decode[ch] for ch in tok)
        out.write(base64.b64encode(raw).decode() + " " + str(rank) + "\n")
print(f"llama3.tiktoken: {len(tokens)} ranks")
# The same tokenizer as a Hugging Face tokenizer.json (the layout of Meta's published file): merges are
# pairs of 17-bit vocabulary indices packed MSB-first (see the package's src/data-conversion.py).
blob = base64.b64decode(re.search(r'llama_merges_binary\s*=\s*"([^"]*)"', src).group(1))
bits = int.from_bytes(blob, "big")
nbits = 8 * len(blob)
ids = [(bits >> (nbits - 17 * (i + 1))) & 0x1FFFF for i in range(nbits // 17)]
merges = [[tokens[ids[i]], tokens[ids[i + 1]]] for i in range(0, len(ids) - 1, 2)]
names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
         "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
         "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"] + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
doc = {
    "version": "1.0",
    "added_tokens": [{"id": 128000 + i, "content": n, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True} for i, n in enumerate(names)],
    "normalizer": None,
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
    "post_processor": {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [], "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000], "tokens": ["<|begin_of_text|>"]}}}]},
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
              "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
}
with open(sys.argv[3], "w", encoding="utf-8") as out:
    json.dump(doc, out, ensure_ascii=False)
print(f"llama3-tokenizer.json: {len(tokens)} tokens, {len(merges)} merges")
PY
fi

if [ ! -s "$DIR/corpus.jsonl" ]; then
  if ! dpkg -s linux-doc-6.1 >/dev/null 2>&1 && ! ls /usr/share/doc/linux-doc* >/dev/null 2>&1; then
    (apt-get install -y linux-doc >/dev/null 2>&1) || { apt-get update >/dev/null && apt-get install -y linux-doc >/dev/null; }
  fi
  python3 - "$DIR/corpus.jsonl" <<'PY'
import glob, gzip, json, random, sys
files = sorted(glob.glob("/usr/share/doc/linux-doc*/Documentation/**/*.rst*", recursive=True)
               + glob.glob("/usr/share/doc/linux-doc*/Documentation/**/*.txt*", recursive=True))
# Shuffled with a fixed seed: in folder order, Megatron's contiguous validation split ("969,30,1")
# would be the translations folder, a different language from the training split.
random.Random(0).shuffle(files)
total = 0
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for f in files:
        data = gzip.open(f).read() if f.endswith(".gz") else open(f, "rb").read()
        text = data.decode("utf-8", errors="replace")
        if text.strip():
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            total += len(data)
print(f"corpus.jsonl: {len(files)} documents, {total / 1e6:.1f} MB of text")
PY
fi
ls -la "$DIR"
