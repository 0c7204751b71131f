"""Compare a checkpoint of this framework with a Hugging Face model on the same tokens.

    python tools/verify_correctness.py --hf ./Llama-3.2-1B --checkpoint ./checkpoints/llama1b --text "The capital of France is"
    python tools/verify_correctness.py --hf ./run1-hf --checkpoint ./checkpoints/run1 --data-path my_text_document --num-samples 4

Runs both models in fp32 on the CPU (one process) and prints the largest absolute difference of
their logits over the real (unpadded) vocabulary and the loss of each on the next tokens.
With --tolerance, exits 1 when the logits differ by more.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.core.models.gpt import GPTModel, families  # noqa: E402
from megatron.core.models.gpt.hf_mapping import load_logical_into_model  # noqa: E402
from megatron.core.parallel_state import single_process  # noqa: E402
from megatron.core.checkpointing import conversion  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--hf", required=True, help="local Hugging Face model directory (config.json + weights)")
    parser.add_argument("--checkpoint", required=True, help="this framework's --save directory or iter_NNNNNNN directory")
    parser.add_argument("--iteration", type=int, default=None, help="iteration to read (default: latest)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="text to run, tokenized with --tokenizer (default: the --hf directory's tokenizer)")
    source.add_argument("--data-path", help="a .bin/.idx prefix: run its first --num-samples windows of --seq-length")
    parser.add_argument("--tokenizer", default=None, help="local Hugging Face tokenizer directory for --text")
    parser.add_argument("--num-samples", type=int, default=2, help="windows of --data-path to run")
    parser.add_argument("--seq-length", type=int, default=128, help="tokens per window of --data-path")
    parser.add_argument("--tolerance", type=float, default=None, help="exit 1 if max |logit difference| exceeds this")
    return parser.parse_args(argv)


def tokens_of(args) -> torch.Tensor:
    """[b, s+1] token ids: the inputs and, shifted by one, the labels."""
    if args.text is not None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer or args.hf, local_files_only=True)
        ids = tokenizer(args.text)["input_ids"]
        if len(ids) < 2:
            raise SystemExit("error: --text must give at least 2 tokens")
        return torch.tensor([ids])
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(args.data_path)
    needed = args.num_samples * (args.seq_length + 1)
    stream, index = [], 0
    while len(stream) < needed and index < len(dataset):
        stream.extend(dataset[index].tolist())
        index += 1
    if len(stream) < needed:
        raise SystemExit(f"error: {args.data_path} holds {len(stream)} tokens, fewer than --num-samples x "
                         f"(--seq-length + 1) = {needed}")
    return torch.tensor(stream[:needed]).view(args.num_samples, args.seq_length + 1)


def compare(argv=None) -> dict:
    args = parse(argv)
    import transformers

    # The model class of the family that claims the directory's config (none: one error listing
    # the families there are).
    family = families.of_hf_config(transformers.AutoConfig.from_pretrained(args.hf, local_files_only=True))
    hf_model = getattr(transformers, family.architecture).from_pretrained(
        args.hf, local_files_only=True, dtype=torch.float32, attn_implementation="eager").eval()
    logical, config, vocab_size, _ = conversion.read_weights(args.checkpoint, args.iteration)
    vocab_size = vocab_size or config.padded_vocab_size  # not recorded (a Megatron-LM import): the padded size
    model = GPTModel(config, single_process())
    load_logical_into_model(model, logical)
    model = model.float().eval()
    window = tokens_of(args)
    if int(window.max()) >= vocab_size:
        raise SystemExit(f"error: token id {int(window.max())} is outside the vocabulary of {vocab_size}")
    tokens, labels = window[:, :-1], window[:, 1:]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        ours = model(tokens, positions).transpose(0, 1)[..., :vocab_size].float()  # [b, s, V]
        theirs = hf_model(tokens).logits[..., :vocab_size].float()
    result = {
        "max_logit_difference": (ours - theirs).abs().max().item(),
        "loss": F.cross_entropy(ours.reshape(-1, vocab_size), labels.reshape(-1)).item(),
        "hf_loss": F.cross_entropy(theirs.reshape(-1, vocab_size), labels.reshape(-1)).item(),
        "tokens": tokens.numel(),
    }
    print(f"max |logit difference|: {result['max_logit_difference']:.3e} "
          f"({tokens.shape[0]} x {tokens.shape[1]} tokens, vocabulary {vocab_size})")
    print(f"loss (this framework): {result['loss']:.6f}")
    print(f"loss (Hugging Face):   {result['hf_loss']:.6f}")
    return result


if __name__ == "__main__":
    try:
        outcome = compare()
    except ImportError as error:
        raise SystemExit(f"error: this comparison needs the `hf` extra, which is not installed ({error}): "
                         'pip install -e ".[hf]" (transformers, safetensors, tokenizers, sentencepiece)') from None
    tolerance = parse().tolerance
    if tolerance is not None and outcome["max_logit_difference"] > tolerance:
        print(f"FAIL: the logits differ by more than --tolerance {tolerance}")
        sys.exit(1)
