"""Which tokenizer wrote a dataset: `<prefix>.tokenizer.json` beside `<prefix>.bin/.idx`.

`tools/preprocess_data.py` writes it (Megatron-LM's readers ignore it); training compares it with
the tokenizer of the run and stops, naming both, when they differ. A dataset without the file (as
Megatron-LM writes them) is only checked against the vocabulary size (`check_vocab`).

The record holds the tokenizer type, its vocabulary size, its end-of-document id and a SHA-256 of
its files (for a Hugging Face directory: its tokenizer files only, never model weights), so a copy
of the same tokenizer elsewhere matches and an edited one does not.
"""
import hashlib
import json
import os
from typing import Optional

SUFFIX = ".tokenizer.json"
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                       "vocab.json", "merges.txt", "vocab.txt")


def record_path(prefix: str) -> str:
    return prefix + SUFFIX


def _digest(paths: list) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def tokenizer_record(tokenizer, tokenizer_type: str, *, vocab_file: Optional[str] = None,
                     merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None) -> dict:
    """What identifies `tokenizer` (built from these flags)."""
    files = [path for path in (vocab_file, merge_file, tokenizer_model) if path and os.path.isfile(path)]
    if tokenizer_model and os.path.isdir(tokenizer_model):
        files += [os.path.join(tokenizer_model, name) for name in _HF_TOKENIZER_FILES
                  if os.path.isfile(os.path.join(tokenizer_model, name))]
    return {"tokenizer_type": tokenizer_type, "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod),
            "files_sha256": _digest(files) if files else None}


def write_record(prefix: str, record: dict) -> None:
    with open(record_path(prefix), "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)


def read_record(prefix: str) -> Optional[dict]:
    path = record_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is corrupt ({error}); delete it (the dataset is then checked against the "
                         "vocabulary size only) or re-run tools/preprocess_data.py") from None


def check_record(prefix: str, current: Optional[dict]) -> None:
    """Raises ValueError naming both tokenizers when `prefix` records another one than `current`."""
    saved = read_record(prefix)
    if saved is None or current is None:
        return
    differences = [key for key in ("tokenizer_type", "vocab_size", "eod", "files_sha256")
                   if saved.get(key) != current[key]]
    if not differences:
        return

    def describe(record: dict) -> str:
        files = record.get("files_sha256")
        return (f"{record.get('tokenizer_type')} (vocabulary {record.get('vocab_size')}, end-of-document id "
                f"{record.get('eod')}" + (f", files sha256 {files[:12]}" if files else "") + ")")
    raise ValueError(f"{prefix} was written with the tokenizer {describe(saved)}, and this run uses "
                     f"{describe(current)}: they differ in {', '.join(differences)}. Train with the tokenizer the "
                     f"data was written with, or re-run tools/preprocess_data.py with this one (delete "
                     f"{record_path(prefix)} to skip this check)")
