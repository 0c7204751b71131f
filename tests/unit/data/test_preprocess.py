"""tools/preprocess_data.py and tools/merge_datasets.py end to end: tokens out equal the reference library's encoding."""
import gzip
import json
import os

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from tests.optional import require_module

tokenizers_lib = require_module("tokenizers")


def sequences(prefix):
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_gpt2_round_trip_two_workers(gpt2_dataset, documents, bpe_dir):
    reference = tokenizers_lib.Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
    eod = reference.token_to_id("<|endoftext|>")
    expected = [reference.encode(text, add_special_tokens=False).ids + [eod] for text in documents]
    dataset = IndexedDataset(gpt2_dataset)
    assert np.dtype(dataset.dtype) == np.uint16
    assert sequences(gpt2_dataset) == expected
    assert dataset.document_indices.tolist() == list(range(len(documents) + 1))


def test_huggingface_round_trip(tmp_path, corpus_file, documents, bpe_dir, tool):
    transformers = require_module("transformers")
    tool("preprocess_data.py", "--input", corpus_file, "--output-prefix", tmp_path / "hf", "--tokenizer-type",
         "HuggingFaceTokenizer", "--tokenizer-model", bpe_dir, "--append-eod", "--workers", 1)
    reference = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    expected = [reference(text).input_ids + [reference.eos_token_id] for text in documents]
    assert sequences(str(tmp_path / "hf_text_document")) == expected


def test_llama2_round_trip(tmp_path, corpus_file, documents, sentencepiece_model, tool):
    sentencepiece = require_module("sentencepiece")
    tool("preprocess_data.py", "--input", corpus_file, "--output-prefix", tmp_path / "sp", "--tokenizer-type",
         "Llama2Tokenizer", "--tokenizer-model", sentencepiece_model, "--append-eod", "--workers", 2)
    reference = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    expected = [[reference.bos_id()] + reference.encode(text) + [reference.eos_id()] for text in documents]
    assert sequences(str(tmp_path / "sp_text_document")) == expected


