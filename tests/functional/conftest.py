"""A real corpus, tokenizer and .bin/.idx dataset for end-to-end runs (the data tests' fixtures)."""
from tests.unit.data.conftest import bpe_dir, corpus_file, documents, gpt2_args, gpt2_dataset  # noqa: F401
