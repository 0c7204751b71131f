"""Chaos: short torchrun jobs on CPU with random kills, hangs, NaNs and SIGTERMs; what survives.

    python bench/chaos.py --jobs 20 --seed 0            # 2 gloo ranks per job

Every job trains a tiny Llama for --iterations iterations under `torchrun --max-restarts 2` with
`--save D --load D --save-interval 2 --exit-signal-handler --skip-iter-on-nan` and a collective
timeout of 15 s, and meets one scenario, drawn at random:

    kill      SIGKILL to a random worker at a random moment (after a random iteration's log line, often
              inside a save): torchrun restarts the job, which resumes from the last checkpoint
    hang      a random rank stops answering in a random iteration (MEGATRON_TEST_FAULTS): the other
              rank times out and names it, torchrun restarts the job
    nan       NaN loss on a random rank in one or two random iterations: skipped (--skip-iter-on-nan)
    nan+kill  a NaN iteration, then a SIGKILL a checkpoint later
    sigterm   SIGTERM to a random worker: every rank saves and exits 0; the job is started again
              with the same command and finishes
    launcher  SIGKILL to torchrun's whole process group after a random iteration's log line: every
              worker must be gone within 5 s and write nothing more; the job is started again with
              the same command (a user resuming at once) and finishes
    two-jobs  both ranks of the job stop in a random iteration (a test-only hang on each: no collective
              is in flight, so nothing times out and the job holds its directory), a second job with
              the same --save (and --load) is started and must be refused at start-up, naming the
              first; the first is then killed (SIGKILL to torchrun's group) and started again, and
              finishes

It reports jobs that finished with every interruption's cause named in the log, jobs that hung
(killed after --job-timeout; must be 0), checkpoints that failed to load (every iter_* directory
is read completely; must be 0), launcher kills that left a worker running or a checkpoint written after the kill (survivors; must be
0), second jobs that were not refused (double writers; must be 0), checkpoints whose files differ
from their recorded checksums (corrupt loads; must be 0), and samples lost or repeated: the consumed-sample count logged at
every iteration of the surviving run must be iteration x global batch, and the final weights and
optimizer state must equal, bit for bit, those of an uninterrupted run that skipped the same NaN
iterations (`--iterations-to-skip`); without NaN iterations, the torch RNG states too.
"""
import argparse
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GLOBAL_BATCH = 4
TIMEOUT_MINUTES = 0.25
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32", "--max-position-embeddings",
         "32", "--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH), "--lr", "1e-3",
         "--lr-warmup-iters", "2", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0",
         "--num-workers", "0", "--distributed-backend", "gloo", "--use-distributed-optimizer",
         "--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
SCENARIOS = ("kill", "hang", "nan", "nan+kill", "sigterm", "launcher", "two-jobs")
SURVIVOR_SECONDS = 5.0


def command(iterations: int, checkpoint: Path, extra: list = ()) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(ROOT / "pretrain_gpt.py"), *FLAGS,
            "--train-iters", str(iterations), "--save", str(checkpoint), "--load", str(checkpoint),
            "--save-interval", "2", "--exit-signal-handler", "--skip-iter-on-nan", *extra]