def test_null_tokenizer_int32_for_large_vocab(tmp_path, jsonl_writer, tool):
    source = jsonl_writer(tmp_path / "ids.jsonl", ["1 2 3", "70000 5", "7"])
    tool("preprocess_data.py", "--input", source, "--output-prefix", tmp_path / "null", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", 100000, "--append-eod")
    dataset = IndexedDataset(str(tmp_path / "null_text_document"))
    assert np.dtype(dataset.dtype) == np.int32
    assert sequences(str(tmp_path / "null_text_document")) == [[1, 2, 3, 100000], [70000, 5, 100000], [7, 100000]]


def test_gzip_text_directory_and_several_keys(tmp_path, documents, gpt2_args, bpe_dir, tool):
    reference = tokenizers_lib.Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as handle:
        for text in documents[:20]:
            handle.write(json.dumps({"text": text, "title": text[:10]}) + "\n")
    tool("preprocess_data.py", "--input", tmp_path / "c.jsonl.gz", "--output-prefix", tmp_path / "gz",
         "--json-keys", "text", "title", *gpt2_args)
    encode = lambda text: reference.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert sequences(str(tmp_path / "gz_text_document")) == [encode(text) for text in documents[:20]]
    assert sequences(str(tmp_path / "gz_title_document")) == [encode(text[:10]) for text in documents[:20]]

    text_dir = tmp_path / "texts"
    os.makedirs(text_dir / "sub")
    for index, text in enumerate(documents[:5]):
        (text_dir / ("sub" if index % 2 else "") / f"doc{index}.txt").write_text(text, encoding="utf-8")
    tool("preprocess_data.py", "--input", text_dir, "--output-prefix", tmp_path / "dir", "--append-eod", *gpt2_args)
    order = sorted([f"doc{i}.txt" if i % 2 == 0 else f"sub/doc{i}.txt" for i in range(5)])
    by_name = {f"doc{i}.txt" if i % 2 == 0 else f"sub/doc{i}.txt": documents[i] for i in range(5)}
    eod = reference.token_to_id("<|endoftext|>")
    assert sequences(str(tmp_path / "dir_text_document")) == [encode(by_name[name]) + [eod] for name in order]


def test_malformed_lines_are_reported_with_line_numbers(tmp_path, gpt2_args, tool):
    lines = ['{"text": "good one"}', '{"text": "broken', '{"other": "x"}', '{"text": 5}', '', '[1, 2]', '{"text": "good two"}']
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    result = tool("preprocess_data.py", "--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "out", *gpt2_args)
    report = result.stderr
    assert "4 malformed lines skipped" in report
    for line, reason in [(2, "invalid JSON"), (3, "missing key 'text'"), (4, "key 'text' is int"), (6, "expected a JSON object")]:
        assert f"bad.jsonl:{line}: {reason}" in report
    assert "1 blank lines skipped" in report
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 2

    strict = tool("preprocess_data.py", "--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "strict",
                  "--strict", *gpt2_args, check=False)
    assert strict.returncode != 0
    assert "bad.jsonl:2: invalid JSON" in strict.stderr
    assert not [name for name in os.listdir(tmp_path) if name.startswith("strict")], "a failed run must leave no files"


def test_failure_late_in_a_big_run_leaves_no_dataset(tmp_path, documents, jsonl_writer, gpt2_args, tool):
    source = jsonl_writer(tmp_path / "big.jsonl", documents * 10)
    with open(source, "a") as handle:
        handle.write("not json\n")
    result = tool("preprocess_data.py", "--input", source, "--output-prefix", tmp_path / "big", "--strict",
                  "--workers", 2, *gpt2_args, check=False)
    assert result.returncode != 0 and f"big.jsonl:{len(documents) * 10 + 1}" in result.stderr
    assert [name for name in os.listdir(tmp_path) if name.startswith("big_")] == []


def test_empty_and_missing_inputs(tmp_path, gpt2_args, tool):
    (tmp_path / "empty.jsonl").write_text("")
    result = tool("preprocess_data.py", "--input", tmp_path / "empty.jsonl", "--output-prefix", tmp_path / "e", *gpt2_args, check=False)
    assert result.returncode != 0 and "empty.jsonl" in result.stderr and "empty" in result.stderr
    (tmp_path / "blank.jsonl").write_text("\n\n")
    result = tool("preprocess_data.py", "--input", tmp_path / "blank.jsonl", "--output-prefix", tmp_path / "b", *gpt2_args, check=False)
    assert result.returncode != 0 and "no valid documents" in result.stderr
    assert not [name for name in os.listdir(tmp_path) if name.startswith(("e_", "b_"))]
    result = tool("preprocess_data.py", "--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "n", *gpt2_args, check=False)
    assert result.returncode != 0 and "nope.jsonl" in result.stderr


def test_partitions_give_identical_output(tmp_path, corpus_file, gpt2_dataset, gpt2_args, tool):
    result = tool("preprocess_data.py", "--input", corpus_file, "--output-prefix", tmp_path / "parts", "--append-eod",
                  "--partitions", 3, "--log-interval", 100, *gpt2_args)
    for suffix in (".bin", ".idx"):
        assert open(f"{tmp_path}/parts_text_document{suffix}", "rb").read() == open(gpt2_dataset + suffix, "rb").read()
    assert sorted(os.listdir(tmp_path)) == ["parts_text_document.bin", "parts_text_document.idx",
                                            "parts_text_document.tokenizer.json"]
    assert "docs/s" in result.stderr and "MB/s" in result.stderr


def test_split_sentences(tmp_path, jsonl_writer, gpt2_args, bpe_dir, tool):
    source = jsonl_writer(tmp_path / "s.jsonl", ["One here. Two there! Three?", "Single sentence"])
    tool("preprocess_data.py", "--input", source, "--output-prefix", tmp_path / "s", "--split-sentences", "--append-eod", *gpt2_args)
    reference = tokenizers_lib.Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
    encode = lambda text: reference.encode(text, add_special_tokens=False).ids  # noqa: E731
    eod = reference.token_to_id("<|endoftext|>")
    dataset = IndexedDataset(str(tmp_path / "s_text_sentence"))
    assert sequences(str(tmp_path / "s_text_sentence")) == [encode("One here."), encode("Two there!"), encode("Three?") + [eod],
                                                           encode("Single sentence") + [eod]]
    assert dataset.document_indices.tolist() == [0, 3, 4]


def test_merge_datasets(tmp_path, documents, jsonl_writer, gpt2_args, tool):
    jsonl_writer(tmp_path / "a.jsonl", documents[:30])
    jsonl_writer(tmp_path / "b.jsonl", documents[30:50])
    jsonl_writer(tmp_path / "ab.jsonl", documents[:50])
    for name in ("a", "b", "ab"):
        tool("preprocess_data.py", "--input", tmp_path / f"{name}.jsonl", "--output-prefix", tmp_path / name, "--append-eod", *gpt2_args)
    tool("merge_datasets.py", "--input", tmp_path / "a_text_document", tmp_path / "b_text_document",
         "--output-prefix", tmp_path / "merged")
    for suffix in (".bin", ".idx"):
        assert open(f"{tmp_path}/merged{suffix}", "rb").read() == open(f"{tmp_path}/ab_text_document{suffix}", "rb").read()
    missing = tool("merge_datasets.py", "--input", tmp_path / "missing", "--output-prefix", tmp_path / "m2", check=False)
    assert missing.returncode != 0 and "missing" in missing.stderr


@pytest.mark.parametrize("step", ["worker-start", "worker-encode", "main-write", "merge", "finalize"])
@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_ctrl_c_leaves_no_dataset(tmp_path, documents, jsonl_writer, gpt2_args, step, sigint):
    """SIGINT to the whole process group (what Ctrl-C does) while the tool is held in `step`: exit 130,
    no dataset, no temporary files. `ignored`: the tool was started with SIGINT ignored, as a
    background job of a non-interactive shell is (a test suite started with `&`); Ctrl-C still stops it."""
    import signal
    import subprocess
    import sys

    source = jsonl_writer(tmp_path / "corpus.jsonl", documents * 5)
    release = tmp_path / "release"
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "held_preprocess.py"), step, str(release),
               "--input", source, "--output-prefix", str(tmp_path / "out"), "--workers", "2",
               "--partitions", "2" if step == "merge" else "1", *gpt2_args]
    if sigint == "ignored":
        command = ["/bin/sh", "-c", "trap '' INT; exec \"$@\"", "sh", *command]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = [process.stderr.readline()]
        while seen[-1] not in ("", f"held {step}\n"):  # progress lines come first; "" is the end of stderr
            seen.append(process.stderr.readline())
        assert seen[-1] == f"held {step}\n", "".join(seen)
        os.killpg(process.pid, signal.SIGINT)
        release.touch()
        remaining = process.communicate(timeout=120)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, remaining
    assert "interrupted" in remaining
    assert [name for name in os.listdir(tmp_path) if name.startswith("out")] == []


def test_no_line_has_the_key_names_the_keys_found(tmp_path, documents, jsonl_writer, gpt2_args, tool):
    source = jsonl_writer(tmp_path / "content.jsonl", documents[:30], key="content")
    result = tool("preprocess_data.py", "--input", source, "--output-prefix", tmp_path / "out", *gpt2_args, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --json-keys text: no line of --input {source} has the key 'text' with a string value; keys found: 'content'")
    result = tool("preprocess_data.py", "--input", source, "--output-prefix", tmp_path / "out", "--json-keys", "content",
                  "title", *gpt2_args, check=False)
    assert result.stderr.strip().splitlines()[-1].startswith("error: --json-keys content title: no line of --input "
                                                             f"{source} has the key 'title' with a string value")
    assert not [name for name in os.listdir(tmp_path) if name.startswith("out")]


def test_dataset_records_its_tokenizer_and_training_with_another_is_an_error(tmp_path, gpt2_dataset, gpt2_args, bpe_dir,
                                                                              sentencepiece_model, jsonl_writer,
                                                                              documents, tool):
    """preprocess_data.py writes <prefix>.tokenizer.json; the same tokenizer (a copy elsewhere too)
    passes, another one (type, vocabulary or files) fails before any index is built, naming both;
    merging datasets of two tokenizers is refused."""
    import json
    import shutil

    from megatron.core.datasets import GPTDatasetConfig, check_data_inputs
    from megatron.core.datasets.tokenizer_record import tokenizer_record
    from megatron.core.tokenizers import build_tokenizer

    bpe = build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(bpe_dir, "vocab.json"),
                          merge_file=os.path.join(bpe_dir, "merges.txt"))
    saved = json.load(open(gpt2_dataset + ".tokenizer.json"))
    assert saved["tokenizer_type"] == "GPT2BPETokenizer" and len(saved["files_sha256"]) == 64
    assert (saved["vocab_size"], saved["eod"]) == (bpe.vocab_size, bpe.eod)

    def check(record):
        check_data_inputs(GPTDatasetConfig(seq_length=16, seed=1, data_path=[gpt2_dataset], tokenizer_record=record))

    copy = tmp_path / "copy"
    shutil.copytree(bpe_dir, copy)
    same = build_tokenizer("GPT2BPETokenizer", vocab_file=str(copy / "vocab.json"), merge_file=str(copy / "merges.txt"))
    check(tokenizer_record(same, "GPT2BPETokenizer", vocab_file=str(copy / "vocab.json"),
                           merge_file=str(copy / "merges.txt")))
    other = build_tokenizer("Llama2Tokenizer", tokenizer_model=sentencepiece_model)
    with pytest.raises(ValueError) as raised:
        check(tokenizer_record(other, "Llama2Tokenizer", tokenizer_model=sentencepiece_model))
    assert str(raised.value).startswith(f"{gpt2_dataset} was written with the tokenizer GPT2BPETokenizer (vocabulary "
                                        f"{bpe.vocab_size}, end-of-document id {bpe.eod}, files sha256 ")
    assert f"and this run uses Llama2Tokenizer (vocabulary {other.vocab_size}" in str(raised.value)
    assert "they differ in tokenizer_type, vocab_size, eod, files_sha256" in str(raised.value)
    with open(copy / "merges.txt", "a") as handle:  # the same type and size, other merges
        handle.write("a b\n")
    edited = build_tokenizer("GPT2BPETokenizer", vocab_file=str(copy / "vocab.json"), merge_file=str(copy / "merges.txt"))
    with pytest.raises(ValueError, match="they differ in files_sha256"):
        check(tokenizer_record(edited, "GPT2BPETokenizer", vocab_file=str(copy / "vocab.json"),
                               merge_file=str(copy / "merges.txt")))
    pretrain = _pretrain_main()
    with pytest.raises(ValueError, match=f"{gpt2_dataset} was written with the tokenizer GPT2BPETokenizer .* this run "
                                         "uses Llama2Tokenizer"):
        pretrain(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
                  "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--data-path", gpt2_dataset,
                  "--data-cache-path", str(tmp_path / "cache"), "--tokenizer-type", "Llama2Tokenizer",
                  "--tokenizer-model", sentencepiece_model, "--num-workers", "0", "--eval-iters", "0"])
    source = jsonl_writer(tmp_path / "l.jsonl", documents[:5])
    tool("preprocess_data.py", "--input", source, "--output-prefix", tmp_path / "llama", "--tokenizer-type",
         "Llama2Tokenizer", "--tokenizer-model", sentencepiece_model)
    merged = tool("merge_datasets.py", "--input", gpt2_dataset, tmp_path / "llama_text_document", "--output-prefix",
                  tmp_path / "mixed", check=False)
    assert merged.returncode != 0 and "were written with different tokenizers" in merged.stderr


def _pretrain_main():
    """pretrain_gpt.main, run in this process."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "pretrain_gpt.py")
    spec = importlib.util.spec_from_file_location("pretrain_gpt_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main

