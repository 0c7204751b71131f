"""Megatron-Core itself reads our .bin/.idx, and we read what its builder writes.

Megatron-Core ships a top-level `megatron` package that would clash with ours, so it is never
imported here: the `megatron_core` fixture (conftest.py) runs a script in a subprocess with only
Megatron-Core on PYTHONPATH, and the test skips with the install command when it is absent.
"""
import json
import textwrap

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import numpy, torch
    from megatron.core.datasets import indexed_dataset as reference
    assert reference.__file__.startswith(os.environ["PYTHONPATH"]), reference.__file__
    ours_prefix, their_prefix, output, corpus_prefix = sys.argv[1:5]
    dataset = reference.IndexedDataset(ours_prefix)
    report = {
        "dtype": numpy.dtype(dataset.index.dtype).name,
        "sequences": [dataset[i].tolist() for i in range(len(dataset))],
        "document_indices": dataset.document_indices.tolist(),
        "window": dataset.get(2, offset=1, length=2).tolist(),
    }
    builder = reference.IndexedDatasetBuilder(their_prefix + ".bin", dtype=numpy.uint16)
    for document in [[[1, 2, 3]], [[4], [5, 6]], [[7] * 40]]:
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(their_prefix + ".idx")
    corpus = reference.IndexedDataset(corpus_prefix)
    report["corpus"] = {"n": len(corpus), "sum": int(sum(int(corpus[i].sum()) for i in range(len(corpus)))),
                        "documents": corpus.document_indices.tolist()}
    json.dump(report, open(output, "w"))
""")


def test_megatron_core_reads_ours_and_we_read_theirs(tmp_path, gpt2_dataset, megatron_core):
    documents = [[[10, 11, 12], [13]], [[14, 15, 16, 17]], [[18]]]
    ours = str(tmp_path / "ours")
    builder = IndexedDatasetBuilder(ours + ".bin", dtype=np.uint16)
    for document in documents:
        for sequence in document:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(ours + ".idx")
    script = tmp_path / "reference_io.py"
    script.write_text(SCRIPT)
    theirs, output = str(tmp_path / "theirs"), str(tmp_path / "report.json")
    megatron_core(script, ours, theirs, output, gpt2_dataset)
    report = json.load(open(output))
    assert report["dtype"] == "uint16"
    assert report["sequences"] == [sequence for document in documents for sequence in document]
    assert report["document_indices"] == [0, 2, 3, 4]
    assert report["window"] == [15, 16]

    dataset = IndexedDataset(theirs)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3], [4], [5, 6], [7] * 40]
    assert dataset.document_indices.tolist() == [0, 1, 3, 4]

    # And a real preprocessed corpus: sequence count, token sum and document index as Megatron-Core reads them.
    report = report["corpus"]
    corpus = IndexedDataset(gpt2_dataset)
    assert report["n"] == len(corpus)
    assert report["sum"] == int(sum(int(corpus[i].astype(np.int64).sum()) for i in range(len(corpus))))
    assert report["documents"] == corpus.document_indices.tolist()