def plan(scenario: str, rng: random.Random, iterations: int) -> dict:
    """What happens to the job: test-only faults, an external signal and when, the expected causes."""
    rank = rng.randrange(2)
    if scenario == "hang":
        at = rng.randrange(2, iterations)
        return {"faults": f"hang@{at}:{rank}", "causes": [rf"Not answering .*: rank {rank} \(host"]}
    if scenario in ("nan", "nan+kill"):
        nans = sorted(rng.sample(range(2, iterations - 4), 1 if scenario == "nan+kill" else rng.randint(1, 2)))
        faults = [f"nan-loss@{at}:{rank}" for at in nans]
        causes = [rf"iteration {at}: NaN/Inf in the loss on rank {rank}" for at in nans]
        if scenario == "nan+kill":  # a checkpoint after the NaN exists before the kill, so the skip survives
            killed_at = nans[0] + 4
            faults.append(f"kill@{killed_at}:{1 - rank}")
            causes.append(r"exitcode\s*: -9")
        return {"faults": ",".join(faults), "causes": causes, "skipped": nans}
    if scenario == "two-jobs":
        at = rng.randrange(2, iterations - 1)
        return {"faults": f"hang@{at}:0,hang@{at}:1", "second_after": at - 1, "group": True, "causes": []}
    if scenario == "launcher":
        return {"signal": signal.SIGKILL, "group": True, "rank": None, "after": rng.randrange(1, iterations - 1),
                "delay": rng.uniform(0.0, 0.3), "causes": []}
    signum = signal.SIGKILL if scenario == "kill" else signal.SIGTERM
    cause = r"exitcode\s*: -9" if scenario == "kill" else r"exiting after iteration \d+: signal"
    return {"signal": signum, "rank": rank, "after": rng.randrange(1, iterations - 1), "delay": rng.uniform(0.0, 0.3),
            "causes": [cause]}


def worker_pid(agent: int, rank: int):
    try:
        for pid in pathlib.Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
            if f"RANK={rank}".encode() in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
    except OSError:
        pass
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _iterations_on_disk(checkpoint: Path) -> set:
    return {d.name for d in checkpoint.glob("iter_*") if not d.name.endswith((".incomplete", ".replaced"))}


def kill_launcher(process, checkpoint: Path, signal_plan: dict) -> None:
    """SIGKILL to torchrun's process group; records the workers that outlive it by
    SURVIVOR_SECONDS and the checkpoints that appear after the kill."""
    workers = [pid for pid in (worker_pid(process.pid, rank) for rank in (0, 1)) if pid is not None]
    os.killpg(process.pid, signal.SIGKILL)
    written = _iterations_on_disk(checkpoint)
    time.sleep(SURVIVOR_SECONDS)
    survivors = [pid for pid in workers if _alive(pid)]
    signal_plan["survivors"] = len(survivors)
    signal_plan["late_writes"] = len(_iterations_on_disk(checkpoint) - written)
    for pid in survivors:  # ended here so that the benchmark goes on; counted above
        os.kill(pid, signal.SIGKILL)


def second_job(cmd: list, env: dict, signal_plan: dict) -> None:
    """Starts a second job on the same directories while the first runs; records whether it was refused."""
    env = {key: value for key, value in env.items() if key != "MEGATRON_TEST_FAULTS"}
    try:
        second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    except subprocess.TimeoutExpired:  # it ran: a double writer (its processes end with the session's group)
        signal_plan["refused"] = False
        return
    signal_plan["refused"] = second.returncode != 0 and "is in use by another job" in second.stdout + second.stderr


def run(cmd: list, env: dict, log, deadline: float, signal_plan: dict = None):
    """Runs one torchrun, acting on the plan once the planned iteration is logged (a signal to a
    worker or to torchrun's group, or a second job); returns its exit code, or None when it outlived
    the deadline (then it is killed)."""
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    expired = threading.Event()

    def kill_job():
        expired.set()
        os.killpg(process.pid, signal.SIGKILL)

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), kill_job)
    timer.start()
    try:
        for line in process.stdout:
            log.write(line)
            if signal_plan and "second_after" in signal_plan and re.search(
                    rf" iteration +{signal_plan['second_after']}/", line):
                second_job(cmd, env, signal_plan)
                kill_launcher(process, Path(cmd[cmd.index("--save") + 1]), signal_plan)
                signal_plan = None
            elif signal_plan and "after" in signal_plan and re.search(rf" iteration +{signal_plan['after']}/", line):
                time.sleep(signal_plan["delay"])
                if signal_plan.get("group"):
                    kill_launcher(process, Path(cmd[cmd.index("--save") + 1]), signal_plan)
                else:
                    pid = worker_pid(process.pid, signal_plan["rank"])
                    if pid is not None:
                        os.kill(pid, signal_plan["signal"])
                signal_plan = None
        code = process.wait()
    finally:
        timer.cancel()
    return None if expired.is_set() else code


