"""--log-progress: one line per event in `<--save>/progress.txt`, as Megatron-LM writes it: the job's
start, every checkpoint saved (with throughput, floating-point operations and tokens so far) and the
end of training. Lines of all jobs of a run accumulate in the file, so it tells how a long run
progressed across restarts."""
import datetime
import os
import time


class ProgressLog:
    def __init__(self, config, groups, job_start_time: float):
        enabled = config.logging.log_progress and groups.global_rank == 0
        self.path = os.path.join(config.checkpoint.save, "progress.txt") if enabled else None
        self.world_size = groups.world_size
        self.seq_length = config.training.seq_length
        self.job_start_time = job_start_time
        self.job_start_flops = None

    def append(self, text: str) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        with open(self.path, "a") as handle:
            handle.write(f"{now}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t# GPUs: {self.world_size}\t{text}\n")

    def start(self, state) -> None:
        self.job_start_flops = state.floating_point_operations
        self.append("Starting job")

    def saved(self, state) -> None:
        """A checkpoint of `state` was saved: throughput of this job and the totals so far."""
        seconds = max(time.time() - self.job_start_time, 1e-9)
        job_flops = state.floating_point_operations - (self.job_start_flops or 0.0)
        self.append(f"Saved checkpoint\tIteration: {state.iteration}\t"
                    f"Job throughput: {job_flops / seconds / self.world_size / 1e12:.1f} TFLOP/s/GPU\t"
                    f"Floating-point operations: {state.floating_point_operations:.2e}\t"
                    f"Tokens (in billions): {state.consumed_train_samples * self.seq_length / 1e9:.2f}")

    def finished(self, state) -> None:
        reason = f" ({state.exit_reason})" if state.exit_reason else ""
        self.append(f"Training finished at iteration {state.iteration}{reason}")
