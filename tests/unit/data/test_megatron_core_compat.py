"""Megatron-Core itself reads our .bin/.idx, and we read what its builder writes.

Megatron-Core ships a top-level `megatron` package that would clash with ours, so it is never
imported here: the `megatron_core` fixture (conftest.py) runs a script in a subprocess with only
Megatron-Core on PYTHONPATH, and the tests skip with the install command when it is absent. One
subprocess reads every dataset of this module.
"""
import importlib.util
import json
import os
import textwrap

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from tests.optional import require_module

tokenizers_lib = require_module("tokenizers")

SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import numpy, torch
    from megatron.core.datasets import indexed_dataset as reference
    assert reference.__file__.startswith(os.environ["PYTHONPATH"]), reference.__file__
    spec = json.load(open(sys.argv[1]))
    report = {"read": {}}
    for name, prefix in spec["read"].items():
        try:
            dataset = reference.IndexedDataset(prefix)
            report["read"][name] = {"dtype": numpy.dtype(dataset.index.dtype).name,
                                    "sequences": [dataset[i].tolist() for i in range(len(dataset))],
                                    "document_indices": dataset.document_indices.tolist()}
        except Exception as error:  # Megatron-Core rejects the file: the test of that dataset says so
            report["read"][name] = {"error": f"{type(error).__name__}: {error}"}
    ours = reference.IndexedDataset(spec["read"]["ours"])  # kept alive: its views die with its memory map
    report["window"] = ours.get(2, offset=1, length=2).tolist()
    builder = reference.IndexedDatasetBuilder(spec["theirs"] + ".bin", dtype=numpy.uint16)
    for document in [[[1, 2, 3]], [[4], [5, 6]], [[7] * 40]]:
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(spec["theirs"] + ".idx")
    json.dump(report, open(spec["output"], "w"))
""")
HANDMADE = [[[10, 11, 12], [13]], [[14, 15, 16, 17]], [[18]]]
# Two parts, each of more documents than one preprocessing batch (512 lines / 256 KB), each document of 1 to 6 sentences.
SENTENCE_DOCUMENTS = 1500
FIRST_PART = 900


TOOLS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "tools")


def load_preprocess_data():
    """tools/preprocess_data.py as a module (for its sentence splitter)."""
    spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(TOOLS, "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sentence_documents(document_generator):
    return document_generator(SENTENCE_DOCUMENTS, seed=7)


@pytest.fixture(scope="module")
def reference_report(tmp_path_factory, megatron_core, gpt2_dataset, gpt2_args, sentence_documents, jsonl_writer, tool):
    """Megatron-Core's reading of: a handmade dataset, the preprocessed corpus, a --split-sentences
    dataset of several worker batches, and two such datasets merged; plus a dataset it writes."""
    directory = tmp_path_factory.mktemp("megatron_core_compat")
    ours = str(directory / "ours")
    builder = IndexedDatasetBuilder(ours + ".bin", dtype=np.uint16)
    for document in HANDMADE:
        for sequence in document:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(ours + ".idx")
    for name, texts in (("first", sentence_documents[:FIRST_PART]), ("second", sentence_documents[FIRST_PART:])):
        source = jsonl_writer(directory / f"{name}.jsonl", texts)
        tool("preprocess_data.py", "--input", source, "--output-prefix", directory / name, "--split-sentences",
             "--append-eod", "--workers", 2, *gpt2_args)
    merge = tool("merge_datasets.py", "--input", directory / "first_text_sentence", directory / "second_text_sentence",
                 "--output-prefix", directory / "merged", check=False)
    read = {"ours": ours, "corpus": gpt2_dataset, "first": str(directory / "first_text_sentence"),
            "second": str(directory / "second_text_sentence")}
    if merge.returncode == 0:  # else test_merged_multi_sentence_datasets reports why
        read["merged"] = str(directory / "merged")
    spec = {"read": read, "theirs": str(directory / "theirs"), "output": str(directory / "report.json")}
    (directory / "spec.json").write_text(json.dumps(spec))
    script = directory / "reference_io.py"
    script.write_text(SCRIPT)
    megatron_core(script, directory / "spec.json")
    return json.loads((directory / "report.json").read_text()), spec, merge


@pytest.fixture(scope="module")
def expected_sentences(sentence_documents, bpe_dir):
    """(sequences, document indices) of each document under `--split-sentences --append-eod`, from the
    `tokenizers` library: a document's sentences, the empty ones dropped, the EOD after the last."""
    reference = tokenizers_lib.Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
    eod = reference.token_to_id("<|endoftext|>")
    split_sentences = load_preprocess_data().split_sentences
    documents = []
    for text in sentence_documents:
        ids = [reference.encode(sentence, add_special_tokens=False).ids for sentence in split_sentences(text)]
        ids = [sentence for sentence in ids if sentence]
        if ids:
            ids[-1] = ids[-1] + [eod]
        documents.append(ids)
    return documents


def flatten(documents):
    sequences, document_indices = [], [0]
    for sequences_of_document in documents:
        sequences.extend(sequences_of_document)
        document_indices.append(len(sequences))
    return sequences, document_indices


def read_by_megatron_core(report, name):
    read = report["read"][name]
    assert "error" not in read, f"Megatron-Core cannot read the {name} dataset: {read.get('error')}"
    return read


def test_megatron_core_reads_ours(reference_report):
    report, _, _ = reference_report
    read = read_by_megatron_core(report, "ours")
    assert read["dtype"] == "uint16"
    assert read["sequences"] == [sequence for document in HANDMADE for sequence in document]
    assert read["document_indices"] == [0, 2, 3, 4]
    assert report["window"] == [15, 16]


def test_we_read_what_megatron_core_writes(reference_report):
    _, spec, _ = reference_report
    dataset = IndexedDataset(spec["theirs"])
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3], [4], [5, 6], [7] * 40]
    assert dataset.document_indices.tolist() == [0, 1, 3, 4]


def test_megatron_core_reads_a_preprocessed_corpus(reference_report, gpt2_dataset):
    report, _, _ = reference_report
    corpus = IndexedDataset(gpt2_dataset)
    read = read_by_megatron_core(report, "corpus")
    assert read["sequences"] == [corpus[i].tolist() for i in range(len(corpus))]
    assert read["document_indices"] == corpus.document_indices.tolist()


@pytest.mark.parametrize("part", ["first", "second"])
def test_split_sentences_across_worker_batches(reference_report, expected_sentences, part):
    report, _, _ = reference_report
    documents = expected_sentences[:FIRST_PART] if part == "first" else expected_sentences[FIRST_PART:]
    sequences, document_indices = flatten(documents)
    assert len(documents) > 512 and len(sequences) > 2 * len(documents)  # several batches of multi-sentence documents
    read = read_by_megatron_core(report, part)
    assert read["document_indices"] == document_indices
    assert read["sequences"] == sequences


def test_merged_multi_sentence_datasets(reference_report, expected_sentences):
    report, _, merge = reference_report
    assert merge.returncode == 0, merge.stderr
    sequences, document_indices = flatten(expected_sentences)
    read = read_by_megatron_core(report, "merged")
    assert read["document_indices"] == document_indices
    assert read["sequences"] == sequences
