"""How each Megatron-LM flag that this framework's parser does not define is treated.

A flag our parser defines is implemented (with Megatron-LM's meaning); nothing here overrides it, so
a flag gains that status as soon as a config field defines it. The others are:

- note: accepted; one start-up note says what runs instead (kernel and communication choices,
  settings of features that do not change the trained model, deprecated no-ops of Megatron-LM);
- only: accepted with the listed values, which are Megatron-LM's defaults and what runs here; any
  other value is an error naming the flag;
- error: the flag would change the result and is not implemented; an error names it and the way out;
- alias: an older (or another parser's) spelling that Megatron-LM turns into another setting; it sets
  that setting here too, so it counts as implemented.

A flag without its own entry takes its name prefix's treatment (PREFIXES), else its argument
group's (GROUPS).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Treatment:
    kind: str           # "note", "only", "error", or "alias" (implemented under another name)
    text: str
    values: tuple = ()  # "only": the accepted values; "alias": the (field, value) pairs it sets


def alias(text: str, **fields) -> Treatment:
    """An older spelling that Megatron-LM still turns into another setting: implemented, as that. A
    type in place of a value (int) sets the field to the flag's own value, converted."""
    return Treatment("alias", text, tuple(fields.items()))


def note(text: str) -> Treatment:
    return Treatment("note", text)


def error(text: str) -> Treatment:
    return Treatment("error", text)


def only(*values: str, text: str) -> Treatment:
    return Treatment("only", text, tuple(values))


_FUSION = "a kernel choice: the unfused PyTorch ops run (torch.compile fuses RMSNorm, RoPE and SwiGLU on GPU)"
_TP_OVERLAP = ("tensor-parallel communication is not overlapped with the GEMMs (Transformer Engine userbuffers); "
               "the collectives run between them")
_FP4 = "FP4 training is not built; FP8 is (--fp8-format, --fp8-recipe delayed|tensorwise|rowwise)"
_TE_FP8 = ("a Transformer Engine setting with no counterpart in the native FP8 path (torch._scaled_mm, "
           "--fp8-format)")
_CKPT_IO = ("every rank writes only its own pieces of the layout-independent checkpoint, and a load reads what "
            "its layout needs; there is nothing to choose")
_NOT_GPT = "used by Megatron-LM's BERT/T5/retriever models only; no effect on GPT pretraining"
_WANDB = "Weights & Biases logging is not built; use --tensorboard-dir"

GROUPS = {
    "rl": error("reinforcement learning (GRPO) is not built here"),
    "biencoder": error("biencoder/ICT retrieval models are not built here"),
    "vision": error("vision models are not built here"),
    "moe": error("this mixture-of-experts option is not built here (docs/moe.md lists what is)"),
    "mla": error("this option of multi-latent attention is not built here (latent caching, "
                 "fused down projections; the attention itself is: docs/models.md)"),
    "heterogeneous architecture": error("heterogeneous layer configurations are not built here"),
    "retro": error("Retro is not built here"),
    "experimental": error("hybrid/Mamba models, --spec and the precision-aware optimizer are not built here"),
    "kitchen": error("Kitchen quantization is not built here"),
    "in-process restart": error("in-process restart is not built; restart with torchrun and --load (the Slurm "
                                "script requeues and resumes)"),
    "autoresume": error("ADLR autoresume is not built; use --exit-signal-handler or --exit-duration-in-mins with "
                        "--save, as examples/llama/train_llama_slurm.sh does"),
    "inference": note("an inference setting: no effect on pretraining"),
    "one logger": note("NVIDIA's internal one_logger is not used"),
    "ft_package": note("NVIDIA's fault-tolerance package is not used; --exit-signal-handler and --save handle stops"),
    "config logger": note("configs are not dumped; the arguments are printed at start-up and saved in checkpoints"),
    "msc": note("the Multi-Storage Client is not used; paths are local files"),
    "straggler": note("per-rank throughput is not reported"),
    "workload inspector": note("the on-demand profiling server is not built; use --profile"),
    "Transformer-Engine": error(_TE_FP8),
    "patch": error("a flag of the PAI-Megatron-Patch group that the ROCm fork's pretrain_gpt.py adds "
                   "(get_patch_args), for PAI's own models and data, which are not built here"),
    "rerun engine": note("the re-run state machine is not built: a step whose gradients are not finite is "
                         "skipped and counted in the log line"),
}

_MOE_KERNEL = "a kernel choice: the experts run unfused PyTorch ops (the same result)"
_MOE_OVERLAP = "expert-parallel communication is not overlapped with computation; the collectives run between the GEMMs"

PREFIXES = {
    "--moe-": GROUPS["moe"],
    "--dsa-": error("DeepSeek sparse attention is not built"),
    "--no-dsa-": error("DeepSeek sparse attention is not built"),
    "--disable-dsa-": error("DeepSeek sparse attention is not built"),
    "--mhc-": error("manifold-constrained hyper-connections are not built"),
    "--linear-": error("linear-attention layers are not built"),
    "--gdp-": error("linear-attention layers are not built"),
    "--mup-": error("the muP parametrization is not built; weights are normal with --init-method-std"),
    "--fim-": error("fill-in-the-middle samples are not built"),
    "--logits-": error("logits distillation is not built"),
    "--mtp-": error("this multi-token prediction option is not built (--mtp-num-layers and "
                    "--mtp-loss-scaling-factor are: docs/models.md)"),
    "--muon-": error("the Muon optimizer is not built (--optimizer adam or sgd)"),
    "--lion-": error("the Lion optimizer is not built (--optimizer adam or sgd)"),
    "--gtp-": error("weight sharding within tensor parallelism is not built"),
    "--fault-injector-": note("Megatron-LM's fault injector is not built; no faults are injected "
                              "(bench/chaos.py injects this framework's own test faults)"),
    "--otel-": note("OpenTelemetry tracing is not used"),
    "--flight-recorder-": note("the NCCL flight recorder keeps PyTorch's defaults (TORCH_NCCL_* variables)"),
    "--no-flight-recorder-": note("the NCCL flight recorder keeps PyTorch's defaults (TORCH_NCCL_* variables)"),
    "--disable-flight-recorder-": note("the NCCL flight recorder keeps PyTorch's defaults (TORCH_NCCL_* variables)"),
    "--inference-": note("an inference setting: no effect on pretraining"),
    "--megatron-fsdp-": note("Megatron-FSDP is not built; no effect"),
    "--async-ckpt-": note("an --async-save writes from a background thread of each rank"),
    "--qk-clip": error("QK-clip is not built"),
    "--fine-grained-": error("activation offloading to CPU is not built"),
    "--ckpt-fully-parallel-": note(_CKPT_IO),
    "--ckpt-pg-tensors-cache-": note(_CKPT_IO),
    "--pytorch-profiler-collect-": note("--profile --use-pytorch-profiler records PyTorch's default events"),
}

