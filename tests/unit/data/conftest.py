"""Shared fixtures for the data pipeline tests: a generated corpus and tiny tokenizers trained on it."""
import json
import os
import random
import subprocess
import sys

import pytest

from tests.optional import require_megatron_core, require_module, skip_unless_importable_by_megatron_core

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir))
TOOLS = os.path.join(REPO_ROOT, "tools")

WORDS = ("the quick brown fox jumps over a lazy dog while naïve café owners in Zürich count 12 345 6789 "
         "apples; def print(x): return x ** 2 # comment \t tabs and 日本語 テキスト emoji 😀🚀 don't we'll "
         "I'm they've <html> {json: [1, 2]} C++ e-mail@example.com").split(" ")


def generate_documents(count: int, seed: int = 0) -> list:
    """Deterministic documents of varied length with punctuation, newlines and non-ASCII text."""
    rng = random.Random(seed)
    documents = []
    for index in range(count):
        sentences = []
        for _ in range(rng.randint(1, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 25))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", "."]))
        separator = rng.choice([" ", " ", "\n", "\n\n  "])
        documents.append(separator.join(sentences))
    return documents


def write_jsonl(path, documents, key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as handle:
        for document in documents:
            handle.write(json.dumps({key: document}) + "\n")
    return str(path)


def run_tool(script: str, *args, check: bool = True, env=None) -> subprocess.CompletedProcess:
    """Run tools/<script> in a subprocess, as a user would."""
    result = subprocess.run([sys.executable, os.path.join(TOOLS, script), *[str(a) for a in args]],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def megatron_core():
    """`megatron_core(script, *args)` runs a Python script with only Megatron-Core on PYTHONPATH, never
    importing it here; tests using it skip, with the install command, when it is absent."""
    reference_dir = require_megatron_core("megatron/core/datasets/indexed_dataset.py")

    def run(script, *args, timeout: int = 600) -> subprocess.CompletedProcess:
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        env["PYTHONPATH"] = reference_dir
        result = subprocess.run([sys.executable, str(script), *[str(a) for a in args]], cwd=os.path.dirname(str(script)),
                                env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            skip_unless_importable_by_megatron_core(result.stderr)
        assert result.returncode == 0, result.stderr[-4000:]
        return result

    return run


@pytest.fixture(scope="session")
def documents():
    return generate_documents(400)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory, documents):
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", documents)


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory, corpus_file):
    """Byte-level BPE (GPT-2 regex): vocab.json, merges.txt, tokenizer.json, tokenizer_config.json."""
    require_module("tokenizers")
    directory = tmp_path_factory.mktemp("bpe")
    run_tool("train_tokenizer.py", "--input", corpus_file, "--output-dir", directory, "--type", "bpe", "--vocab-size", 600)
    return str(directory)


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory, corpus_file):
    require_module("sentencepiece")
    directory = tmp_path_factory.mktemp("spm")
    run_tool("train_tokenizer.py", "--input", corpus_file, "--output-dir", directory, "--type", "sentencepiece",
             "--vocab-size", 500, "--threads", 1)
    return str(directory / "tokenizer.model")


@pytest.fixture(scope="session")
def gpt2_args(bpe_dir):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(bpe_dir, "vocab.json"),
            "--merge-file", os.path.join(bpe_dir, "merges.txt")]


@pytest.fixture(scope="session")
def gpt2_dataset(tmp_path_factory, corpus_file, gpt2_args):
    """The corpus preprocessed with the BPE tokenizer and --append-eod; returns the dataset prefix."""
    prefix = tmp_path_factory.mktemp("gpt2_data") / "corpus"
    run_tool("preprocess_data.py", "--input", corpus_file, "--output-prefix", prefix, "--append-eod", "--workers", 2,
             *gpt2_args)
    return f"{prefix}_text_document"


@pytest.fixture(scope="session")
def tool():
    """`tool("preprocess_data.py", *args, check=True)` runs a script under tools/ in a subprocess."""
    return run_tool


@pytest.fixture(scope="session")
def document_generator():
    """`document_generator(count, seed=0)`: deterministic multi-sentence documents."""
    return generate_documents


@pytest.fixture(scope="session")
def jsonl_writer():
    """`jsonl_writer(path, documents, key="text")` writes one JSON object per document."""
    return write_jsonl
