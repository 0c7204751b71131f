"""How each Megatron-LM flag that this framework's parser does not define is treated.

A flag our parser defines is implemented (with Megatron-LM's meaning); nothing here overrides it, so
a flag gains that status as soon as a config field defines it. The others are:

- note: accepted; one start-up note says what runs instead (kernel and communication choices,
  settings of features that do not change the trained model, deprecated no-ops of Megatron-LM);
- only: accepted with the listed values, which are Megatron-LM's defaults and what runs here; any
  other value is an error naming the flag;
- error: the flag would change the result and is not implemented; an error names it and the way out.

A flag without its own entry takes its argument group's treatment.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Treatment:
    kind: str           # "note", "only" or "error"
    text: str
    values: tuple = ()  # "only": the accepted values


def note(text: str) -> Treatment:
    return Treatment("note", text)


def error(text: str) -> Treatment:
    return Treatment("error", text)


def only(*values: str, text: str) -> Treatment:
    return Treatment("only", text, tuple(values))


_FUSION = "a kernel choice: the unfused PyTorch ops run (torch.compile fuses RMSNorm, RoPE and SwiGLU on GPU)"
_TP_OVERLAP = ("tensor-parallel communication is not overlapped with the GEMMs (Transformer Engine userbuffers); "
               "the collectives run between them")
_FP8 = "FP8/FP4 training is not built in this version; train in bf16 (--bf16)"
_CKPT_IO = ("every rank writes only its own pieces of the layout-independent checkpoint, and a load reads what "
            "its layout needs; there is nothing to choose")
_NOT_GPT = "used by Megatron-LM's BERT/T5/retriever models only; no effect on GPT pretraining"
_WANDB = "Weights & Biases logging is not built; use --tensorboard-dir"

GROUPS = {
    "rl": error("reinforcement learning (GRPO) is not built here"),
    "biencoder": error("biencoder/ICT retrieval models are not built here"),
    "vision": error("vision models are not built here"),
    "moe": error("mixture-of-experts models are not built here (dense GPT and Llama only)"),
    "mla": error("multi-latent attention is not built here"),
    "heterogeneous architecture": error("heterogeneous layer configurations are not built here"),
    "retro": error("Retro is not built here"),
    "experimental": error("hybrid/Mamba models, --spec and the precision-aware optimizer are not built here"),
    "kitchen": error("Kitchen quantization is not built here"),
    "sft": error("supervised fine-tuning datasets are not built here"),
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
    "Transformer-Engine": error(_FP8),
    "rerun engine": note("the re-run state machine is not built: a step whose gradients are not finite is "
                         "skipped and counted in the log line"),
}

FLAGS = {
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
    "--use-rotary-position-embeddings": error("deprecated in Megatron-LM: use --position-embedding-type rope"),
    "--rotary-seq-len-interpolation-factor": error("RoPE sequence-length interpolation is not built"),
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
    "--multi-latent-attention": error("multi-latent attention is not built"),
    "--mtp-num-layers": error("multi-token prediction is not built"),
    "--mtp-loss-scaling-factor": error("multi-token prediction is not built"),
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
    "--recompute-activations": error("use --recompute-granularity selective (its meaning in Megatron-LM)"),
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
    "--rope-type": only("rope", text="only standard RoPE (rope) is built"),
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
    "--reuse-grad-buf-for-mxfp8-param-ag": error(_FP8),
    # distributed
    "--pipeline-model-parallel-layout": error("custom pipeline layouts are not built; use "
                                              "--decoder-first/last-pipeline-num-layers"),
    "--model-parallel-size": error("Megatron-LM's old flag: use --tensor-model-parallel-size"),
    "--microbatch-group-size-per-virtual-pipeline-stage": note("the interleaved schedule runs micro-batches in "
                                                                "groups of the pipeline size"),
    "--no-overlap-p2p-communication": note("pipeline sends and receives of a step are batched together"),
    "--overlap-p2p-communication-warmup-flush": note("pipeline sends and receives of a step are batched together"),
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
    # Transformer Engine
    "--te-rng-tracker": note("the framework's own tensor-parallel RNG tracker runs"),
    "--inference-rng-tracker": note("the framework's own tensor-parallel RNG tracker runs"),
    # rerun engine
    "--error-injection-rate": only("0", text="error injection is not built"),
    # vision group: query/key normalization is implemented; its L2 variant is not
    "--qk-l2-norm": error("L2 query/key normalization (Llama 4) is not built; --qk-layernorm normalizes with "
                          "--normalization"),
}