FLAGS = {
    # mixture of experts (the flags not listed here are built, or refused by the "moe" group entry)
    "--moe-use-legacy-grouped-gemm": note(_MOE_KERNEL),
    "--moe-shared-expert-overlap": note(_MOE_OVERLAP),
    "--overlap-moe-expert-parallel-comm": note(_MOE_OVERLAP),
    "--delay-wgrad-compute": note(_MOE_OVERLAP),
    "--moe-deepep-num-sms": note("DeepEP is not used (only with --moe-enable-deepep, which is refused)"),
    "--moe-pad-experts-for-cuda-graph-inference": note("an inference setting: no effect on pretraining"),
    "--moe-enable-deepep": error("DeepEP is not built; use --moe-token-dispatcher-type alltoall"),
    "--moe-extended-tp": error("extended tensor parallelism for experts was removed from Megatron-LM; use "
                               "--expert-tensor-parallel-size"),
    "--moe-use-upcycling": error("upcycling a dense checkpoint into experts is not built"),
    "--moe-upcycling-granularity": error("upcycling a dense checkpoint into experts is not built"),
    "--moe-apply-probs-on-input": error("applying router probabilities to the expert input is not built (they "
                                        "weight the expert output)"),
    # network size
    "--encoder-num-layers": error("encoder-decoder models are not built; use --num-layers"),
    "--decoder-num-layers": error("encoder-decoder models are not built; use --num-layers"),
    "--attention-backend": note("attention runs PyTorch's scaled_dot_product_attention (its flash, memory-efficient "
                                "or math kernel, as PyTorch picks), or the flash-attn package with --use-flash-attn"),
    "--softmax-type": only("vanilla", text="only the standard softmax (vanilla) is built"),
    "--window-size": error("sliding-window attention is not built"),
    "--window-attn-skip-freq": error("sliding-window attention is not built"),
    "--relative-attention-num-buckets": note("relative position embeddings are not built; no effect"),
    "--relative-attention-max-distance": note("relative position embeddings are not built; no effect"),
    "--use-rotary-position-embeddings": alias("Megatron-LM's older spelling of --position-embedding-type rope",
                                              position_embedding_type="rope"),
    "--rotary-seq-len-interpolation-factor": only("1", text="RoPE sequence-length interpolation is not built; a "
                                                            "factor of 1 (positions unchanged) is what runs"),
    "--no-rope-freq": error("skipping RoPE on some layers is not built"),
    "--no-position-embedding": note("rotary embeddings have no learned position table; Megatron-LM accepts this "
                                    "flag only with --position-embedding-type rope, and so does this framework"),
    "--mrope-section": error("multimodal RoPE is not built"),
    "--apply-residual-connection-post-layernorm": error("post-norm residuals (BERT order) are not built"),
    "--squared-relu": error("the squared-ReLU activation is not built"),
    "--quick-geglu": error("the quick-GeGLU activation is not built"),
    "--activation-func-clamp-value": error("activation clamping is not built"),
    "--glu-linear-offset": only("0", "0.0", text="only a zero offset in the gated linear unit is built"),
    "--onnx-safe": note("ONNX export is not part of training; no effect"),
    "--bert-no-binary-head": note(_NOT_GPT),
    "--mtp-use-repeated-layer": error("one multi-token prediction layer shared by every depth is not built; each "
                                      "depth has its own (--mtp-num-layers)"),
    "--mtp-standalone": error("multi-token prediction runs on the last pipeline stage; a stage of its own "
                              "(--pipeline-model-parallel-layout) is not built"),
    "--mtp-hybrid-override-pattern": error("hybrid (Mamba) models are not built; multi-token prediction layers "
                                           "are transformer layers"),
    # regularization
    "--start-weight-decay": error("weight-decay schedules are not built; --weight-decay is constant"),
    "--end-weight-decay": error("weight-decay schedules are not built; --weight-decay is constant"),
    "--weight-decay-incr-style": only("constant", text="weight-decay schedules are not built; --weight-decay is "
                                                       "constant"),
    **{name: error("the Muon optimizer is not built (--optimizer adam or sgd)") for name in (
        "--muon-momentum", "--muon-no-split-qkv", "--muon-use-nesterov", "--muon-scale-mode",
        "--muon-fp32-matmul-prec", "--muon-num-ns-steps", "--muon-tp-mode", "--muon-extra-scale-factor")},
    # training
    "--batch-size": error("Megatron-LM's old flag: use --micro-batch-size"),
    "--decrease-batch-size-if-needed": error("shrinking the batch size to fit fewer ranks is not built"),
    "--recompute-activations": alias("Megatron-LM's older spelling of --recompute-granularity selective",
                                     recompute_granularity="selective"),
    "--no-check-for-nan-in-loss-and-grad": note("a step whose gradients are not finite is skipped and counted in "
                                                "the log line, never raised"),
    "--check-for-spiky-loss": error("loss-spike checks are not built"),
    "--check-for-large-grads": error("large-gradient checks are not built"),
    "--distribute-saved-activations": note("the inputs kept for full recomputation are not split over the "
                                           "tensor-parallel ranks (more memory, same result)"),
    "--recompute-modules": only("core_attn", text="selective recomputation re-runs the attention core (core_attn) "
                                                  "only"),
    "--cpu-offloading-num-layers": only("0", text="activation offloading to CPU is not built"),
    "--no-clone-scatter-output-in-embedding": note("a memory detail of Megatron-LM's embedding; no effect"),
    "--iterations-to-skip": error("skipping iterations is not built"),
    "--result-rejected-tracker-filename": error("the re-run state machine is not built"),
    "--disable-gloo-process-groups": note("one gloo group is created for checkpointing; no other effect"),
    "--record-memory-history": note("the CUDA memory history is not recorded; peak memory is in the log line"),
    "--memory-snapshot-path": note("the CUDA memory history is not recorded"),
    "--tp-comm-overlap": note(_TP_OVERLAP),
    "--tp-comm-overlap-cfg": note(_TP_OVERLAP),
    "--disable-tp-comm-overlap-ag": note(_TP_OVERLAP),
    "--disable-tp-comm-overlap-rs": note(_TP_OVERLAP),
    "--tp-comm-overlap-rs-dgrad": note(_TP_OVERLAP),
    "--disable-tp-comm-bulk-dgrad": note(_TP_OVERLAP),
    "--disable-tp-comm-bulk-wgrad": note(_TP_OVERLAP),
    "--disable-tp-comm-split-ag": note(_TP_OVERLAP),
    "--disable-tp-comm-split-rs": note(_TP_OVERLAP),
    "--tp-comm-bootstrap-backend": note(_TP_OVERLAP),
    "--use-cpu-initialization": note("weights are always generated as full tensors from the seed and sliced, so "
                                     "every tensor-parallel size starts from the same weights"),
    "--deterministic-mode": error("deterministic mode is not built"),
    "--check-weight-hash-across-dp-replicas-interval": error("weight-hash checks are not built"),
    "--train-sync-interval": note("the host waits for the device every iteration (for the timings)"),
    "--checkpoint-activations": error("Megatron-LM's old flag: use --recompute-granularity full "
                                      "--recompute-method uniform --recompute-num-layers 1"),
    "--no-masked-softmax-fusion": note(_FUSION),
    "--no-bias-gelu-fusion": note(_FUSION),
    "--no-bias-swiglu-fusion": note(_FUSION),
    "--use-fused-weighted-squared-relu": error("the squared-ReLU activation is not built"),
    "--no-bias-dropout-fusion": note(_FUSION),
    "--no-rope-fusion": note(_FUSION),
    "--yarn-correction-range-round-to-int": alias("YaRN rounds its interpolation band's bounds to whole channels by default "
                                                  "(off with --no-yarn-correction-range-round-to-int)",
                                                  yarn_correction_range_round_to_int=True),
    "--cross-entropy-loss-fusion": note("the vocabulary-parallel cross entropy runs as PyTorch ops"),
    "--cross-entropy-fusion-impl": note("the vocabulary-parallel cross entropy runs as PyTorch ops"),
    "--optimizer-cpu-offload": error("optimizer offloading to CPU is not built; use --use-distributed-optimizer "
                                     "or --use-torch-fsdp2"),
    "--optimizer-offload-fraction": error("optimizer offloading to CPU is not built"),
    "--use-torch-optimizer-for-cpu-offload": error("optimizer offloading to CPU is not built"),
    "--overlap-cpu-optimizer-d2h-h2d": error("optimizer offloading to CPU is not built"),
    "--dump-param-to-param-group-map": error("parameter-group maps are not built"),
    "--no-pin-cpu-grads": note("optimizer offloading to CPU is not built; no effect"),
    "--no-pin-cpu-params": note("optimizer offloading to CPU is not built; no effect"),
    "--no-async-tensor-model-parallel-allreduce": note("deprecated and ignored in Megatron-LM; no effect"),
    "--async-tensor-model-parallel-allreduce": note("deprecated and ignored in Megatron-LM; no effect"),
    "--no-persist-layer-norm": note(_FUSION),
    "--no-gradient-accumulation-fusion": note("weight gradients are accumulated by PyTorch's autograd into the "
                                              "fp32 gradient buffer (no fused kernel)"),
    "--use-mcore-models": note("deprecated in Megatron-LM, where Megatron-Core models are the default; the one "
                               "model here is the equivalent of its GPTModel"),
    "--use-legacy-models": error("Megatron-LM's legacy models are not built"),
    "--pipeline-model-parallel-comm-backend": note("pipeline sends and receives use --distributed-backend"),
    "--high-priority-stream-groups": note("collectives run on the default streams"),
    "--use-te-activation-func": note(_FUSION),
    # initialization
    "--data-parallel-random-init": error("every data-parallel replica starts from the same weights"),
    "--embedding-init-method-std": error("a separate embedding initialization is not built; --init-method-std "
                                         "initializes every weight"),
    "--init-method-xavier-uniform": error("Xavier initialization is not built; weights are normal with "
                                          "--init-method-std"),
    # learning rate
    "--warmup": error("Megatron-LM's old flag: use --lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction"),
    "--override-opt_param-scheduler": note("this is what happens here: the schedule comes from the flags, the "
                                           "number of samples trained from the checkpoint"),
    "--override-opt-param-scheduler": note("this is what happens here: the schedule comes from the flags, the "
                                           "number of samples trained from the checkpoint"),
    "--use-checkpoint-opt_param-scheduler": error("the schedule always comes from the flags; pass the flags of "
                                                  "the saved run"),
    "--use-checkpoint-opt-param-scheduler": error("the schedule always comes from the flags; pass the flags of "
                                                  "the saved run"),
    # checkpointing
    "--persistent-save-interval": error("use --save-interval (the same)"),
    "--save-retain-interval": error("use --ckpt-keep-latest to delete older checkpoints"),
    "--load-main-params-from-ckpt": error("loading fp32 masters without the optimizer state is not built; "
                                          "--no-load-optim starts the masters from the loaded weights"),
    "--no-strict-fsdp-dtensor-load": note(_CKPT_IO),
    "--non-persistent-save-interval": error("non-persistent checkpoints are not built; use --save-interval"),
    "--non-persistent-ckpt-type": error("non-persistent checkpoints are not built; use --save-interval"),
    "--non-persistent-global-ckpt-dir": error("non-persistent checkpoints are not built; use --save"),
    "--non-persistent-local-ckpt-dir": error("non-persistent checkpoints are not built; use --save"),
    "--non-persistent-local-ckpt-algo": error("non-persistent checkpoints are not built"),
    "--pretrained-checkpoint": error("use --load DIR --finetune"),
    "--no-initialization": note("weights are always initialized, then overwritten by --load"),
    "--no-perform-initialization": note("weights are always initialized, then overwritten by --load"),
    "--use-mp-args-from-checkpoint-args": error("the parallel layout always comes from the flags; any layout "
                                                "loads any checkpoint"),
    "--no-use-tokenizer-model-from-checkpoint-args": note("the tokenizer always comes from the flags"),
    "--use-dist-ckpt": note("deprecated in Megatron-LM: --ckpt-format chooses the format"),
    "--use-persistent-ckpt-worker": note("an --async-save writes from a background thread of each rank"),
    "--auto-detect-ckpt-format": note("--load reads this framework's one format; Megatron-LM checkpoints convert "
                                      "with tools/checkpoint/convert.py"),
    "--dist-ckpt-format": note("deprecated in Megatron-LM: --ckpt-format chooses the format"),
    "--ckpt-convert-format": error("convert with tools/checkpoint/convert.py"),
    "--ckpt-convert-save": error("convert with tools/checkpoint/convert.py"),
    "--ckpt-convert-update-legacy-dist-opt-format": error("convert with tools/checkpoint/convert.py"),
    "--ckpt-fully-parallel-save": note(_CKPT_IO),
    "--no-ckpt-fully-parallel-save": note(_CKPT_IO),
    "--ckpt-fully-parallel-load": note(_CKPT_IO),
    "--ckpt-assume-constant-structure": note(_CKPT_IO),
    "--dist-ckpt-strictness": note(_CKPT_IO),
    "--dist-ckpt-save-pre-mcore-014": note(_CKPT_IO),
    "--dist-ckpt-optim-fully-reshardable": note("optimizer state always reshards to any layout"),
    "--distrib-optim-fully-reshardable-mem-efficient": note(_CKPT_IO),
    # mixed precision
    "--fp32-residual-connection": error("fp32 residual connections are not built"),
    "--apply-query-key-layer-scaling": note("the scaling cancels out in the fp32 softmax of PyTorch's attention "
                                            "kernels; no effect"),
    "--attention-softmax-in-fp32": note("PyTorch's attention kernels compute the softmax in fp32"),
    "--accumulate-allreduce-grads-in-fp32": note("gradients are accumulated and reduced in fp32 unless "
                                                 "--grad-reduce-in-bf16"),
    "--fp16-lm-cross-entropy": error("the cross entropy runs in fp32; fp16 cross entropy is not built"),
    "--disable-bf16-reduced-precision-matmul": error("changing PyTorch's bf16 matmul reduction is not built"),
    "--reuse-grad-buf-for-mxfp8-param-ag": note("the mxfp8 recipe is not built (--fp8-recipe mxfp8 is an error); "
                                                "no effect"),
    # distributed
    "--pipeline-model-parallel-layout": error("custom pipeline layouts are not built; use "
                                              "--decoder-first/last-pipeline-num-layers"),
    "--model-parallel-size": error("Megatron-LM's old flag: use --tensor-model-parallel-size"),
    "--microbatch-group-size-per-virtual-pipeline-stage": note("the interleaved schedule runs micro-batches in "
                                                                "groups of the pipeline size"),
    "--no-overlap-p2p-communication": note("pipeline sends and receives of a step are batched together"),
    "--overlap-p2p-communication-warmup-flush": note("pipeline sends and receives of a step are batched together"),
    # the ROCm fork's TransformerConfig spells these two after its fields
    "--overlap-p2p-comm-warmup-flush": alias("the ROCm fork's spelling of --overlap-p2p-communication-warmup-flush",
                                             overlap_p2p_comm_warmup_flush=True),
    "--microbatch-group-size-per-vp-stage": alias("the ROCm fork's spelling of "
                                                  "--microbatch-group-size-per-virtual-pipeline-stage",
                                                  microbatch_group_size_per_vp_stage=int),
    "--distributed-timeout-seconds-after-init": error("a second timeout after start-up is not built; use "
                                                      "--distributed-timeout-minutes"),
    "--defer-embedding-wgrad-compute": note("the output layer's weight gradient is computed in each backward"),
    "--wgrad-deferral-limit": note("the output layer's weight gradient is computed in each backward"),
    "--no-align-grad-reduce": note("each pipeline stage starts its gradient reduction when its backward ends"),
    "--ddp-num-buckets": note("gradient buckets are sized by --ddp-bucket-size"),
    "--ddp-pad-buckets-for-high-nccl-busbw": note("buckets are padded to a multiple of the data-parallel size only"),
    "--ddp-reduce-scatter-with-fp32-accumulation": note("the reduce-scatter sends and sums in the gradient dtype "
                                                        "(fp32 unless --grad-reduce-in-bf16)"),
    "--ddp-average-in-collective": note("gradients are scaled by 1/DP before a summing collective (this "
                                        "framework's --average-in-collective averages inside it)"),
    "--overlap-param-gather-with-optimizer-step": note("the first bucket's parameter all-gather starts after the "
                                                       "optimizer step"),
    "--no-align-param-gather": note("each pipeline stage starts its parameter all-gathers on its own"),
    "--no-scatter-gather-tensors-in-pipeline": note("pipeline stages send whole activations"),
    "--use-ring-exchange-p2p": note("pipeline stages use batched sends and receives"),
    "--local-rank": note("the device comes from torchrun's LOCAL_RANK"),
    "--lazy-mpu-init": error("lazy initialization for an external DDP manager is not built"),
    "--account-for-embedding-in-pipeline-split": error("counting the embedding as a layer in the pipeline split is "
                                                       "not built; use --decoder-first-pipeline-num-layers"),
    "--account-for-loss-in-pipeline-split": error("counting the loss as a layer in the pipeline split is not "
                                                  "built; use --decoder-last-pipeline-num-layers"),
    "--use-nccl-ub": note("NCCL user-buffer registration is not used"),
    "--disable-symmetric-registration": note("NCCL user-buffer registration is not used"),
    "--use-sharp": note("NCCL's defaults decide whether SHARP is used"),
    "--sharp-enabled-group": note("NCCL's defaults decide whether SHARP is used"),
    "--use-megatron-fsdp": error("Megatron-FSDP is not built; use --use-torch-fsdp2"),
    "--init-model-with-meta-device": note("parameters are allocated on the device and initialized there"),
    "--data-parallel-sharding-strategy": only("no_shard", text="Megatron-FSDP's sharding strategies are not built; "
                                                              "use --use-distributed-optimizer or --use-torch-fsdp2"),
    "--no-gradient-reduce-div-fusion": note("gradients are scaled by 1/DP before the collective"),
    "--fsdp-double-buffer": note("Megatron-FSDP is not built; no effect"),
    "--suggested-communication-unit-size": note("Megatron-FSDP is not built; no effect"),
    "--keep-fp8-transpose-cache": note("Megatron-FSDP is not built; no effect"),
    "--enable-full-sharding-in-hsdp": error("hybrid sharding is not built"),
    "--num-distributed-optimizer-instances": only("1", text="one distributed-optimizer instance spans the "
                                                            "data-parallel ranks"),
    "--torch-fsdp2-no-reshard-after-forward": note("FSDP2 reshards parameters after the forward"),
    "--hierarchical-context-parallel-sizes": error("hierarchical context parallelism (a2a+p2p) is not built"),
    "--nccl-communicator-config-path": note("NCCL communicators use their defaults"),
    "--use-tp-pp-dp-mapping": note("ranks are ordered tp-cp-dp-pp (Megatron-LM's default)"),
    "--replication": error("replicated local checkpoints are not built"),
    "--replication-jump": error("replicated local checkpoints are not built"),
    "--replication-factor": error("replicated local checkpoints are not built"),
    # validation
    "--full-validation": error("validating on the whole validation set is not built; use --eval-iters"),
    "--multiple-validation-sets": error("separate losses per validation dataset are not built"),
    "--test-mode": error("Megatron-LM's real-time tests are not built"),
    "--skip-train": error("evaluation without training is not built"),
    # data and dataloader
    "--encoder-seq-length": error("encoder-decoder models are not built; use --seq-length"),
    "--decoder-seq-length": error("encoder-decoder models are not built; use --seq-length"),
    "--retriever-seq-length": note(_NOT_GPT),
    "--sample-rate": note(_NOT_GPT),
    "--mask-prob": note(_NOT_GPT),
    "--short-seq-prob": note(_NOT_GPT),
    "--num-dataset-builder-threads": note("dataset indices are built by one rank with the C++ helper"),
    "--object-storage-cache-path": error("object-storage data is not built; data paths are local files"),
    "--mid-level-dataset-surplus": only("0.005", text="blends build Megatron-Core's default surplus of 0.5%"),
    "--allow-ambiguous-pad-tokens": note("GPT pretraining samples have no padding; no effect"),
    # tokenizer
    "--padded-vocab-size": error("the vocabulary is padded by --make-vocab-size-divisible-by"),
    "--vocab-extra-ids": only("0", text="extra vocabulary ids (T5) are not built"),
    "--tokenizer-metadata": error("tokenizer metadata files are not read; use --tokenizer-model"),
    "--tiktoken-pattern": note("used by --tokenizer-type TikTokenizer only, which is not built"),
    "--tiktoken-num-special-tokens": note("used by --tokenizer-type TikTokenizer only, which is not built"),
    "--tiktoken-special-tokens": note("used by --tokenizer-type TikTokenizer only, which is not built"),
    "--legacy-tokenizer": note("one tokenizer implementation per --tokenizer-type"),
    "--trust-remote-code": error("remote code is never run; tokenizers load from local files only"),
    # logging
    "--timing-log-level": only("0", text="only the iteration time is measured (level 0)"),
    "--log-energy": note("energy is not measured"),
    "--no-barrier-with-level-1-timing": note("only the iteration time is measured"),
    "--timing-log-option": note("only the iteration time is measured"),
    "--tensorboard-queue-size": note("TensorBoard events are flushed after every write"),
    "--wandb-project": note(_WANDB),
    "--wandb-entity": note(_WANDB),
    "--wandb-exp-name": note(_WANDB),
    "--wandb-save-dir": note(_WANDB),
    # inference settings that also steer training in Megatron-LM
    "--enable-cuda-graph": note("CUDA graphs are not captured; kernels launch one by one"),
    "--external-cuda-graph": note("CUDA graphs are not captured; kernels launch one by one"),
    "--cuda-graph-impl": note("CUDA graphs are not captured; kernels launch one by one"),
    "--cuda-graph-scope": note("CUDA graphs are not captured; kernels launch one by one"),
    "--cuda-graph-warmup-steps": note("CUDA graphs are not captured; kernels launch one by one"),
    # current Megatron-LM's other flags
    "--tensor-parallel-num-weight-shards": only("1", text="weight sharding within tensor parallelism is not built"),
    "--expert-tensor-parallel-num-weight-shards": only("1", text="weight sharding within tensor parallelism is not "
                                                                 "built"),
    "--max-seqlen-per-dp-cp-rank": error("dynamic context parallelism is not built"),
    "--hybrid-context-parallel": error("hybrid (dynamic) context parallelism is not built; use "
                                       "--context-parallel-size"),
    "--overlap-dispatch-backward-with-experts-wgrad": GROUPS["moe"],
    "--ep-overlap-early-attn-memory-release": GROUPS["moe"],
    "--use-grouped-gemm-for-shared-expert": GROUPS["moe"],
    "--high-priority-a2a-comm-stream": GROUPS["moe"],
    "--cpu-offloading-retain-pinned-cpu-buffers": note("activation offloading to CPU is not built; no effect"),
    "--flash-attention-version": note("the flash-attn package's own version runs with --use-flash-attn (FA3 on "
                                      "Hopper when installed)"),
    "--attention-output-gate": error("gated attention output is not built"),
    "--experimental-attention-variant": error("experimental attention variants are not built"),
    "--use-mup": error("the muP parametrization is not built; weights are normal with --init-method-std"),
    "--fused-residual-rmsnorm": note(_FUSION),
    "--use-kitchen-attention": error("Kitchen quantization is not built here"),
    "--kitchen-attention-backend": note("Kitchen quantization is not built here; no effect"),
    "--use-grouped-gemm-for-dense-mlp": note(_FUSION),
    "--enable-mhc-connections": error("manifold-constrained hyper-connections are not built"),
    "--batch-invariant-mode": error("batch-invariant kernels are not built"),
    "--batch-invariant-backend": note("batch-invariant kernels are not built; no effect"),
    "--mlp-chunks-for-training": only("1", text="the MLP runs on the whole micro-batch (chunking is not built)"),
    "--offload-modules": error("activation offloading to CPU is not built"),
    "--min-offloaded-tensor-size": note("activation offloading to CPU is not built; no effect"),
    "--delay-offload-until-cuda-graph": note("activation offloading to CPU is not built; no effect"),
    "--delta-offload-bytes-across-pp-ranks": note("activation offloading to CPU is not built; no effect"),
    "--activation-offload-fraction": note("activation offloading to CPU is not built; no effect"),
    "--apply-wd-to-qk-layernorm": error("weight decay on the query/key norm weights is not built: norm weights and "
                                        "biases have no weight decay"),
    "--no-weight-decay-cond-type": error("weight-decay conditions are not built: norm weights and biases have no "
                                         "weight decay"),
    "--record-shapes": note("--profile --use-pytorch-profiler records PyTorch's default events"),
    "--nvtx-ranges": note("NVTX ranges are not emitted"),
    "--step-batch-size-schedule": error("batch-size schedules by step are not built; use --rampup-batch-size"),
    "--gpu-sniff-test-interval": note("periodic GPU tests are not built"),
    "--exit-signal": only("SIGTERM", "signal.SIGTERM", text="--exit-signal-handler saves and exits on SIGTERM "
                                                            "(and SIGUSR1, which torchrun forwards)"),
    "--exit-signal-handler-for-dataloader": note("--exit-signal-handler applies to the training processes"),
    "--exit-signal-handler-for-training": note("--exit-signal-handler applies to the training processes"),
    "--optimizer-cuda-graph": note("CUDA graphs are not captured; kernels launch one by one"),
    "--freeze-all-layers": error("freezing layers is not built"),
    **{name: note("tensor dumps for debugging are not written") for name in (
        "--save-params-interval", "--save-activations-interval", "--save-tokens-per-expert-interval",
        "--save-wgrads-interval", "--save-dgrads-interval")},
    "--async-strategy": note("an --async-save writes from a background thread of each rank"),
    "--no-ckpt-load-validate-sharding-integrity": note(_CKPT_IO),
    "--no-save-tokenizer-assets": note("tokenizer files are not copied into checkpoints; the HF export "
                                       "(tools/checkpoint/convert.py) writes them"),
    "--verify-integrity": note("checkpoints are checked as they load"),
    "--override-ckpt-iteration": error("the iteration always comes from the checkpoint; --ckpt-step N chooses one"),
    "--dist-ckpt-workers": note(_CKPT_IO),
    "--ckpt-drop-redundant-extra-state": note(_CKPT_IO),
    "--output-logit-dtype": error("the logits are computed in the model dtype and the loss in fp32; another logit "
                                  "dtype is not built"),
    "--mamba-training-ssm-states-dtype": error("hybrid/Mamba models, --spec and the precision-aware optimizer are "
                                               "not built here"),
    "--disable-jit-fuser": note("no TorchScript fuser is used; --no-torch-compile turns torch.compile off"),
    "--ddp-param-name-patterns-for-fp32-local-accumulation": note("gradients are accumulated in fp32 unless "
                                                                  "--grad-reduce-in-bf16"),
    "--no-use-layer-wise-param-layout": note("Megatron-FSDP is not built; no effect"),
    "--fsdp-manual-registration": note("Megatron-FSDP is not built; no effect"),
    "--create-all-gather-group": note("parameter all-gathers use the data-parallel group"),
    "--outer-dp-sharding-strategy": only("no_shard", text="hybrid sharding is not built"),
    "--fake-process-group": error("fake process groups are not built; run on CPU with --distributed-backend gloo"),
    "--start-eval-at-iter": error("a first evaluation later than --eval-interval is not built"),
    "--eval-global-batch-size": error("evaluation uses the training batch sizes; separate ones are not built"),
    "--eval-micro-batch-size": error("evaluation uses the training batch sizes; separate ones are not built"),
    "--validation-set-names": error("separate losses per validation dataset are not built"),
    "--phase-transition-iterations": error("data phases are not built"),
    "--per-dataset-sequences-path": error("per-dataset sequence files are not read"),
    "--dataloader-fast-cache-load": note("the cached indices are memory-mapped .npy files"),
    "--dataloader-defer-npy-index-mmap": note("the cached indices are memory-mapped .npy files"),
    "--dataloader-inter-document-masking": error("use --reset-attention-mask (attention stops at each "
                                                 "end-of-document token)"),
    "--no-pad-vocab-size": error("the vocabulary is always padded by --make-vocab-size-divisible-by"),
    "--tokenizer-special-tokens": error("extra special tokens are not added; the tokenizer files define them"),
    "--tokenizer-sentencepiece-legacy": note("one SentencePiece implementation"),
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": note("SentencePiece normalizes as its model says"),
    "--tokenizer-hf-no-use-fast": note("Hugging Face tokenizers load with the fast (tokenizers) library"),
    "--tokenizer-hf-no-include-special-tokens": error("Hugging Face tokenizers encode with their special-token "
                                                      "settings; turning them off is not built"),
    "--null-tokenizer-eod-id": error("NullTokenizer's end-of-document id is --vocab-size (Megatron-LM's default)"),
    "--null-tokenizer-pad-id": only("-1", text="NullTokenizer has no padding id (Megatron-LM's default -1)"),
    "--chat-template": note("chat templates are for fine-tuning; no effect on pretraining"),
    "--use-gigatoken": error("this tokenizer is not built"),
    "--log-memory-interval": note("memory is in every log line"),
    "--log-device-memory-used": note("the peak memory is in every log line"),
    "--log-max-attention-logit": note("attention logits are not logged"),
    # Transformer Engine: FP8 is built natively (megatron/core/transformer/fp8.py)
    "--fp8-interval": note("deprecated in Megatron-LM and ignored by Transformer Engine; the FP8 scales are "
                           "updated every micro-batch"),
    "--fp8-param-gather": note("the distributed optimizer all-gathers the bf16 weights, and each rank casts them "
                               "to FP8 once per step (Megatron-Core gathers FP8 copies instead: half the gather "
                               "volume, the same FP8 weights up to the bf16 rounding before the cast)"),
    "--no-fp8-wgrad": error("the weight-gradient GEMM always runs in FP8 here; a bf16 weight gradient under "
                            "--fp8-format is not built"),
    "--disable-fp8-wgrad": error("the weight-gradient GEMM always runs in FP8 here; a bf16 weight gradient under "
                                 "--fp8-format is not built"),
    "--fp8-quantizer-factory": error("custom quantizers (--fp8-recipe custom) are Transformer Engine's; use "
                                     "--fp8-recipe delayed, tensorwise or rowwise"),
    "--fp8-output-proj": error("FP8 for the output layer is not built; the transformer layers' linears run FP8"),
    "--te-precision-config-file": error("per-module precision files are Transformer Engine's; "
                                        "--first-last-layers-bf16 keeps the first and last layers in bf16"),
    "--fp4-format": error(_FP4),
    "--fp4-recipe": error(_FP4),
    "--fp4-quantizer-factory": error(_FP4),
    "--fp4-param-gather": error(_FP4),
    "--keep-fp8-weight-transpose-cache-te": note("the FP8 weight and its transpose are cached once per optimizer "
                                                 "step, always"),
    "--use-transformer-engine-op-fuser": note(_FUSION),
    # ROCm fork's own flags
    "--keep-fp8-weight-transpose-cache": note("the FP8 weight and its transpose are cached once per optimizer step, "
                                              "always"),
    "--use-fsdp2": note("ROCm Transformer Engine's FSDP2 mode for its own modules; the layers here shard under "
                        "FSDP2 as they are, and FSDP2 itself is --use-torch-fsdp2"),
    **{name: note("a setting of the fork's MORI expert-parallel dispatcher (--moe-flex-dispatcher-backend mori, "
                  "which is refused): no effect") for name in ("--moe-mori-kernel-type",
                                                               "--moe-mori-max-tokens-per-rank")},
    "--disable-te-fused-rope": note(_FUSION),
    "--fused-single-qkv-rope": note(_FUSION),
    "--log-batch-size-to-tensorboard": note("the batch size is written to TensorBoard at every log, as Megatron-LM "
                                            "does since it dropped this switch"),
    "--use-contiguous-parameters-in-local-ddp": note("gradients and parameters always live in contiguous buckets"),
    "--encoder-tensor-model-parallel-size": error("encoder-decoder models are not built"),
    "--encoder-pipeline-model-parallel-size": error("encoder-decoder models are not built"),
    "--pipeline-model-parallel-split-rank": error("encoder-decoder models are not built"),
    "--standalone-embedding-stage": error("a pipeline stage holding only the embedding is not built; use "
                                          "--decoder-first-pipeline-num-layers"),
    "--renormalize-blend-weights": note("blend weights are normalized to sum to 1, as Megatron-Core does"),
    "--fused-padded-mla-attention": note("a multi-latent attention kernel choice (the fork's fused CK kernel); "
                                         "multi-latent attention runs PyTorch's attention here, so no effect"),
    "--attention-sink-k": only("0", text="attention sink tokens are not built"),
    "--keep_fp8_weight_transpose_cache": note("the fork's deprecated spelling of --keep-fp8-weight-transpose-cache-te: "
                                              "the FP8 weight and its transpose are cached once per optimizer step, "
                                              "always"),
    "--tokenizer-hf-use-fast": note("Hugging Face tokenizers load with the fast (tokenizers) library, as this flag "
                                    "asks"),
    "--tokenizer-hf-include-special-tokens": note("Hugging Face tokenizers encode with their special tokens "
                                                  "(tokenizer(text).input_ids), as this flag asks"),
    "--s3-cache-path": error("object-storage data is not built; data paths are local files"),
    # the PAI-Megatron-Patch group the ROCm fork's pretrain_gpt.py adds (the others: GROUPS["patch"])
    **{name: note("a text-generation or evaluation setting of the PAI patch: no effect on pretraining")
       for name in ("--text-generate-input-file", "--text-generate-output-file", "--text-generate-gt-file",
                    "--time", "--eval-dev", "--input-len", "--generation-length", "--top-p", "--top-k",
                    "--out-seq-length", "--temperature", "--repetition_penalty", "--repetition-penalty",
                    "--task-list", "--verbosity", "--adaptive-seq-len", "--eval-fp32", "--num-fewshot")},
    **{name: note("a multimodal setting of the PAI patch: GPT pretraining does not read it")
       for name in ("--mm-use-im-start-end", "--mm-use-im-patch-token", "--tune-mm-mlp-adapter",
                    "--freeze-clip-vision-tower", "--freeze-llm", "--image-folder", "--mm-vision-select-layer",
                    "--vision-tower", "--image-aspect-ratio", "--version", "--mm-projector-type", "--image-size",
                    "--patch-size", "--cvcuda-image-processing")},
    "--train-mode": only("pretrain", text="pretrain_gpt.py pretrains (the PAI patch's finetune mode is not built)"),
    "--transformer-type": only("megatron", text="the one transformer here is Megatron's"),
    "--extra-vocab-size": only("0", text="extra vocabulary entries for the PAI patch's tokenizers are not built"),
    "--max-padding-length": note("the PAI patch's padding length for fine-tuning samples; pretraining samples are "
                                 "--seq-length tokens without padding"),
    "--dataset": note("the PAI patch's dataset name; pretrain_gpt.py reads --data-path or --mock-data"),
    "--enable-shared-expert": note("the PAI patch's shared-expert switch: shared experts come from "
                                   "--moe-shared-expert-intermediate-size"),
    "--num-shared-experts": note("the PAI patch's shared-expert count: shared experts come from "
                                 "--moe-shared-expert-intermediate-size"),
    "--shared-moe-ffn-hidden-size": error("the PAI patch's spelling: use --moe-shared-expert-intermediate-size"),
    "--n-head-kv": error("the PAI patch's spelling: use --group-query-attention --num-query-groups N"),
    "--intermediate-size": error("the PAI patch's spelling: use --ffn-hidden-size"),
    "--use-llama2-rotary-position-embeddings": error("the PAI patch's spelling: use --position-embedding-type rope"),
    "--use-mistral-rotary-position-embeddings": error("the PAI patch's spelling: use --position-embedding-type rope"),
    "--epochs": error("epoch-based fine-tuning (PAI patch) is not built; use --train-iters or --train-samples"),
    "--sliding-window": error("sliding-window attention is not built"),
    "--use-alibi-mask": error("ALiBi attention biases are not built"),
    "--z-loss-weight": only("0", "0.0", text="the z-loss is not built"),
    "--attention-head-type": only("multihead", text="the PAI patch's multi-query spelling is not built; use "
                                                    "--group-query-attention --num-query-groups 1"),
    "--qk-nope-head-dim": alias("the PAI patch's spelling of --qk-head-dim", qk_head_dim=int),
    "--qk-rope-head-dim": alias("the PAI patch's spelling of --qk-pos-emb-head-dim", qk_pos_emb_head_dim=int),
    "--transformer-timers": note("per-layer timers are not built; the iteration time is in the log line"),
    "--convert-checkpoint-from-megatron-to-transformers": note("a switch of the PAI conversion tools: no effect on "
                                                               "pretraining (convert with tools/checkpoint/convert.py)"),
    "--optimizer-offload-policy": note("only with --optimizer hybridadam, which is not built: no effect"),
    "--optimizer-offload-auto-threshold": note("only with --optimizer hybridadam, which is not built: no effect"),
    "--optimizer-offload-chunk-size": note("only with --optimizer hybridadam, which is not built: no effect"),
    # Transformer Engine
    "--te-rng-tracker": note("the framework's own tensor-parallel RNG tracker runs"),
    "--inference-rng-tracker": note("the framework's own tensor-parallel RNG tracker runs"),
    # rerun engine
    "--error-injection-rate": only("0", text="error injection is not built"),
    # vision group: query/key normalization is implemented; its L2 variant is not
    "--qk-l2-norm": error("L2 query/key normalization (Llama 4) is not built; --qk-layernorm normalizes with "
                          "--normalization"),
}

