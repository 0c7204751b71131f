"""Run in a subprocess with Megatron-Core 0.16.1 on PYTHONPATH (tests/unit/test_deepseek_v3.py):
for each case of argv[1] (JSON), Megatron-Core's YaRN frequencies (YarnRotaryEmbedding's angles at
position 1), its concentration factor, and MLASelfAttention's softmax-scale factor
(mscale(factor, mscale_all_dim)^2). Prints them as JSON."""
import json
import sys

import torch

torch.cuda.current_device = lambda: "cpu"  # the reference moves its tables to the GPU: here, the CPU

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (  # noqa: E402
    YarnRotaryEmbedding,
    _yarn_get_mscale,
)

results = []
for case in json.loads(sys.argv[1]):
    rope = YarnRotaryEmbedding(case["dim"], rotary_base=case["base"], use_cpu_initialization=True,
                               scaling_factor=case["factor"], original_max_position_embeddings=case["original"],
                               beta_fast=case["beta_fast"], beta_slow=case["beta_slow"], mscale=case["mscale"],
                               mscale_all_dim=case["mscale_all_dim"], correction_range_round_to_int=case["round"])
    angles, concentration = rope.get_emb(2)  # [2, 1, 1, dim]: position 1's angles are the frequencies
    results.append(dict(inv_freq=angles[1, 0, 0, : case["dim"] // 2].tolist(), concentration=concentration,
                        softmax=_yarn_get_mscale(case["factor"], case["mscale_all_dim"]) ** 2))
print(json.dumps(results))
