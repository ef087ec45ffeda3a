"""Merges report sections into a Markdown file such as BENCHMARKS.md (used by the benchmark report scripts).

A report is a header followed by "## " sections. merge_sections replaces, in the file, only the sections whose
"## " title line the new report has (adding the others at the end), keeps the file's header and appends to it a
"- merged: TITLES from RESULTS (commit C)" note. write_report prints a report's sections or merges those that
have a run. read_result and summary_row read a run folder's files and nibble's end-of-run summary table.
Standard library only.
"""
import os
import re
import sys


def read_result(out, name):
    """The text of OUT/NAME, or '' when the run did not write it."""
    path = os.path.join(out, name)
    return open(path, errors="replace").read() if os.path.exists(path) else ""


def summary_row(text, label):
    """The value of row LABEL of a `nibble train` summary table in TEXT, or ''."""
    m = re.search(r"^\| " + re.escape(label) + r"\s*\|\s*([^|]+?)\s*\|", text, re.M)
    return m.group(1) if m else ""


def split_sections(text):
    """(header, {"## title line": section text}) of a Markdown report, sections in file order."""
    parts = re.split(r"(?m)^(?=## )", text)
    return parts[0], {p.splitlines()[0]: p for p in parts[1:]}


def merge_sections(path, new_text, results_name, commit, skip=lambda title: False):
    """Writes into PATH the "## " sections of NEW_TEXT for which skip(title) is false; returns their titles."""
    _, new_secs = split_sections(new_text)
    old_head, old_secs = split_sections(open(path).read())
    merged, taken = dict(old_secs), []
    for title, body in new_secs.items():
        if skip(title):
            continue
        merged[title] = body.rstrip("\n") + "\n\n"
        taken.append(title[3:])
    old_head = old_head.rstrip() + "\n- merged: " + ", ".join(taken) + f" from {results_name} (commit {commit})\n\n"
    open(path, "w").write(old_head + "".join(b.rstrip("\n") + "\n\n" for b in merged.values()).rstrip("\n") + "\n")
    return taken


def write_report(sections, merge_into, out, commit):
    """SECTIONS: (text, ran) pairs, each text one "## " section. Prints them all, or merges into MERGE_INTO those
    that ran (a section with no run in OUT keeps the file's own)."""
    text = "\n".join(body for body, _ in sections)
    if not merge_into:
        sys.stdout.write(text)
        return
    absent = {body.splitlines()[0] for body, ran in sections if not ran and body}  # an empty body: no title
    merge_sections(merge_into, text, os.path.basename(out.rstrip("/")), commit, skip=lambda title: title in absent)