# Values of flags this framework implements that upstream's parser accepts and this framework refuses,
# each with the reason (the error message and docs/megatron-compatibility.md show it).
REFUSED_VALUES = {
    "--moe-router-score-function": {
        "sqrtsoftplus": "the sqrt-softplus router score is not built (softmax and sigmoid are)",
    },
    "--position-embedding-type": {
        "yarn": "YaRN scaling of standard attention is not built (of multi-latent attention it is: "
                "--multi-latent-attention --rope-type yarn; Llama 3.1 scaling: --use-rope-scaling)",
        "mrope": "multimodal RoPE is not built",
        "relative": "relative position embeddings (T5) are not built",
    },
    "--optimizer": {**{name: "the optimizers built are adam and sgd" for name in (
        "muon", "dist_muon", "lion", "soap", "adaptive_muon")},
        "hybridadam": "the PAI patch's CPU-offloading HybridAdam is not built; use adam (with "
                      "--use-distributed-optimizer to shard its state)"},
    "--tokenizer-type": {
        **{name: "BERT WordPiece tokenizers are for BERT models, which are not built"
           for name in ("BertWordPieceLowerCase", "BertWordPieceCase")},
        "GPTSentencePieceTokenizer": "use SentencePieceTokenizer or Llama2Tokenizer with the same --tokenizer-model",
        **{name: "the ROCm fork's DeepSeek tokenizers are not built; use HuggingFaceTokenizer with the model's "
                 "tokenizer.json" for name in ("DeepSeekV2Tokenizer", "DeepSeekV3Tokenizer")},
        "TikTokenizer": "tiktoken tokenizers are not built; use HuggingFaceTokenizer with the model's "
                        "tokenizer.json",
        **{name: "multimodal and fine-tuning tokenizers are not built" for name in (
            "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")},
    },
    "--moe-token-dispatcher-type": {"alltoall_seq": "the sequence-sharded all-to-all dispatcher was deprecated and "
                                                    "removed from Megatron-Core; use alltoall"},
    "--transformer-impl": {"inference_optimized": "an inference implementation; pretraining runs local or "
                                                  "transformer_engine"},
    "--dataloader-type": {"external": "Megatron-LM's pass-through of a user's own data loader; pretrain_gpt.py "
                                      "builds its loader (single or cyclic)"},
    "--ckpt-format": {name: "this framework writes one layout-independent format (torch_dist)"
                      for name in ("zarr", "fsdp_dtensor")},
}
