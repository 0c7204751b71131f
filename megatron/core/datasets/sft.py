"""Supervised fine-tuning data (`--sft`): JSONL conversations, assistant-only loss, packed sequences.

Format (Megatron-LM's): each line is a JSON object whose "messages" is a list of
{"role": "system" | "user" | "assistant", "content": str} turns. A line may hold several
conversations one after the other; each system turn starts a new one.

A conversation becomes tokens plus an assistant mask (`tokenize_conversation`): the prompt format
renders it turn by turn, and the tokens of assistant turns (their text and the end-of-turn marker
the format writes after them, not the header that announces them) are marked. An end-of-document
token closes every conversation. A conversation of n tokens gives n - 1 (input, label) pairs:
inputs t[0..n-2], labels t[1..n-1], and the loss mask of pair j is the mask of its label t[j+1].

Packing (`pack_first_fit`): conversations, in file order, go into sequences of --seq-length pairs
by greedy first fit: each into the first sequence with room, else into a new one. Each one keeps
its own document id (attention stays within it: the document mask the model builds from
`document_ids`) and its positions restart at 0. With context parallelism every conversation is
padded to a multiple of 2 x CP pairs, so each is cut evenly by the load-balanced split. A
conversation longer than --seq-length is truncated to it (counted and reported), or is an error
naming its file and line with --sft-no-truncation.
"""
import json
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

ROLES = ("system", "user", "assistant")
# Megatron-LM's names that apply to any Hugging Face tokenizer, and ours: "default" is Megatron-LM's
# name for the tokenizer's own template, "chat-template" ours for the same.
PROMPT_FORMATS = ("chat-template", "default", "identity")
# Megatron-LM's formats written for one model family's special tokens.
FAMILY_PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "gemma")


class SFTDataError(ValueError):
    """A bad line of an SFT file; the message names the file and the line."""


@dataclass(frozen=True)
class Conversation:
    """One conversation's turns and where it came from (for error messages)."""

    messages: tuple
    path: str
    line: int


@dataclass(frozen=True)
class Tokenized:
    """tokens [n] and assistant [n]: whether each token is an assistant token (int64 and bool from
    JSONL; views of the preprocessed files' uint16/int32 and uint8)."""

    tokens: np.ndarray
    assistant: np.ndarray
    path: str
    line: int


def check_prompt_format(prompt_format: str) -> None:
    if prompt_format in FAMILY_PROMPT_FORMATS:
        raise ValueError(f"`sft_tokenizer_prompt_format` {prompt_format} is written for one model family's special "
                         "tokens and is not built here; use chat-template (the tokenizer's own chat_template) or "
                         "identity (the turns' text, one after the other)")
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"`sft_tokenizer_prompt_format` must be one of {', '.join(PROMPT_FORMATS)}, "
                         f"got {prompt_format!r}")


# ------------------------------------------------------------------------------------------------
# Reading

def _line_error(path: str, line: int, what: str) -> SFTDataError:
    return SFTDataError(f"{path}:{line}: {what} (fix or remove the line, or pass --sft-skip-bad-lines to skip "
                        "such lines and count them)")


