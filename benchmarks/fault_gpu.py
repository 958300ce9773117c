"""GPU fault matrix: one rank of a 2-rank job is killed (SIGKILL) or stalled at a phase of an MoE forward,
for every EP dispatcher and every ``low_latency`` transport. Every other rank must report a named error
within the wait bound and end by itself, and the GPUs must serve the next job.

The two ranks get a GPU each where there are two, and share one otherwise (``launch.group``: a gloo
group, so the ``nccl`` paths move their tensors through gloo; ``meta.wire`` is ``shared-gpu``). On a
shared GPU the ranks run outside any CUDA MPS daemon unless ``--mps inherit``: under MPS a rank that dies
or traps mid-kernel faults every client of the GPU until all of them exit.

Each case is a job of its own: two processes that join as torchrun's would (``init_from_torchrun``, so
the library's wait bound and NCCL settings apply, with ``MOE_SBO_TIMEOUT_S = --bound-s``), tiny preset,
bf16, 16 tokens per rank. Every rank runs two warm-up forwards and compares them with the single-rank
reference (``ready``), the ranks line up (barrier, synchronize), then one more forward in which rank 1
meets its fault at a dispatcher hook:

  pre_dispatch        before its dispatch starts           ("dispatch launch")
  dispatch_in_flight  its dispatch started, never waited   ("in flight")
  pre_combine         before its combine starts            ("combine")

``kill``: it SIGKILLs itself; ``stall``: it sleeps far past the bound (the harness kills it once the
others ended). The harness reads every process's output line by line, stamping each line as it
arrives, and each rank's dispatcher phase from a file both share (``profiling.record_phases_into``).

Per survivor: ``detect_s``, seconds from the fault to its first named error: its own Python exception
(with its phase), NCCL's watchdog line (``Watchdog caught collective operation timeout``, naming the
collective), or the symmetric-memory barrier's trap line (``rank 0 failed to receive signal from rank
1 on channel c``: channel 0 is dispatch, 1 combine); ``exit_s``, seconds to its process's end, and how
it ended; ``stale``: its forward finished as if nothing happened (must never be). A survivor still
running ``--hang-after-s`` after the bound is a hang: the harness kills it. ``gpu_reusable``: the next
job on the same GPUs (the next case, or a last check job) ran its warm-up forwards and matched the
reference. A first job with the default bound compiles the kernels (Triton caches them on disk) and
checks the GPUs work before any fault.

One row per case (``detect_s``: its slowest survivor). Exit status 1 when a case misses a target:
every survivor named its error within bound + 5 s (the default 25 s bound: 30 s), ended by itself,
nothing stale, no hang, GPUs reusable.

Usage (repo root, 1 or 2 GPUs; ``benchmarks/run_gpu_faults.sh`` runs it):
  python benchmarks/fault_gpu.py --out out/fault_h200x2.json [--bound-s 8] [--faults kill stall] \\
      [--cases 'low_latency/symm_mem/*' '*/pre_combine/kill']
CPU (2 gloo ranks, the NCCL-transport paths, float32: checks the harness itself, not a GPU):
  python benchmarks/fault_gpu.py --device cpu --bound-s 3 --cases 'alltoall/*/pre_combine/*' --out /tmp/f.json
Time: ~9-10 s to start a job and run its warm-up, plus the bound and ~1 s: ~18 s a case at 8 s, so
the 30 cases take ~9 min, each fault's 15 ~4.5 min (an estimate; the rows record each case's time).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moe_sbo import env
from moe_sbo.launch.group import free_port, group_backend
from moe_sbo.measure.results import result_meta, write_results

# (dispatcher, transport): every way a GPU user can move tokens between ranks.
PATHS = (
    ("allgather", "nccl"),
    ("alltoall", "nccl"),
    ("low_latency", "nccl"),
    ("low_latency", "symm_mem"),
    ("low_latency", "copy_engine"),
)
FAULT_POINTS = {"pre_dispatch": "dispatch launch", "dispatch_in_flight": "in flight", "pre_combine": "combine"}
FAULTS = ("kill", "stall")
WORLD = 2
VICTIM = 1
TOKENS = 16
WARMUP = 2
BF16_REL_TOL = 2e-2  # as tests/test_gpu.py: bf16 on the wire and in the GEMMs vs the same math on one rank
TARGET_MARGIN_S = 5.0  # a survivor's report may come this long after the bound (25 s bound: 30 s)
STALL_S = 3600  # a stalled rank sleeps this long; the harness kills it
EVENT = "FAULT_GPU "  # the prefix of the rank processes' own report lines (JSON follows)
# What a survivor's output says when its bounded wait ran out, by who says it.
NAMED_LINES = (
    ("nccl_watchdog", re.compile(r"Watchdog caught collective operation timeout|collective operation timeout")),
    ("symm_mem_trap", re.compile(r"failed to (send|receive) signal")),
    ("nccl_error", re.compile(r"DistBackendError|NCCL communicator was aborted|ncclRemoteError|ncclSystemError")),
)


def paths_on(device: str) -> tuple[tuple[str, str], ...]:
    """The paths a device runs: symmetric memory needs GPUs."""
    return PATHS if device == "cuda" else tuple(p for p in PATHS if p[1] == "nccl")


@dataclass(frozen=True)
class Case:
    """One job on ``device``: ``dispatcher``/``transport`` (``all``: every path, a job without a
    fault), where the victim meets its ``fault`` (``""``: none)."""

    dispatcher: str
    transport: str = ""
    fault_at: str = ""
    fault: str = ""
    device: str = "cuda"

    @property
    def label(self) -> str:
        return "/".join(p for p in (self.dispatcher, self.transport, self.fault_at, self.fault) if p)

    def paths(self) -> tuple[tuple[str, str], ...]:
        return paths_on(self.device) if self.dispatcher == "all" else ((self.dispatcher, self.transport),)


# ---- one rank of a job (its own process) ------------------------------------------------------------------


def _emit(event: str, **fields) -> None:
    print(EVENT + json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def _meet_fault(fault: str) -> None:
    _emit("fault", fault=fault)
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(STALL_S)  # alive and silent: only the others' wait bound ends their wait


def rank_main(case: Case, phase_file: str) -> None:
    import torch.distributed as dist

    from moe_sbo import profiling
    from moe_sbo.config import get_preset
    from moe_sbo.launch.group import init_from_torchrun
    from moe_sbo.layer import MoELayer

    device = init_from_torchrun(case.device)
    cuda = device.type == "cuda"
    dtype, tolerance = (torch.bfloat16, BF16_REL_TOL) if cuda else (torch.float32, 1e-5)
    rank = dist.get_rank()
    with open(phase_file, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 2 * WORLD)
    profiling.record_phases_into(memoryview(shared)[2 * rank : 2 * rank + 2])
    cfg = get_preset("tiny")
    generator = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(TOKENS - rank, cfg.hidden_size, generator=generator, device=device).to(dtype)
    layers, errors = [], {}
    with torch.inference_mode():
        reference = MoELayer(cfg, dispatcher="local", dtype=dtype, device=device, seed=1)(x).float()
        for name, transport in case.paths():
            options = {"max_tokens_per_rank": TOKENS, "transport": transport} if name == "low_latency" else None
            layer = MoELayer(cfg, dispatcher=name, dtype=dtype, device=device, seed=1, dispatcher_options=options)
            for _ in range(WARMUP):
                y = layer(x).float()
            errors[f"{name}/{transport}"] = ((y - reference).norm() / reference.norm()).item()
            layers.append(layer)
    sync = torch.cuda.synchronize if cuda else lambda: None
    sync()
    backend = None
    if cuda:
        try:
            from torch.distributed import _symmetric_memory as symm_mem

            backend = symm_mem.get_backend(device)
        except (ImportError, AttributeError, RuntimeError):
            pass
    _emit("ready", ok=all(e <= tolerance for e in errors.values()), rel_err=errors, symm_mem_backend=backend)
    dist.barrier()
    sync()
    if case.fault and rank == VICTIM:
        layers[0].dispatcher.hooks.register(case.fault_at, lambda d, payload: _meet_fault(case.fault), once=True)
    try:
        with torch.inference_mode():
            for layer in layers:
                layer(x)
        sync()  # a device-side failure surfaces here at the latest
        _emit("finished", phase=profiling.current_phase())  # with a dead or stalled peer: stale data
        dist.barrier()  # a rank that got through still waits on the group, so it is still measured
        sync()
        _emit("done")
    except BaseException as exc:  # noqa: BLE001 - whatever ended the wait is the report
        _emit("error", error=f"{type(exc).__name__}: {exc}"[:800], phase=profiling.current_phase())
        os._exit(1)  # no teardown that could wait on the dead context or communicator
    os._exit(0)


# ---- the harness ---------------------------------------------------------------------------------------


@dataclass
class RankProcess:
    """A rank's process and its output lines, each stamped (wall clock) as it arrived."""

    rank: int
    proc: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)
    ended_at: float | None = None
    killed: bool = False  # by the harness

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def events(self, name: str) -> list[dict]:
        found = []
        for _, line in list(self.lines):
            if line.startswith(EVENT):
                event = json.loads(line[len(EVENT) :])
                if event["event"] == name:
                    found.append(event)
        return found

    def poll(self) -> bool:
        """Whether the process has ended (its end time noted when first seen)."""
        if self.ended_at is None and self.proc.poll() is not None:
            self.ended_at = time.time()
        return self.ended_at is not None

    def kill(self) -> None:
        if not self.poll():
            self.killed = True
            self.proc.kill()
            self.proc.wait()
            self.ended_at = time.time()

    def how_it_ended(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "running"
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"

    def tail(self, lines: int = 15) -> str:
        return "\n".join(line[:300] for _, line in self.lines[-lines:])


@dataclass
class Job:
    case: Case
    ranks: list[RankProcess]
    phase_file: Path
    threads: list[threading.Thread]

    @classmethod
    def start(cls, case: Case, bound_s: float, mps: str = "off") -> Job:
        port = free_port()
        fd, name = tempfile.mkstemp(prefix="moe_sbo_phases_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.write(fd, bytes(2 * WORLD))
        os.close(fd)
        # Line-buffered C stdio too: the device's printf (the barrier's trap line) goes through it, and
        # a process that ends by a signal never flushes a full buffer.
        prefix = ["stdbuf", "-oL", "-eL"] if shutil.which("stdbuf") else []
        script = os.path.abspath(__file__)
        command = [*prefix, sys.executable, script, "rank", "--case", json.dumps(asdict(case)), "--phase-file", name]
        ranks, threads = [], []
        for rank in range(WORLD):
            child_env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(WORLD),
                LOCAL_WORLD_SIZE=str(WORLD),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                MOE_SBO_TIMEOUT_S=repr(bound_s),
                PYTHONUNBUFFERED="1",
            )
            if mps == "off":
                child_env.update(env.outside_mps())
            proc = subprocess.Popen(
                command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
            ranks.append(RankProcess(rank, proc))
            threads.append(threading.Thread(target=ranks[-1].read, daemon=True))
            threads[-1].start()
        return cls(case, ranks, Path(name), threads)

    def wait_for(self, event: str, ranks: list[int], timeout_s: float) -> bool:
        """Until each of ``ranks`` printed ``event``; False at the deadline or when one of them ended."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.ranks[r].events(event) for r in ranks):
                return True
            if any(self.ranks[r].poll() for r in ranks):
                time.sleep(0.2)  # its last lines may still be in the pipe
                return all(self.ranks[r].events(event) for r in ranks)
            time.sleep(0.05)
        return False

    def wait_ended(self, ranks: list[int], deadline: float) -> None:
        while time.time() < deadline and not all(self.ranks[r].poll() for r in ranks):
            time.sleep(0.05)

    def phases(self) -> list[str]:
        from moe_sbo import profiling

        data = self.phase_file.read_bytes()
        return [profiling.describe_phase(data[2 * r : 2 * r + 2]) for r in range(WORLD)]

    def close(self) -> None:
        for rank in self.ranks:
            rank.kill()
        for thread in self.threads:
            thread.join(timeout=5)
        self.phase_file.unlink(missing_ok=True)


def _first_named_error(rank: RankProcess) -> tuple[float, str, str, str] | None:
    """(when, source, text, phase) of the first line in which this rank names its failed wait."""
    for arrived, line in list(rank.lines):
        if line.startswith(EVENT):
            event = json.loads(line[len(EVENT) :])
            if event["event"] == "error":
                return event["t"], "python", event["error"], event.get("phase", "")
            continue
        for source, pattern in NAMED_LINES:
            if pattern.search(line):
                return arrived, source, line.strip()[:800], ""
    return None


def ready_check(job: Job, timeout_s: float) -> tuple[bool, dict]:
    """Whether every rank ran its warm-up forwards and matched the reference; its errors."""
    ready = job.wait_for("ready", list(range(WORLD)), timeout_s)
    events = [r.events("ready") for r in job.ranks]
    detail = {"rel_err": [e[0]["rel_err"] for e in events if e], "symm_mem_backend": None}
    if events[0]:
        detail["symm_mem_backend"] = events[0][0].get("symm_mem_backend")
    return ready and all(e[0]["ok"] for e in events), detail


def run_healthy(device: str, bound_s: float, timeout_s: float, mps: str = "off") -> tuple[bool, dict]:
    """A job without a fault over every path: its warm-up right and both ranks done."""
    job = Job.start(Case("all", device=device), bound_s, mps)
    try:
        ok, detail = ready_check(job, timeout_s)
        done = ok and job.wait_for("done", list(range(WORLD)), 60)
        if not done:
            detail["log_tail"] = [r.tail(20) for r in job.ranks]
        return done, detail
    finally:
        job.close()


def run_case(
    case: Case, bound_s: float, hang_after_s: float, start_timeout_s: float, mps: str = "off"
) -> tuple[dict, bool]:
    """One fault case -> (its row without ``gpu_reusable``, whether its job got ready: the GPUs it
    started on were usable)."""
    started = time.time()
    row: dict = {
        "bench": "fault_gpu",
        "case": case.label,
        "dispatcher": case.dispatcher,
        "transport": case.transport,
        "fault_at": case.fault_at,
        "phase": FAULT_POINTS[case.fault_at],
        "fault": case.fault,
        "victim": VICTIM,
        "bound_s": bound_s,
    }
    job = Job.start(case, bound_s, mps)
    try:
        ready, detail = ready_check(job, start_timeout_s)
        row["warmup_rel_err"] = max((e for d in detail["rel_err"] for e in d.values()), default=None)
        row["symm_mem_backend"] = detail["symm_mem_backend"]
        if not ready:
            row["error"] = "the job did not get ready (warm-up forwards)"
            row["log_tail"] = [r.tail(30) for r in job.ranks]
            return row, False
        victim = job.ranks[VICTIM]
        if not job.wait_for("fault", [VICTIM], 60):
            row["error"] = "the victim never reached its fault"
            row["log_tail"] = [r.tail(30) for r in job.ranks]
            return row, True
        fault_t = victim.events("fault")[0]["t"]
        survivors = [r for r in range(WORLD) if r != VICTIM]
        job.wait_ended(survivors, fault_t + bound_s + hang_after_s)
        phases = job.phases()  # before anything is killed: where each rank was
        for r in survivors:
            job.ranks[r].kill()  # a survivor still running here hangs
        time.sleep(0.2)  # the last lines of the ended processes
        reports = []
        for r in survivors:
            rank = job.ranks[r]
            named = _first_named_error(rank)
            reports.append(
                {
                    "rank": r,
                    "detect_s": None if named is None else named[0] - fault_t,
                    "error_source": None if named is None else named[1],
                    "error": None if named is None else named[2],
                    "python_phase": None if named is None else named[3],
                    "phase": phases[r],
                    "exit_s": None if rank.killed or rank.ended_at is None else rank.ended_at - fault_t,
                    "ended": rank.how_it_ended(),
                    "ended_by_itself": not rank.killed,
                    "stale": bool(rank.events("finished")),
                    "log_tail": rank.tail(),
                }
            )
        victim.kill()  # the stalled one, still asleep
        detected = [s["detect_s"] for s in reports]
        row.update(
            detect_s=None if None in detected else max(detected),
            exit_s=None if any(s["exit_s"] is None for s in reports) else max(s["exit_s"] for s in reports),
            named=all(s["error_source"] is not None for s in reports),
            error_source=",".join(sorted({str(s["error_source"]) for s in reports})),
            error=reports[0]["error"],
            survivor_phase=reports[0]["phase"],
            survivor_ended=reports[0]["ended"],
            ended_by_itself=all(s["ended_by_itself"] for s in reports),
            stale=any(s["stale"] for s in reports),
            hang=not all(s["ended_by_itself"] for s in reports),
            victim_phase=phases[VICTIM],
            survivors=reports,
        )
        return row, True
    finally:
        job.close()
        row["case_wall_s"] = time.time() - started


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def within_target(row: dict) -> bool:
    return bool(
        row.get("named")
        and row.get("detect_s") is not None
        and row["detect_s"] <= row["bound_s"] + TARGET_MARGIN_S
        and row.get("ended_by_itself")
        and not row.get("stale")
        and row.get("gpu_reusable")
    )


def select_cases(device: str, faults: list[str], patterns: list[str] | None) -> list[Case]:
    cases = [
        Case(name, transport, point, fault, device)
        for fault in faults
        for name, transport in paths_on(device)
        for point in FAULT_POINTS
    ]
    if patterns:
        cases = [c for c in cases if any(fnmatch.fnmatch(c.label, p) for p in patterns)]
    return cases


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:
        p = argparse.ArgumentParser(prog="fault_gpu.py rank")
        p.add_argument("--case", required=True)
        p.add_argument("--phase-file", required=True)
        args = p.parse_args(argv[1:])
        rank_main(Case(**json.loads(args.case)), args.phase_file)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="result file (JSON)")
    p.add_argument("--bound-s", type=float, default=8.0, help="the wait bound of the fault jobs (MOE_SBO_TIMEOUT_S)")
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--cases", nargs="*", default=None, help="glob patterns over dispatcher/transport/fault_at/fault")
    p.add_argument(
        "--hang-after-s", type=float, default=30.0, help="a survivor running this long after the bound hangs"
    )
    p.add_argument("--start-timeout-s", type=float, default=120.0, help="the most a job may take to get ready")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, to check the harness")
    p.add_argument(
        "--mps",
        default="off",
        choices=("off", "inherit"),
        help="off: the ranks run outside any CUDA MPS daemon; inherit: as this environment has it",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no GPU", file=sys.stderr)
        return 2
    cases = select_cases(args.device, args.faults, args.cases)
    if not cases:
        print(f"no case matches {args.cases}", file=sys.stderr)
        return 2
    meta = result_meta(args.device, WORLD)
    meta.update(
        bench="fault_gpu",
        preset="tiny",
        dtype="bfloat16" if args.device == "cuda" else "float32",
        tokens_per_rank=TOKENS,
        bound_s=args.bound_s,
        hang_after_s=args.hang_after_s,
        target=f"every survivor names its error within bound_s + {TARGET_MARGIN_S:g} s, ends by itself, "
        "nothing stale, GPUs reusable",
        nccl_env={k: os.environ.get(k, v) for k, v in env.nccl_error_handling(args.bound_s).items()},
        group_backend=group_backend(args.device, WORLD, torch.cuda.device_count()),
        mps=args.mps == "inherit" and env.mps_running(),
    )
    started = time.time()
    print(f"{len(cases)} cases, bound {args.bound_s:g} s; first a job that compiles the kernels", flush=True)
    before_ok, before = run_healthy(args.device, env.DEFAULT_TIMEOUT_S, args.start_timeout_s, args.mps)
    meta["gpus_ok_before"] = before_ok
    meta["before"] = before
    print(f"[{time.time() - started:6.1f}s] GPUs {'work' if before_ok else 'FAIL'} before the faults", flush=True)
    rows: list[dict] = []
    try:
        for case in cases:
            row, ready = run_case(case, args.bound_s, args.hang_after_s, args.start_timeout_s, args.mps)
            if rows:  # this job starting right is the previous case's "GPUs reusable"
                checked_by = case.label
                if not ready:  # tell a wedged GPU from this case's own trouble
                    ready, _ = run_healthy(args.device, args.bound_s, args.start_timeout_s, args.mps)
                    checked_by = "a healthy job after it"
                rows[-1].update(gpu_reusable=ready, reuse_checked_by=checked_by)
                rows[-1]["within_target"] = within_target(rows[-1])
            rows.append(row)
            print(
                f"[{time.time() - started:6.1f}s] {case.label:<45} detect {_seconds(row.get('detect_s'))}, "
                f"{row.get('error_source')}, {row.get('survivor_ended')}, survivor {row.get('survivor_phase')!r}"
                + (f", ERROR: {row['error']}" if "error" in row and not row.get("named") else ""),
                flush=True,
            )
            write_results(args.out, meta, rows)
        if rows:
            ready, _ = run_healthy(args.device, args.bound_s, args.start_timeout_s, args.mps)
            rows[-1].update(gpu_reusable=ready, reuse_checked_by="a healthy job after it")
            rows[-1]["within_target"] = within_target(rows[-1])
    finally:
        meta["wall_s"] = time.time() - started
        write_results(args.out, meta, rows)
    missed = [r["case"] for r in rows if not r.get("within_target")]
    print(f"{len(rows) - len(missed)}/{len(rows)} cases within target; {meta['wall_s']:.0f} s; written to {args.out}")
    for label in missed:
        print(f"  missed: {label}")
    return 1 if missed or not before_ok else 0


if __name__ == "__main__":
    sys.exit(main())
