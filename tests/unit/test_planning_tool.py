"""tools/plan.py and the layout search: the CLI prints the plan and the ranked layouts for any
cluster from the run's flags, the search returns only layouts that divide the model and batch and
fit, and a throughput table measured by bench/bench_plan_table.py is read back."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.planning.hardware import cluster, load_table
from megatron.training.planning.layout import Layout
from megatron.training.planning.plan import make_plan
from megatron.training.planning.search import search
from tests.unit.test_planning_published import llama

ROOT = Path(__file__).resolve().parents[2]
LLAMA3_8B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
             "--num-query-groups 8 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
             "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --bf16 --vocab-size 128256 "
             "--seq-length 8192 --global-batch-size 64").split()


def plan_tool(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


def test_plan_for_the_flags_layout():
    result = plan_tool("--gpu", "h200", "--nodes", "2", "--", *LLAMA3_8B, "--micro-batch-size", "1",
                       "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer")
    assert result.returncode == 0, result.stderr
    assert "plan for 2 node(s) x 8 H200 SXM 141GB (16 GPUs used): TP2 PP1 CP1 DP8 mbs 1 SP dist-opt" in result.stdout
    assert "    activations " in result.stdout and "verdict: fits on H200" in result.stdout


def test_top_layouts_are_ranked_and_fit():
    result = plan_tool("--nodes", "1", "--top", "3", "--", *LLAMA3_8B, "--micro-batch-size", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("layouts of 8 H100 SXM 80GB GPUs (1 x 8) that fit, by predicted tokens/s (3 shown")
    rows = [line.split() for line in lines[2:5]]
    assert [row[0] for row in rows] == ["1", "2", "3"]
    throughput = [float(row[-2].replace(",", "")) for row in rows]
    assert throughput == sorted(throughput, reverse=True)
    assert "the best layout in detail:" in result.stdout


def test_a_layout_that_does_not_divide_the_cluster_is_one_clear_error():
    result = plan_tool("--nodes", "1", "--gpus-per-node", "6", "--", *LLAMA3_8B, "--micro-batch-size", "1",
                       "--tensor-model-parallel-size", "4")
    assert result.returncode == 1 and "TP x PP x CP = 4 does not divide the cluster's 6 GPUs" in result.stderr


def test_flags_missing_after_the_separator():
    result = plan_tool("--nodes", "1")
    assert result.returncode == 2 and "give the run's pretrain_gpt.py flags after `--`" in result.stderr


def test_search_only_returns_layouts_that_divide_and_fit():
    arch8 = llama(32, 4096, 32, 8, 14336, False)
    target = cluster("h100-80gb", nodes=2)
    base = Layout(tp=1, pp=1, cp=1, dp=16, micro_batch_size=1, global_batch_size=64, seq_length=8192)
    plans, tried = search(lambda tp: arch8, base, target, top=50)
    assert 0 < len(plans) <= 50 < tried
    for plan in plans:
        lay = plan.layout
        assert lay.world_size == 16 and plan.fits
        assert arch8.num_attention_heads % lay.tp == 0 and arch8.num_layers % (lay.pp * lay.vpp) == 0
        assert lay.global_batch_size % (lay.micro_batch_size * lay.dp) == 0
    speeds = [p.time.tokens_per_second for p in plans]
    assert speeds == sorted(speeds, reverse=True)


def test_step_time_grows_with_a_slower_interconnect():
    """Data-parallel gradient reduction across nodes is exposed without --overlap-grad-reduce: a
    tenth of the inter-node bandwidth costs time; inside one node it does not matter."""
    arch = llama(16, 2048, 32, 8, 8192, True)
    lay = Layout(tp=1, pp=1, cp=1, dp=16, micro_batch_size=2, global_batch_size=32, seq_length=4096)
    fast = make_plan(arch, lay, cluster("h100-80gb", nodes=2)).time
    slow = make_plan(arch, lay, cluster("h100-80gb", nodes=2, inter_node_bandwidth=5e9)).time
    assert slow.parts["DP gradient reduction"] > 5 * fast.parts["DP gradient reduction"]
    assert slow.seconds > fast.seconds


def test_measured_table_is_read_back(tmp_path):
    out = tmp_path / "table.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "bench/bench_plan_table.py", "--device", "cpu", "--preset", "tiny",
                             "--repeats", "2", "--out", str(out)], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    table = load_table(str(out))
    assert set(table) >= {"bf16_gemm", "attention", "hbm_efficiency"}
    slow = cluster("h100-80gb", table_file=str(out))
    assert slow.gemm_seconds(1e12) > 100 * cluster("h100-80gb").gemm_seconds(1e12)  # a CPU's fractions of an H100


def test_an_empty_table_file_is_refused(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({}))
    with pytest.raises(ValueError, match="no throughput table in it"):
        load_table(str(path))


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_throughput_counts_the_log_lines_flops(family):
    """The plan's TFLOP/s and MFU use the formula of the iteration log line."""
    from megatron.core.transformer.config import TransformerConfig, derive
    from megatron.training.reporting.logging import flops_per_iteration as logged
    from megatron.training.planning.architecture import architecture, flops_per_iteration

    if family == "llama":
        config = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, group_query_attention=True,
                                   num_query_groups=2, ffn_hidden_size=688, padded_vocab_size=1024, swiglu=True)
    else:
        config = TransformerConfig(num_layers=3, hidden_size=192, num_attention_heads=6, padded_vocab_size=512)
    config = derive(config)
    assert flops_per_iteration(architecture(config), 16, 512) == logged(config, 16, 512)