def parse_line(text: str, path: str, line: int) -> List[Conversation]:
    """The conversations of one JSONL line; raises SFTDataError naming path:line."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise _line_error(path, line, f"not JSON ({error.msg})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise _line_error(path, line, 'no "messages" list of {"role", "content"} turns')
    for number, turn in enumerate(messages):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ROLES:
            raise _line_error(path, line, f"turn {number} has role {role!r}; roles are {', '.join(ROLES)}")
        content = turn.get("content")
        if not isinstance(content, str) or not content.strip():
            raise _line_error(path, line, f"turn {number} ({role}) has empty or non-text content")
    return [Conversation(tuple(turns), path, line) for turns in split_conversations(messages)]


def split_conversations(messages: Sequence[dict]) -> List[list]:
    """Megatron-LM's rule: every system turn starts a new conversation."""
    conversations = []
    for turn in messages:
        if turn["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append({"role": turn["role"], "content": turn["content"]})
    return conversations


def read_conversations(path: str, skip_bad_lines: bool = False) -> Tuple[List[Conversation], int]:
    """All conversations of a JSONL file, and how many bad lines were skipped (skip_bad_lines)."""
    conversations, skipped = [], 0
    with open(path, encoding="utf-8") as file:
        for line, text in enumerate(file, start=1):
            if not text.strip():
                continue
            try:
                conversations.extend(parse_line(text, path, line))
            except SFTDataError:
                if not skip_bad_lines:
                    raise
                skipped += 1
    return conversations, skipped


# ------------------------------------------------------------------------------------------------
# Tokenizing

def _pieces_identity(messages: Sequence[dict]) -> List[Tuple[str, bool]]:
    """Megatron-LM's identity format: the turns' text, one after the other, nothing around it."""
    return [(turn["content"], turn["role"] == "assistant") for turn in messages]


def _pieces_chat_template(messages: Sequence[dict], render) -> List[Tuple[str, bool]]:
    """The text the chat template renders, cut at turn boundaries. An assistant turn is split where
    the template's generation prompt ends: the header before it is prompt (not trained on), the
    rest (the answer and the template's end-of-turn text) is trained on, which is exactly what the
    model writes when `transformers` generates with add_generation_prompt=True."""
    pieces, previous = [], ""
    for index, turn in enumerate(messages):
        if turn["role"] == "assistant":
            header = render(messages[:index], True)
            pieces.append((_extension(previous, header, index), False))
            previous = header
        text = render(messages[:index + 1], False)
        pieces.append((_extension(previous, text, index), turn["role"] == "assistant"))
        previous = text
    return pieces


def _extension(previous: str, text: str, index: int) -> str:
    if not text.startswith(previous):
        raise ValueError(f"the chat template does not render conversations turn by turn: adding turn {index} "
                         "changes the text before it, so the assistant tokens cannot be told apart; use "
                         "`sft_tokenizer_prompt_format` identity or a template that only appends")
    return text[len(previous):]


def tokenize_conversation(messages: Sequence[dict], tokenizer, prompt_format: str) -> Tuple[np.ndarray, np.ndarray]:
    """tokens [n] (int64) and assistant [n] (bool) of one conversation, closed by the EOD token (which
    is trained on when the conversation ends with an assistant turn)."""
    if prompt_format == "identity":
        pieces = _pieces_identity(messages)
    else:
        pieces = _pieces_chat_template(messages, tokenizer.render_chat)
    tokens, assistant = [], []
    for text, trained in pieces:
        ids = tokenizer.encode_text(text)
        tokens.extend(ids)
        assistant.extend([trained] * len(ids))
    if not tokens or tokens[-1] != tokenizer.eod:
        tokens.append(tokenizer.eod)
        assistant.append(messages[-1]["role"] == "assistant")
    return np.asarray(tokens, dtype=np.int64), np.asarray(assistant, dtype=bool)


def check_chat_tokenizer(tokenizer, prompt_format: str) -> None:
    """The prompt format's needs of the tokenizer, checked at startup."""
    check_prompt_format(prompt_format)
    if not hasattr(tokenizer, "encode_text"):
        raise ValueError(f"`sft` needs `tokenizer_type` HuggingFaceTokenizer (got {type(tokenizer).__name__}): "
                         "conversations are tokenized turn by turn without added special tokens")
    if prompt_format != "identity" and not tokenizer.chat_template:
        raise ValueError(f"`sft_tokenizer_prompt_format` {prompt_format}: the tokenizer of `tokenizer_model` "
                         f"{tokenizer.name_or_path} has no chat_template (tokenizer_config.json or "
                         "chat_template.jinja); add one, or use `sft_tokenizer_prompt_format` identity")


# ------------------------------------------------------------------------------------------------
# Packing

def pair_count(tokenized: Tokenized) -> int:
    """(input, label) pairs of a conversation: one fewer than its tokens."""
    return len(tokenized.tokens) - 1


def padded_length(length: int, cp_size: int) -> int:
    """A conversation's length in a packed sequence: with context parallelism a multiple of 2 x CP,
    so the load-balanced split cuts every conversation evenly (as Megatron-LM pads)."""
    granularity = 2 * cp_size if cp_size > 1 else 1
    return -(-length // granularity) * granularity


def pack_first_fit(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Greedy first fit in the given order: each item goes into the first bin with room for it,
    else into a new bin. lengths are at most capacity. Returns the item indices of each bin.

    The first bin with room is found in O(log bins) by descending a tree of the bins' largest free
    space (leaves: bins, each node the max of its children; unopened bins count as empty, with the
    full capacity): 200,000 conversations pack in a few seconds of Python."""
    leaves = 1
    while leaves < max(len(lengths), 1):
        leaves *= 2
    free = [capacity] * (2 * leaves)  # free[leaves + b]: room left in bin b (a list: scalar access is its use)
    bins: List[List[int]] = []
    for item, length in enumerate(lengths):
        node = 1
        while node < leaves:  # the leftmost child with room; the root always has room (an unopened bin)
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        target = node - leaves
        if target == len(bins):
            bins.append([])
        bins[target].append(item)
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


@dataclass
class PackStats:
    conversations: int = 0
    truncated: int = 0
    sequences: int = 0
    pairs: int = 0
    trained_pairs: int = 0


class PackedConversations:
    """The packed sequences of one list of tokenized conversations.

    Sample i: tokens, labels, position_ids, document_ids [seq_length] (int64) and loss_mask
    [seq_length] (float32)."""

    def __init__(self, conversations: Sequence[Tokenized], seq_length: int, cp_size: int = 1,
                 truncate: bool = True, pad_token: int = 0):
        self.seq_length = seq_length
        self.cp_size = cp_size
        self.pad_token = pad_token
        self.stats = PackStats(conversations=len(conversations))
        self.conversations = [self._fit(conversation, truncate) for conversation in conversations]
        lengths = [padded_length(pair_count(c), cp_size) for c in self.conversations]
        self.bins = pack_first_fit(lengths, seq_length)
        self.stats.sequences = len(self.bins)
        self.stats.pairs = sum(pair_count(c) for c in self.conversations)
        self.stats.trained_pairs = int(sum(c.assistant[1:].sum() for c in self.conversations))

    def _fit(self, conversation: Tokenized, truncate: bool) -> Tokenized:
        if pair_count(conversation) <= self.seq_length:
            return conversation
        if not truncate:
            raise SFTDataError(f"{conversation.path}:{conversation.line}: a conversation of {len(conversation.tokens)} "
                               f"tokens is longer than --seq-length ({self.seq_length}) + 1; shorten it, raise "
                               "--seq-length, or drop --sft-no-truncation to truncate it on the right")
        self.stats.truncated += 1
        keep = self.seq_length + 1
        return Tokenized(conversation.tokens[:keep], conversation.assistant[:keep], conversation.path,
                         conversation.line)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict:
        return pack_sequence([self.conversations[c] for c in self.bins[index]], self.seq_length, self.cp_size,
                             self.pad_token)


def conversation_pairs(conversation: Tokenized) -> dict:
    """One conversation's (input, label) pairs [n - 1]: the loss mask of a pair is whether its label
    is an assistant token."""
    return {"tokens": conversation.tokens[:-1], "labels": conversation.tokens[1:],
            "loss_mask": conversation.assistant[1:].astype(np.float32)}


def pack_sequence(conversations: Sequence[Tokenized], seq_length: int, cp_size: int, pad_token: int) -> dict:
    """Conversations side by side in one sequence of seq_length pairs, each with its own document id
    and positions from 0, padded (no loss) to a multiple of 2 x CP; the rest is padding with a
    document id of its own."""
    sample = {"tokens": np.full(seq_length, pad_token, dtype=np.int64),
              "labels": np.full(seq_length, pad_token, dtype=np.int64),
              "loss_mask": np.zeros(seq_length, dtype=np.float32),
              "position_ids": np.zeros(seq_length, dtype=np.int64),
              "document_ids": np.zeros(seq_length, dtype=np.int64)}
    start = 0
    for document, conversation in enumerate(conversations):
        pairs = conversation_pairs(conversation)
        length = len(pairs["tokens"])
        span = padded_length(length, cp_size)
        for key, values in pairs.items():
            sample[key][start:start + length] = values
        sample["position_ids"][start:start + span] = np.arange(span)
        sample["document_ids"][start:start + span] = document
        start += span
    tail = seq_length - start
    sample["position_ids"][start:] = np.arange(tail)
    sample["document_ids"][start:] = len(conversations)
    return sample


# ------------------------------------------------------------------------------------------------
# Datasets

@dataclass
class SFTDatasetConfig:
    """What the SFT datasets need; field names follow the flags."""

    seq_length: int
    seed: int
    data_path: Optional[List[str]] = None
    split: str = "969,30,1"
    train_data_path: Optional[List[str]] = None
    valid_data_path: Optional[List[str]] = None
    test_data_path: Optional[List[str]] = None
    prompt_format: str = "chat-template"
    context_parallel_size: int = 1
    truncate: bool = True
    skip_bad_lines: bool = False


class SFTDataset:
    """num_samples packed sequences drawn from one or more sources (packed conversations of one
    file's split), blended by weight as Megatron blends `.bin/.idx` datasets; each source is read
    epoch after epoch, in a fresh order per epoch drawn from the seed."""

    def __init__(self, sources: Sequence[PackedConversations], weights: Sequence[float], num_samples: int, seed: int):
        from megatron.core.datasets.blended_dataset import normalize
        from megatron.core.datasets.helpers import build_blending_indices

        self.sources = list(sources)
        self.num_samples = int(num_samples)
        self.seed = seed
        self._orders = {}  # source -> (epoch, its order of the source's sequences)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(
            np.asarray(normalize(weights), dtype=np.float64), self.num_samples)

    def __len__(self) -> int:
        return self.num_samples

    def _source_index(self, source: int, index: int) -> int:
        size = len(self.sources[source])
        epoch, within = divmod(int(index), size)
        if self._orders.get(source, (None,))[0] != epoch:  # one permutation per source and epoch, kept
            order = np.random.RandomState((self.seed + 1000 * source + epoch) % 2**32).permutation(size)
            self._orders[source] = (epoch, order)
        return int(self._orders[source][1][within])

    def __getitem__(self, index: int) -> dict:
        source = int(self.dataset_index[index])
        return self.sources[source][self._source_index(source, self.dataset_sample_index[index])]


def split_sources(config: SFTDatasetConfig) -> List[Optional[Tuple[List[str], Optional[List[float]], Optional[Tuple]]]]:
    """For each of train/valid/test: (files, weights, book-end of the split or None when used whole),
    or None when the split has no data."""
    from megatron.core.datasets.gpt_dataset_builder import parse_data_path, parse_split, split_matrix

    per_split = (config.train_data_path, config.valid_data_path, config.test_data_path)
    if any(per_split):
        return [(*parse_data_path(paths, flag), None) if paths else None
                for paths, flag in zip(per_split, ("--train-data-path", "--valid-data-path", "--test-data-path"))]
    if not config.data_path:
        raise ValueError("`sft` needs `data_path` (JSONL files) or `train_data_path` / `valid_data_path` / "
                         "--test-data-path")
    files, weights = parse_data_path(config.data_path)
    return [(files, weights, bookend) if bookend else None for bookend in split_matrix(parse_split(config.split))]


def load_tokenized(path: str, tokenizer, config: SFTDatasetConfig, log=print) -> List[Tokenized]:
    """A JSONL file's conversations, tokenized; skipped bad lines are counted in the log."""
    conversations, skipped = read_conversations(path, config.skip_bad_lines)
    if config.skip_bad_lines:
        log(f"> sft {path}: {skipped} bad lines skipped (--sft-skip-bad-lines)")
    tokenized = []
    for conversation in conversations:
        tokens, assistant = tokenize_conversation(conversation.messages, tokenizer, config.prompt_format)
        tokenized.append(Tokenized(tokens, assistant, conversation.path, conversation.line))
    return tokenized


def mask_prefix(tokens_prefix: str) -> str:
    """Where tools/preprocess_sft.py writes the assistant mask of a tokens dataset."""
    return tokens_prefix + "_assistant"


def is_jsonl(path: str) -> bool:
    return path.endswith((".jsonl", ".json"))


def load_indexed(prefix: str) -> List[Tokenized]:
    """Conversations tokenized by tools/preprocess_sft.py: tokens and assistant mask as views into
    the memory-mapped files (uint16/int32 and uint8; samples are assembled in int64). A conversation
    is named prefix:N (its 1-based number) in messages."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokens, masks = IndexedDataset(prefix), IndexedDataset(mask_prefix(prefix))
    if not np.array_equal(tokens.sequence_lengths, masks.sequence_lengths):
        raise ValueError(f"`sft`: {mask_prefix(prefix)}.idx does not match {prefix}.idx (other sequence lengths); "
                         "write both again with tools/preprocess_sft.py")
    return [Tokenized(tokens[index], masks[index], prefix, index + 1) for index in range(len(tokens))]


def load_conversations(path: str, tokenizer, config: SFTDatasetConfig, log=print) -> List[Tokenized]:
    """A --data-path entry: a JSONL file (tokenized now) or the prefix of tools/preprocess_sft.py's output."""
    return load_tokenized(path, tokenizer, config, log) if is_jsonl(path) else load_indexed(path)


def build_sft_datasets(config: SFTDatasetConfig, tokenizer, num_samples: Sequence[int], log=print):
    """(train, valid, test) SFTDatasets, each None when its split is empty or asked for 0 samples.
    Every rank reads and tokenizes the files itself (the JSONL path is meant for sets small enough
    for that); the result is the same on every rank."""
    from megatron.core.datasets.gpt_dataset_builder import split_range

    check_chat_tokenizer(tokenizer, config.prompt_format)
    pad_token = tokenizer.pad if getattr(tokenizer, "pad", None) is not None else tokenizer.eod
    cache, datasets = {}, []
    for name, source, samples in zip(("train", "valid", "test"), split_sources(config), num_samples):
        if source is None or not samples:
            datasets.append(None)
            continue
        files, weights, bookend = source
        packed = []
        for path in files:
            if path not in cache:
                cache[path] = load_conversations(path, tokenizer, config, log)
            conversations = cache[path]
            if bookend is not None:
                begin, end = split_range(bookend, len(conversations))
                conversations = conversations[begin:end]
            packed.append(PackedConversations(conversations, config.seq_length, config.context_parallel_size,
                                              config.truncate, pad_token))
        if not any(len(p) for p in packed):
            datasets.append(None)
            continue
        kept = [(p, w) for p, w in zip(packed, weights or [len(p) for p in packed]) if len(p)]
        log(_stats_line(name, [p.stats for p, _ in kept], config.seq_length))
        datasets.append(SFTDataset([p for p, _ in kept], [w for _, w in kept], samples, config.seed))
    return tuple(datasets)


def _stats_line(name: str, stats: Sequence[PackStats], seq_length: int) -> str:
    conversations = sum(s.conversations for s in stats)
    sequences = sum(s.sequences for s in stats)
    pairs = sum(s.pairs for s in stats)
    return (f"> sft {name}: {conversations} conversations packed into {sequences} sequences of {seq_length} "
            f"({100.0 * pairs / max(sequences * seq_length, 1):.1f}% filled, "
            f"{sum(s.trained_pairs for s in stats)} assistant tokens trained on); "
            f"{sum(s.truncated for s in stats)} conversations truncated to --seq-length")
