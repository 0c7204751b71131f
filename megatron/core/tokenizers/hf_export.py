"""The tokenizer of a run, written as a Hugging Face tokenizer beside an exported model.

A checkpoint records the run's tokenizer flags (`--tokenizer-type` and its files) with its
arguments. `export_tokenizer` rebuilds that tokenizer with `transformers` and saves it
(`tokenizer.json`, `tokenizer_config.json`, and `tokenizer.model` for SentencePiece), so that
`AutoTokenizer.from_pretrained(DIR)` and `pipeline("text-generation", model=DIR)` work on the
export, and returns the ids of the special tokens for `config.json` and `generation_config.json`:

| --tokenizer-type | written as | bos / eos / pad |
|---|---|---|
| GPT2BPETokenizer | GPT-2's byte-level BPE (vocab.json + merges.txt) | `<\\|endoftext\\|>` / the same / none (generation pads with eos) |
| Llama2Tokenizer | Llama's SentencePiece tokenizer (BOS prepended, as in training) | the model's bos / eos / pad (if any) |
| HuggingFaceTokenizer | the tokenizer itself, saved again | its own |

NullTokenizer (ids only) and Megatron's SentencePieceTokenizer (extra specials appended to the
model's vocabulary) have no Hugging Face equivalent: nothing is written and the caller says so.
"""
import os
import shutil
from dataclasses import dataclass
from typing import Optional

EXPORTABLE = ("GPT2BPETokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer")


@dataclass(frozen=True)
class SpecialIds:
    bos: Optional[int]
    eos: Optional[int]
    pad: Optional[int]


def _existing(path: Optional[str], flag: str, tokenizer_type: str) -> str:
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"the run's {flag} {path} (--tokenizer-type {tokenizer_type}) is not there")
    return path


def _build(data_args: dict, target: str):
    """The `transformers` tokenizer equal to the run's; raises FileNotFoundError for a missing file."""
    import transformers

    kind = data_args.get("tokenizer_type")
    if kind == "GPT2BPETokenizer":
        from megatron.core.tokenizers.gpt2_bpe import EOD_TOKEN, _LibraryByteLevelBPE

        bpe = _LibraryByteLevelBPE(_existing(data_args.get("vocab_file"), "--vocab-file", kind),
                                   _existing(data_args.get("merge_file"), "--merge-file", kind))
        return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer, bos_token=EOD_TOKEN,
                                                    eos_token=EOD_TOKEN, unk_token=EOD_TOKEN)
    if kind == "Llama2Tokenizer":
        model = _existing(data_args.get("tokenizer_model"), "--tokenizer-model", kind)
        os.makedirs(target, exist_ok=True)  # transformers converts a directory's tokenizer.model
        shutil.copyfile(model, os.path.join(target, "tokenizer.model"))
        return transformers.LlamaTokenizer.from_pretrained(target, add_bos_token=True, add_eos_token=False)
    model = _existing(data_args.get("tokenizer_model"), "--tokenizer-model", kind)
    return transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)


def export_tokenizer(data_args: dict, target: str) -> tuple:
    """(SpecialIds or None, a note for the user). Writes the tokenizer of a run with arguments
    `data_args` (the checkpoint's "data" arguments) into `target`."""
    kind = data_args.get("tokenizer_type")
    if kind not in EXPORTABLE:
        return None, (f"no tokenizer written: --tokenizer-type {kind} has no Hugging Face equivalent; "
                      "add your tokenizer's files to the directory to use it with AutoTokenizer")
    try:
        tokenizer = _build(data_args, target)
    except FileNotFoundError as error:
        return None, (f"no tokenizer written: {error}; run the conversion where the training run's tokenizer "
                      "files are (the paths are the ones the run was given)")
    tokenizer.save_pretrained(target)
    eos = tokenizer.eos_token_id
    return SpecialIds(bos=tokenizer.bos_token_id, eos=eos, pad=tokenizer.pad_token_id), f"wrote the {kind} tokenizer"


def set_special_ids(hf_config, ids: SpecialIds) -> None:
    """bos/eos/pad ids into a `transformers` config (Llama's defaults, 1 and 2, are wrong for
    most tokenizers)."""
    hf_config.bos_token_id, hf_config.eos_token_id, hf_config.pad_token_id = ids.bos, ids.eos, ids.pad


def write_generation_config(target: str, ids: SpecialIds) -> None:
    """generation_config.json with the tokenizer's ids; padding with eos when the tokenizer has no
    pad token (as `generate` would, but without its warning)."""
    import transformers

    transformers.GenerationConfig(bos_token_id=ids.bos, eos_token_id=ids.eos,
                                  pad_token_id=ids.pad if ids.pad is not None else ids.eos).save_pretrained(target)
