"""Training beside `transformers`: the same AdamW steps on the same batch, our model with our
optimizer against the Hugging Face model with torch.optim.AdamW (lr 1e-3, no weight decay, no
clipping). Shared by the per-family parity tests (tests/unit/test_hf_moe.py, test_falcon.py,
test_mla.py)."""
import torch

from megatron.core import parallel_state


def assert_training_tracks_transformers(hf, ours, vocab_size: int, batch: int, seq: int, steps: int = 5) -> None:
    """`steps` steps on one fixed batch (so the loss falls); the losses agree at rtol 1e-4."""
    from megatron.core.distributed.ddp import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    hf.train()
    ours.train()
    chunk = DistributedDataParallel(ours, parallel_state.single_process())
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0, adam_beta2=0.95),
                                       [chunk], parallel_state.single_process())
    reference = torch.optim.AdamW(hf.parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    tokens = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(3))
    labels = torch.cat((tokens[:, 1:], torch.zeros_like(tokens[:, :1])), dim=1)
    ours_losses, hf_losses = [], []
    for _ in range(steps):
        chunk.zero_grad_buffer()
        loss = chunk(tokens, torch.arange(seq).expand(batch, seq), labels=labels)[:, :-1].mean()
        loss.backward()
        finalize_model_grads([chunk], parallel_state.single_process())
        assert optimizer.step()[0]
        reference.zero_grad()
        hf_loss = hf(input_ids=tokens, labels=tokens).loss
        hf_loss.backward()
        reference.step()
        ours_losses.append(loss.item())
        hf_losses.append(hf_loss.item())
    assert hf_losses[-1] < hf_losses[0] - 0.05, "training must move the loss for the comparison to mean anything"
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(hf_losses), rtol=1e-4, atol=0)
