#!/usr/bin/env python3
"""Prints the reference values that tests/data/sampling_test.cpp compares against.

Needs only numpy. It mirrors, statement for statement, Megatron-LM's
megatron/core/datasets/gpt_dataset.py (_get_num_epochs, _build_document_index,
_build_shuffle_index, the separate-final-epoch rule), helpers.cpp (build_sample_idx,
build_blending_indices) and MockGPTLowLevelDataset's lengths, using numpy's own generators,
so the C++ re-implementation of MT19937/PCG64 is checked against numpy itself.
Run: python3 scripts/megatron_indices_reference.py
"""
import math
import numpy


def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, add_extra_token=1):
    num_samples = (num_epochs * tokens_per_epoch - add_extra_token) // seq_length
    sample_idx = numpy.zeros((num_samples + 1, 2), dtype=numpy.int64)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + add_extra_token
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - add_extra_token
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return sample_idx


def build_document_index(documents, num_epochs, rs, separate_final_epoch):
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.mgrid[0:num_epochs, 0:len(documents)][1]
        document_index[:] = documents
        document_index = document_index.reshape(-1).astype(numpy.int32)
        rs.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rs, False)
    last = build_document_index(documents, 1, rs, False)
    return numpy.concatenate((first, last))


def build_shuffle_index(num_samples, total_size, rs):
    first = numpy.arange(0, num_samples, 1, dtype=numpy.uint32)
    rs.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, 1, dtype=numpy.uint32)
    rs.shuffle(last)
    return numpy.concatenate((first, last))


def gpt_indices(sizes, begin, end, seq_length, num_samples, seed):
    documents = numpy.arange(begin, end, dtype=numpy.int32)
    tokens_per_epoch = int(numpy.sum(sizes[documents]))
    num_epochs, num_tokens = 1, tokens_per_epoch
    while num_tokens < num_samples * seq_length + 1:
        num_epochs += 1
        num_tokens += tokens_per_epoch
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = from_final < int(0.80 * per_epoch)
    rs = numpy.random.RandomState(seed)
    doc = build_document_index(documents, num_epochs, rs, separate)
    sample = build_sample_idx(sizes, doc, seq_length, num_epochs, tokens_per_epoch)
    total = sample.shape[0] - 1
    shuffle = build_shuffle_index(sans_final if separate else total, total, rs)
    return num_epochs, separate, doc, sample, shuffle


def blending(weights, size):
    current = [0] * len(weights)
    which, index = [], []
    for k in range(size):
        kd = max(float(k), 1.0)
        errs = [weights[d] * kd - current[d] for d in range(len(weights))]
        best = 0
        for d in range(1, len(weights)):
            if errs[d] > errs[best]:
                best = d
        which.append(best)
        index.append(current[best])
        current[best] += 1
    return which, index


def show(name, arr):
    print(f"{name} = {{{', '.join(str(int(v)) for v in numpy.asarray(arr).reshape(-1))}}}")


rs = numpy.random.RandomState(1234)
show("randint_1234_first5_0_1000", [rs.randint(0, 1000) for _ in range(5)])
rs = numpy.random.RandomState(1234)
a = numpy.arange(10)
rs.shuffle(a)
show("shuffle_1234_range10", a)
show("permutation_7_range20", numpy.random.RandomState(7).permutation(20))
rs = numpy.random.RandomState(1234)
show("mt_raw_1234_first3", [rs.randint(0, 2**32, dtype=numpy.uint64) for _ in range(3)])
mock = numpy.random.default_rng(seed=0).integers(low=1, high=4096, size=100000, dtype=numpy.int32)
show("mock_lengths_first8", mock[:8])
print(f"mock_lengths_sum = {int(mock.sum())}, last = {int(mock[-1])}")

sizes = numpy.array([5, 3, 7, 2, 9, 4, 6, 1], dtype=numpy.int32)
for (begin, end, seq, n, seed) in [(0, 8, 4, 6, 1234), (0, 8, 4, 20, 1234), (2, 7, 3, 25, 42)]:
    e, sep, doc, sample, shuffle = gpt_indices(sizes, begin, end, seq, n, seed)
    print(f"case begin={begin} end={end} seq={seq} n={n} seed={seed}: epochs={e} separate={sep}")
    show("  document_index", doc)
    show("  sample_index", sample)
    show("  shuffle_index", shuffle)
which, index = blending([0.5, 0.3, 0.2], 12)
show("blend_which", which)
show("blend_index", index)
