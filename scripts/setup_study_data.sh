#!/usr/bin/env bash
# Builds the numerics study's corpus (CONVERGENCE.md): large enough that no study run repeats a token.
# Everything comes from Debian packages:
#   prose  linux-doc (kernel documentation), python3.11-doc (reST sources), perl-doc (POD),
#          postgresql-doc-15 (HTML, tags stripped)
#   code   linux-source-6.1: the kernel's C sources and headers (*.c, *.h), in a fixed shuffled order,
#          up to a byte budget (STUDY_CODE_MB, default 320 MB). Machine-generated tables are left out: files
#          over 256 KB or that zlib compresses more than 5x (register maps such as drivers/gpu/drm/amd's
#          asic_reg headers, which zlib shrinks 13-15x, are about 40% of the tarball's C bytes: kept, they
#          would dominate the tokens with nearly free predictions)
# Documents (one JSON line {"text": ...} per file) are shuffled together with a fixed seed, so Megatron's
# contiguous document split ("969,30,1") gives a validation split with the same mixture as training.
# Output in $NIBBLE_DATA_DIR/study (default ~/.cache/nibble/study):
#   study.jsonl.xz     the corpus text (what is carried to a GPU machine: text compresses ~7x, tokens ~1.5x)
#   study_manifest.json  composition: documents and bytes per source
# The held-out test set (CONVERGENCE.md scores every run's final model on it beside the validation split) comes
# from a Debian package that is not in the training corpus: debian-handbook, "The Debian Administrator's
# Handbook" (a book of English prose with command examples), its English HTML pages (one document per page):
#   heldout.jsonl.xz       the held-out text
#   heldout_manifest.json  its composition (package, version, documents, bytes)
# With --tokenize TOKENIZER it also writes study_text_document.{bin,idx} and heldout_text_document.{bin,idx}
# (nibble preprocess, GPT-2 ranks give uint16 ids); scripts/convergence.sh does that step on the GPU machine
# from the .xz files (prepare, prepare-heldout). Needs: apt-get, dpkg-query, python3 (standard library), xz.
# Safe to re-run.
set -euo pipefail
DIR="${NIBBLE_DATA_DIR:-$HOME/.cache/nibble}/study"
CODE_MB="${STUDY_CODE_MB:-320}"
mkdir -p "$DIR"
pkgs=(linux-doc linux-source-6.1 python3.11-doc perl-doc postgresql-doc-15 debian-handbook)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get install -y "${missing[@]}" >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y "${missing[@]}" >/dev/null; }
fi

if [ ! -s "$DIR/study.jsonl.xz" ]; then
  python3 - "$DIR" "$CODE_MB" <<'PY'
import glob, gzip, html.parser, json, os, random, re, sys, tarfile, zlib
out_dir, code_mb = sys.argv[1], int(sys.argv[2])

def read(path):
    data = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
    return data.decode("utf-8", errors="replace")