def surviving_consumed(log_text: str) -> dict:
    """{iteration: consumed samples} of the run that survived (later lines replace earlier ones)."""
    consumed = {}
    for iteration, samples in re.findall(r" iteration +(\d+)/ *\d+ \| consumed samples: +(\d+)", log_text):
        consumed[int(iteration)] = int(samples)
    return consumed


def load_all(checkpoint: Path) -> tuple:
    """(checkpoints read, failures): every iter_* directory's checksums verified and its tensors read."""
    from megatron.core.checkpointing.storage import read_full_tensors
    from megatron.training.checkpointing import read_common

    from megatron.core.checkpointing import checksums

    read = failed = 0
    for directory in sorted(checkpoint.glob("iter_*")):
        if directory.name.endswith((".incomplete", ".replaced")):
            continue
        read += 1
        try:
            mismatch = checksums.first_mismatch(str(directory), read_common(str(directory))["checksums"])
            if mismatch is not None:
                raise ValueError(mismatch[0])
            read_full_tensors(str(directory))
        except Exception as error:  # counted and printed: a checkpoint that does not load
            failed += 1
            print(f"    cannot load {directory}: {error}", flush=True)
    return read, failed


def final_state(checkpoint: Path) -> dict:
    from megatron.core.checkpointing.storage import read_full_tensors
    from megatron.training.checkpointing import read_tracker

    return read_full_tensors(str(checkpoint / f"iter_{read_tracker(str(checkpoint)):07d}"))


def same_state(a: dict, b: dict, with_rng: bool) -> bool:
    """Bitwise equality of the weights and the optimizer state, and with `with_rng` of the torch
    generators too (a run that met NaN iterations drew random numbers in them, one told to skip them
    did not). Python's and numpy's global generators are left out: nothing seeds or draws from them,
    so each process starts them from the OS and a checkpoint carries its own."""
    def compared(key: str) -> bool:
        return not key.startswith("rng/") or (with_rng and "/python" not in key and "/numpy" not in key)
    return a.keys() == b.keys() and all(a[key].equal(b[key]) for key in a if compared(key))


def reference(root: Path, iterations: int, skipped: tuple, cache: dict, timeout: float) -> dict:
    """The final state of an uninterrupted run skipping these iterations (Megatron's numbering)."""
    if skipped not in cache:
        checkpoint = root / f"reference_{'_'.join(map(str, skipped)) or 'clean'}"
        extra = ["--iterations-to-skip", *[str(i - 1) for i in skipped]] if skipped else []
        with open(checkpoint.with_suffix(".log"), "w") as log:
            code = run(command(iterations, checkpoint, extra), dict(os.environ), log, time.monotonic() + timeout)
        if code != 0:
            raise SystemExit(f"the reference run failed (exit {code}); see {checkpoint.with_suffix('.log')}")
        cache[skipped] = final_state(checkpoint)
    return cache[skipped]


def describe(what: dict) -> str:
    if "second_after" in what:
        return f"second job after iteration {what['second_after']}"
    if "faults" in what:
        return what["faults"]
    target = "torchrun's group" if what.get("group") else f"rank {what['rank']}"
    return f"{signal.Signals(what['signal']).name} to {target} at iteration {what['after']} + {what['delay']:.2f} s"


