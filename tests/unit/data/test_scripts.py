"""The example scripts and the corpus builder, run as users run them."""
import json
import os
import subprocess
import sys

import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import build_tokenizer
from tests.optional import require_module

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))


def run_script(path, env_overrides):
    env = dict(os.environ, PYTHON=sys.executable, **{k: str(v) for k, v in env_overrides.items()})
    return subprocess.run(["bash", os.path.join(REPO_ROOT, path)], capture_output=True, text=True, env=env, cwd=REPO_ROOT)


def test_build_corpus_is_deterministic_and_capped(tmp_path):
    script = os.path.join(REPO_ROOT, "examples", "quickstart", "build_corpus.py")
    for name in ("a.jsonl", "b.jsonl"):
        subprocess.run([sys.executable, script, "--output", str(tmp_path / name), "--max-mb", "0.3"], check=True,
                       capture_output=True)
    first = (tmp_path / "a.jsonl").read_bytes()
    assert first == (tmp_path / "b.jsonl").read_bytes()
    records = [json.loads(line) for line in first.decode().splitlines()]
    assert records and sum(len(r["text"].encode()) for r in records) <= 300_000
    paths = [r["path"] for r in records]
    assert paths == sorted(paths) and all(p.endswith(".py") and "site-packages" not in p for p in paths)


def test_quickstart_prepare(tmp_path):
    require_module("tokenizers")  # prepare.sh trains a BPE tokenizer
    work = tmp_path / "qs"
    result = run_script("examples/quickstart/prepare.sh", {"WORK_DIR": work, "MAX_MB": 0.4, "VOCAB_SIZE": 1024, "WORKERS": 2})
    assert result.returncode == 0, result.stderr
    prefix = str(work / "stdlib_text_document")
    assert f"DATA_PATH={prefix}" in result.stdout
    assert "--tokenizer-type GPT2BPETokenizer" in result.stdout
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(work / "tokenizer" / "vocab.json"),
                                merge_file=str(work / "tokenizer" / "merges.txt"))
    dataset = IndexedDataset(prefix)
    first_document = json.loads((work / "corpus.jsonl").read_text().splitlines()[0])["text"]
    if first_document:
        assert dataset[0].tolist() == tokenizer.tokenize(first_document) + [tokenizer.eod]
    assert tokenizer.vocab_size <= 1024


def test_llama_prepare_dataset_local(tmp_path, corpus_file, documents, sentencepiece_model):
    result = run_script("examples/llama/prepare_dataset.sh", {"DATASET": "local", "INPUT": corpus_file, "DATA_DIR": tmp_path,
                                                             "TOKENIZER_MODEL": sentencepiece_model, "WORKERS": 1})
    assert result.returncode == 0, result.stderr
    assert f"DATA_PATH={tmp_path}/local_text_document" in result.stdout
    tokenizer = build_tokenizer("Llama2Tokenizer", tokenizer_model=sentencepiece_model)
    dataset = IndexedDataset(str(tmp_path / "local_text_document"))
    assert dataset[0].tolist() == tokenizer.tokenize(documents[0]) + [tokenizer.eod]
    assert len(dataset) == len(documents)


@pytest.mark.parametrize("overrides, message", [
    ({"DATASET": "nonsense"}, "DATASET must be"),
    ({"DATASET": "local"}, "needs INPUT"),
    ({"DATASET": "local", "INPUT": "/no/such/file.jsonl"}, "does not exist"),
])
def test_llama_prepare_dataset_errors(tmp_path, overrides, message):
    result = run_script("examples/llama/prepare_dataset.sh", {"DATA_DIR": tmp_path, "TOKENIZER_MODEL": "x.model", **overrides})
    assert result.returncode != 0 and message in result.stderr


def test_train_tokenizer_rejects_tiny_vocab(tmp_path, corpus_file, tool):
    result = tool("train_tokenizer.py", "--input", corpus_file, "--output-dir", tmp_path, "--vocab-size", 100, check=False)
    assert result.returncode != 0 and "--vocab-size 100" in result.stderr


def test_train_tokenizer_without_sentencepiece_names_the_package(tmp_path, corpus_file, tool):
    shadow = tmp_path / "shadow" / "sentencepiece"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'sentencepiece'\", name='sentencepiece')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"))
    result = tool("train_tokenizer.py", "--input", corpus_file, "--output-dir", tmp_path / "out", "--type", "sentencepiece",
                  "--vocab-size", 500, check=False, env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == ("error: --type sentencepiece needs the sentencepiece package: pip install sentencepiece "
                                     "(or the extra: pip install -e '.[hf]')")
    assert not (tmp_path / "out").exists()


def test_train_tokenizer_json_keys_missing_key_and_progress(tmp_path, documents, jsonl_writer, tool):
    require_module("tokenizers")
    source = jsonl_writer(tmp_path / "content.jsonl", documents[:250], key="content")
    result = tool("train_tokenizer.py", "--input", source, "--output-dir", tmp_path / "none", "--vocab-size", 300, check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"error: --json-keys text: no line of --input {source} has the key 'text' with a string "
                                     "value; keys found: 'content'")
    result = tool("train_tokenizer.py", "--input", source, "--json-keys", "content", "--output-dir", tmp_path / "tok",
                  "--vocab-size", 300, "--log-interval", 100)
    progress = result.stderr.splitlines()
    assert [line.split(" (")[0] for line in progress[:3]] == ["Read 100 documents", "Read 200 documents", "Read all 250 documents"]
    assert progress[-1].startswith("Trained a 300-token bpe tokenizer in ")
    assert os.path.isfile(tmp_path / "tok" / "vocab.json")