class TextOnly(html.parser.HTMLParser):
    """Visible text of an HTML page (script/style dropped); block tags become line breaks."""
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skip = [], 0
    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"): self.skip += 1
        if tag in ("p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "pre", "dt", "dd"): self.parts.append("\n")
    def handle_endtag(self, tag):
        if tag in ("script", "style") and self.skip: self.skip -= 1
    def handle_data(self, d):
        if not self.skip: self.parts.append(d)

def html_text(path):
    p = TextOnly()
    p.feed(read(path))
    return re.sub(r"\n{3,}", "\n\n", "".join(p.parts)).strip()

def unique(paths):  # packages ship some files twice through symlinks: keep one path per real file
    seen, out = set(), []
    for f in sorted(paths):
        r = os.path.realpath(f)
        if r not in seen and os.path.isfile(r):
            seen.add(r); out.append(f)
    return out

docs = []  # (source, text)
sources = {
    "linux-doc": unique(glob.glob("/usr/share/doc/linux-doc*/Documentation/**/*.rst*", recursive=True)
                        + glob.glob("/usr/share/doc/linux-doc*/Documentation/**/*.txt*", recursive=True)),
    "python3.11-doc": unique(glob.glob("/usr/share/doc/python3.11/html/_sources/**/*.txt", recursive=True)),
    "perl-doc": unique(glob.glob("/usr/share/perl/*/pod/*.pod") + glob.glob("/usr/share/doc/perl/**/*.pod*", recursive=True)),
}
for name, files in sources.items():
    docs += [(name, read(f)) for f in files]
docs += [("postgresql-doc-15", html_text(f)) for f in unique(glob.glob("/usr/share/doc/postgresql-doc-15/html/*.html"))]

# Kernel C sources in a fixed shuffled order up to the byte budget (the tarball is streamed once).
tar_path = sorted(glob.glob("/usr/src/linux-source-6.1*.tar.xz"))[0]
members = {}
with tarfile.open(tar_path, "r|xz") as tf:
    for m in tf:
        if m.isfile() and (m.name.endswith(".c") or m.name.endswith(".h")) and m.size <= 256_000:
            data = tf.extractfile(m).read()
            if len(data) <= 5 * len(zlib.compress(data, 6)):
                members[m.name] = data
names = sorted(members)
random.Random(1).shuffle(names)
budget, used = code_mb * 1_000_000, 0
for n in names:
    if used >= budget: break
    text = members[n].decode("utf-8", errors="replace")
    docs.append(("linux-source-6.1", text)); used += len(members[n])

docs = [(s, t) for s, t in docs if t.strip()]
random.Random(0).shuffle(docs)
manifest = {}
with open(os.path.join(out_dir, "study.jsonl"), "w", encoding="utf-8") as f:
    for s, t in docs:
        f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
        e = manifest.setdefault(s, {"documents": 0, "bytes": 0})
        e["documents"] += 1; e["bytes"] += len(t.encode("utf-8"))
json.dump({"sources": manifest, "documents": len(docs), "shuffle_seed": 0, "code_budget_mb": code_mb,
           "code_filter": "*.c and *.h of at most 256 KB that zlib (level 6) compresses at most 5x"},
          open(os.path.join(out_dir, "study_manifest.json"), "w"), indent=1)
print("study.jsonl:", {k: (v["documents"], round(v["bytes"] / 1e6, 1)) for k, v in manifest.items()})
PY
  xz -T0 -6 -f "$DIR/study.jsonl"
fi

if [ ! -s "$DIR/heldout.jsonl.xz" ]; then
  python3 - "$DIR" "$(dpkg-query -W -f '${Version}' debian-handbook)" <<'PY'
import glob, html.parser, json, os, re, sys
out_dir, version = sys.argv[1], sys.argv[2]

class BookText(html.parser.HTMLParser):
    """Visible text of one of the handbook's pages without the banner, the title bar and the navigation lists;
    block tags become line breaks, and outside <pre> whitespace runs become one space."""
    BLOCK = ("p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "pre", "dt", "dd", "table")
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skip, self.pre = [], [], 0  # parts: (text, inside <pre>); skip: [tag, depth]
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self.skip:
            self.skip[-1][1] += tag == self.skip[-1][0]
            return
        if (tag in ("script", "style", "title") or a.get("id") in ("banner", "title")
                or (tag == "ul" and "docnav" in (a.get("class") or ""))):
            self.skip.append([tag, 1])
            return
        if tag in self.BLOCK: self.parts.append(("\n", False))
        if tag == "pre": self.pre += 1
    def handle_endtag(self, tag):
        if self.skip:
            if tag == self.skip[-1][0]:
                self.skip[-1][1] -= 1
                if not self.skip[-1][1]: self.skip.pop()
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
            self.parts.append(("\n", False))
    def handle_data(self, d):
        if not self.skip: self.parts.append((d, self.pre > 0))
    def text(self):
        out, run = [], []  # run: consecutive text outside <pre>, normalized as one piece
        flush = lambda: out.append(re.sub(r" *\n[ \n]*", "\n", re.sub(r"[ \t\r\f\v]+", " ", "".join(run))
                                          .replace(" \n", "\n")))
        for t, pre in self.parts:
            if pre:
                flush(); run = []; out.append(t)
            else:
                run.append(t.replace("\n", " "))  if t != "\n" else run.append(t)
        flush()
        return re.sub(r"\n{3,}", "\n\n", "".join(out)).strip()

def page_text(path):
    p = BookText()
    p.feed(open(path, encoding="utf-8").read())
    return p.text()

pages = sorted(f for f in glob.glob("/usr/share/doc/debian-handbook/html/en-US/*.html")
               if os.path.basename(f) != "index.html")  # index.html is the table of contents
docs = [t for t in (page_text(f) for f in pages) if t]
with open(os.path.join(out_dir, "heldout.jsonl"), "w", encoding="utf-8") as f:
    for t in docs:
        f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
size = sum(len(t.encode("utf-8")) for t in docs)
json.dump({"package": "debian-handbook", "version": version, "language": "en-US",
           "title": "The Debian Administrator's Handbook", "documents": len(docs), "bytes": size,
           "extraction": "the English HTML pages but index.html (the table of contents), one document each; "
                         "banner, title bar and navigation dropped; whitespace outside <pre> collapsed"},
          open(os.path.join(out_dir, "heldout_manifest.json"), "w"), indent=1)
print(f"heldout.jsonl: {len(docs)} documents, {size / 1e6:.2f} MB")
PY
  xz -6 -f "$DIR/heldout.jsonl"
fi

# The stored runs' corpus (bench/convergence/corpus.json): Debian revises packages, and a corpus that differs from it
# makes runs that pair with the stored ones only approximately (CONVERGENCE.md). Said here, before GPU time is spent.
stored="$(dirname "$0")/../bench/convergence/corpus.json"
if [ -s "$stored" ]; then
  python3 - "$DIR/study_manifest.json" "$stored" <<'PY'
import json, sys
have, want = (json.load(open(p))["sources"] for p in sys.argv[1:3])
diff = [f"{k}: {have.get(k)} here, {v} stored" for k, v in want.items() if have.get(k) != v]
if diff:
    print("setup_study_data.sh: warning: the corpus differs from the stored runs' (bench/convergence/corpus.json; "
          "a later Debian revision?):\n  " + "\n  ".join(diff), file=sys.stderr)
PY
fi

if [ "${1:-}" = "--tokenize" ]; then
  tok="${2:?--tokenize needs a tokenizer file (gpt2.tiktoken)}"
  nibble="${NIBBLE:-nibble}"
  for name in study heldout; do
    xz -dkc "$DIR/$name.jsonl.xz" > "$DIR/$name.jsonl"
    "$nibble" preprocess -i "$DIR/$name.jsonl" -o "$DIR/$name" -t "$tok" --append-eod -j "$(nproc)"
    rm -f "$DIR/$name.jsonl"
  done
fi
ls -la "$DIR"