def job(index: int, scenario: str, rng: random.Random, args, root: Path, references: dict) -> dict:
    what = plan(scenario, rng, args.iterations)
    checkpoint = root / f"job{index:02d}"
    env = dict(os.environ)
    env.pop("MEGATRON_TEST_FAULTS", None)
    if "faults" in what:
        env["MEGATRON_TEST_FAULTS"] = what["faults"]
    deadline = time.monotonic() + args.job_timeout
    log_path = root / f"job{index:02d}.log"
    with open(log_path, "w") as log:
        acts = "signal" in what or "second_after" in what
        code = run(command(args.iterations, checkpoint), env, log, deadline, what if acts else None)
        if (code == 0 and scenario == "sigterm") or scenario in ("launcher", "two-jobs"):  # the same command again finishes it
            env.pop("MEGATRON_TEST_FAULTS", None)
            code = run(command(args.iterations, checkpoint), env, log, deadline)
    text = log_path.read_text()
    result = {"scenario": scenario, "plan": describe(what), "hung": code is None, "exit": code,
              "survivors": what.get("survivors", 0) + what.get("late_writes", 0),
              "double_writers": int(scenario == "two-jobs" and not what.get("refused"))}
    result["finished"] = code == 0 and f"training finished after {args.iterations} iterations" in text
    result["named"] = all(re.search(cause, text) for cause in what["causes"])
    result["checkpoints"], result["unloadable"] = load_all(checkpoint)
    consumed = surviving_consumed(text)
    result["bad_counts"] = sum(consumed.get(i) != i * GLOBAL_BATCH for i in range(1, args.iterations + 1)
                               if i not in what.get("skipped", ()))
    skipped = tuple(what.get("skipped", ()))
    result["exact"] = result["finished"] and same_state(
        final_state(checkpoint), reference(root, args.iterations, skipped, references, args.job_timeout),
        with_rng=not skipped)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--job-timeout", type=float, default=300.0, help="seconds before a job counts as hung")
    parser.add_argument("--dir", default=None, help="where jobs write (default: a temporary directory)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                        help="the scenarios to draw from, in turn (default: all)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    rng = random.Random(args.seed)
    scenarios = [args.scenarios[i % len(args.scenarios)] for i in range(args.jobs)]
    rng.shuffle(scenarios)
    root = Path(args.dir or tempfile.mkdtemp(prefix="chaos_"))
    root.mkdir(parents=True, exist_ok=True)
    references, results = {}, []
    for index, scenario in enumerate(scenarios):
        start = time.monotonic()
        result = job(index, scenario, rng, args, root, references)
        results.append(result)
        print(f"job {index:2d} {scenario:8s} {result['plan']:36s} exit {result['exit']} finished {result['finished']} "
              f"cause named {result['named']} checkpoints {result['checkpoints']} (unloadable {result['unloadable']}) "
              f"wrong sample counts {result['bad_counts']} equal to reference {result['exact']} "
              f"survivors {result['survivors']} double writers {result['double_writers']} "
              f"({time.monotonic() - start:.0f} s)", flush=True)
    clean = sum(r["finished"] and r["named"] for r in results)
    print(f"\n{args.jobs} jobs ({', '.join(f'{s} {scenarios.count(s)}' for s in args.scenarios)}), logs in {root}")
    print(f"finished with every cause named in the log: {clean}/{args.jobs}")
    print(f"hung (killed after {args.job_timeout:.0f} s): {sum(r['hung'] for r in results)}")
    print(f"checkpoints that failed to load or to match their checksums: {sum(r['unloadable'] for r in results)} of "
          f"{sum(r['checkpoints'] for r in results)}")
    print(f"launcher kills: workers alive {SURVIVOR_SECONDS:.0f} s later or checkpoints written after the kill: "
          f"{sum(r['survivors'] for r in results)}; second jobs not refused (double writers): "
          f"{sum(r['double_writers'] for r in results)}")
    print(f"samples lost or repeated on resume: {sum(r['bad_counts'] for r in results)} iterations with a wrong "
          f"consumed-sample count; final state equal to the uninterrupted reference in "
          f"{sum(r['exact'] for r in results)}/{args.jobs} jobs")


if __name__ == "__main__":
    main()
