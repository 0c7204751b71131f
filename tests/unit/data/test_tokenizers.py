"""Our tokenizers against the reference libraries (tokenizers, transformers, sentencepiece) on the same files."""
import os
import shutil

import pytest

from megatron.core.tokenizers import GPT2BPETokenizer, build_tokenizer

from tests.optional import require_module

tokenizers_lib = require_module("tokenizers")
transformers = require_module("transformers")
sentencepiece = require_module("sentencepiece")

EXTRA_TEXTS = ["", " ", "  leading and trailing  ", "line\n\nbreaks\r\n\ttabs", "<|endoftext|> is plain text here",
               "unseen characters: ∮ ⅋ 𝔘 ñ", "x's we'll THEY'RE 1234567890", "😀" * 5]


@pytest.fixture(scope="module")
def texts(documents):
    return documents[:150] + EXTRA_TEXTS


def gpt2(bpe_dir, **kwargs):
    return GPT2BPETokenizer(os.path.join(bpe_dir, "vocab.json"), os.path.join(bpe_dir, "merges.txt"), **kwargs)


def test_gpt2_bpe_matches_tokenizers_library(bpe_dir, texts):
    # The reference is the trainer's own tokenizer.json, loaded by the Rust library.
    reference = tokenizers_lib.Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(bpe_dir, "vocab.json"),
                           merge_file=os.path.join(bpe_dir, "merges.txt"))
    for text in texts:
        if "<|endoftext|>" in text:
            continue  # tokenizer.json parses the special token; vocab+merges (as Megatron) do not
        assert ours.tokenize(text) == reference.encode(text, add_special_tokens=False).ids, text
    assert ours.tokenize_batch(texts) == [ours.tokenize(text) for text in texts]


def test_gpt2_bpe_matches_transformers_and_pure_python(bpe_dir, texts, tmp_path):
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(os.path.join(bpe_dir, name), tmp_path / name)
    reference = transformers.GPT2Tokenizer.from_pretrained(str(tmp_path))
    library, python = gpt2(bpe_dir, backend="library"), gpt2(bpe_dir, backend="python")
    for text in texts:
        expected = reference(text, add_special_tokens=False).input_ids
        if "<|endoftext|>" not in text:
            assert library.tokenize(text) == expected, text
        assert python.tokenize(text) == library.tokenize(text), text
        assert library.detokenize(library.tokenize(text)) == text
        assert python.detokenize(python.tokenize(text)) == text


def test_gpt2_bpe_special_ids(bpe_dir):
    tokenizer = gpt2(bpe_dir)
    reference = tokenizers_lib.Tokenizer.from_file(os.path.join(bpe_dir, "tokenizer.json"))
    assert tokenizer.eod == reference.token_to_id("<|endoftext|>") == tokenizer.eos
    assert tokenizer.bos is None
    assert tokenizer.vocab_size == reference.get_vocab_size()


def test_huggingface_tokenizer_matches_transformers(bpe_dir, texts):
    reference = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    for model in (bpe_dir, os.path.join(bpe_dir, "tokenizer.json")):
        ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model)
        assert ours.vocab_size == len(reference)
        assert ours.eod == reference.convert_tokens_to_ids("<|endoftext|>")
        for text in texts:
            assert ours.tokenize(text) == reference(text).input_ids, text
        assert ours.tokenize_batch(texts) == [ours.tokenize(text) for text in texts]
        assert ours.detokenize(ours.tokenize("hello world")) == "hello world"


def test_huggingface_llama3_pattern(corpus_file, tmp_path, texts, tool):
    tool("train_tokenizer.py", "--input", corpus_file, "--output-dir", tmp_path, "--vocab-size", 500, "--pattern", "llama3")
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    reference = tokenizers_lib.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in texts:
        assert ours.tokenize(text) == reference.encode(text).ids, text
    assert ours.bos == reference.token_to_id("<|begin_of_text|>")


def test_huggingface_missing_path_and_unreachable_hub(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "no-such-dir"))

    def unreachable_hub(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable_hub)
    with pytest.raises(ValueError, match="pass the local directory"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="someone/not-a-real-tokenizer-xyz")


def test_llama2_tokenizer_matches_sentencepiece(sentencepiece_model, texts):
    reference = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    ours = build_tokenizer("Llama2Tokenizer", tokenizer_model=sentencepiece_model)
    assert (ours.vocab_size, ours.bos, ours.eos, ours.eod) == (reference.vocab_size(), 1, 2, 2)
    for text in texts:
        assert ours.tokenize(text) == [reference.bos_id()] + reference.encode(text), text
        assert ours.detokenize(ours.tokenize(text)) == reference.decode(reference.encode(text))
    assert ours.tokenize_batch(texts) == [ours.tokenize(text) for text in texts]


def test_sentencepiece_tokenizer_special_tokens(sentencepiece_model):
    reference = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sentencepiece_model, vocab_extra_ids=3)
    base = reference.vocab_size()
    # <CLS> <SEP> <EOD> <MASK> are appended; the model has bos/eos, no pad -> <PAD>; then 3 extra ids.
    assert ours.vocab_size == base + 4 + 1 + 3
    assert ours.eod == base + 2
    assert (ours.bos, ours.eos) == (reference.bos_id(), reference.eos_id())
    assert ours.tokenize("the fox") == reference.encode("the fox")
    assert ours.tokenize("the fox<EOD>a dog") == reference.encode("the fox") + [ours.eod] + reference.encode("a dog")
    assert ours.detokenize(ours.tokenize("the fox<EOD>a dog")) == "the fox<EOD>a dog"


def test_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tokenizer.tokenize("5 17  3\n99") == [5, 17, 3, 99]
    assert (tokenizer.vocab_size, tokenizer.eod) == (101, 100)  # Megatron: N ids plus the EOD
    assert tokenizer.tokenize("100") == [tokenizer.eod]
    assert tokenizer.detokenize([1, 2]) == "1 2"
    with pytest.raises(ValueError, match="--vocab-size 100"):
        tokenizer.tokenize("101")
    with pytest.raises(ValueError, match="integers"):
        tokenizer.tokenize("hello")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_build_errors_name_the_flag(tmp_path, bpe_dir):
    with pytest.raises(ValueError, match="--tokenizer-type 'Nope'"):
        build_tokenizer("Nope")
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(bpe_dir, "vocab.json"))
    missing = str(tmp_path / "missing.model")
    with pytest.raises(FileNotFoundError, match="missing.model"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=missing)
    not_a_model = tmp_path / "bad.model"
    not_a_model.write_text("not a model")
    with pytest.raises(ValueError, match="bad.model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(not_a_model))
    bad_vocab = tmp_path / "vocab.json"
    bad_vocab.write_text('{"a": 0}')
    with pytest.raises(ValueError, match="<\\|endoftext\\|>"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(bad_vocab), merge_file=os.path.join(bpe_dir, "merges.txt"))
