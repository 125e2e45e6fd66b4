"""Sequence-parallel points: P processes measure one point together; rank 0 writes the row.

Where the processes come from:
- ``python -m harness variant=ring variant.world_size=4``: the harness starts ranks 1..P-1 itself
  (torch.multiprocessing, spawn) and is rank 0; the rendezvous is a free TCP port on 127.0.0.1.
- launched by ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or by SLURM's ``srun``
  (SLURM_PROCID, SLURM_NTASKS; MASTER_ADDR defaults to SLURM_LAUNCH_NODE_IPADDR, MASTER_PORT to
  29500): every process runs the same command and joins that group.

Two groups. The control group (gloo, the default group) carries the commands and the records: rank 0
broadcasts each point's N, every rank measures it and sends back its record. Each point is measured on
a fresh group (gloo on CPU, NCCL on CUDA) whose timeout is ``distributed.timeout_s``: a rank that raises
reports its error, the others' transfers time out, every rank reports, the point is an ``error`` row
and the next point runs on a new group. (That is gloo's behaviour; on NCCL the timed-out transfers are
ended by NCCL's watchdog, which ends the processes: the run stops and is resumed by running it again.)
Every rank times the same number of calls: the calls per sample are fixed from the slowest rank's first
call, each sample starts at a barrier and lasts as long as the slowest rank (the per-sample maximum over
ranks), so the times are the slowest rank's.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from variants.seqpar import SequenceParallel, shard

from .config import ConfigError, Settings, launched, one_line, ranks_here
from .measure import Timing, _stats, measure_point, synchronize, with_before

CONTROL_SLACK_S = 600  # the control group waits for a whole point: timeout_s plus the passes' budget plus this


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    address: str
    port: int
    local_rank: int


def from_environment() -> Rendezvous | None:
    """The group this process was launched into by torchrun or SLURM, or None (harness.config.launched)."""
    found = launched()
    return None if found is None else Rendezvous(**found)


def init_group(rv: Rendezvous, timeout_s: float) -> None:
    """The control group: gloo over TCP, whatever the device (commands and records are CPU objects)."""
    dist.init_process_group("gloo", init_method=f"tcp://{rv.address}:{rv.port}", rank=rv.rank,
                            world_size=rv.world_size, timeout=timedelta(seconds=timeout_s))


def check(settings: Settings, attn, device: torch.device) -> None:
    """Bad input of the workload the variant runs (its own check: ulysses needs heads divisible by its
    world size) and of a sequence-parallel run, one line each (run.validate calls it)."""
    attn.check_workload(settings.num_heads)
    P = attn.world_size
    rv = from_environment()
    if rv is not None and rv.world_size != P:  # P == 1: each process would run the whole point on its own
        raise ConfigError(f"{attn.name} runs in one process, but the launcher (torchrun, srun) started "
                          f"{rv.world_size}; allowed: one process, or a sequence-parallel variant (ring, ulysses) "
                          f"with variant.world_size={rv.world_size}" if P == 1 else
                          f"{attn.name}: variant.world_size={P} but the launcher started {rv.world_size} "
                          f"processes; allowed: variant.world_size={rv.world_size}")
    if P == 1:
        return
    if settings.task is not None:
        raise ConfigError(f"task=mqar trains on one process; with {attn.name} world_size={P} allowed: task=none")
    # On CPU the harness starts P - 1 processes here, each importing torch and holding its own copy of the
    # workload: a few per core is a correctness test (P = 2, 3 on 2 cores); far more thrashes the machine
    # or meets the kernel's OOM killer. Ranks joined from torchrun or SLURM were placed by their launcher.
    per_core = 4
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if device.type == "cpu" and rv is None and P > per_core * cores:
        raise ConfigError(f"{attn.name}: variant.world_size={P} would start {P} processes on the {cores} CPU cores "
                          f"this process may use (each imports torch and holds the workload: more than {per_core} "
                          f"per core thrashes or meets the OOM killer); allowed: variant.world_size up to "
                          f"{per_core * cores} here, or ranks launched by torchrun or srun")
    # On CUDA each rank of a machine takes the GPU of its local rank (NCCL refuses two ranks on one GPU):
    # a rank without one would fail at start and leave the others waiting out the control timeout.
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    if gpus is not None and rv is None and P > gpus:
        raise ConfigError(f"{attn.name}: variant.world_size={P} ranks on CUDA need a GPU each, this machine has "
                          f"{gpus}; allowed: variant.world_size up to {gpus}, or device=cpu ({P} processes, gloo)")
    if gpus is not None and rv is not None and rv.local_rank >= gpus:
        raise ConfigError(f"{attn.name}: this rank's local rank {rv.local_rank} has no GPU (this machine has "
                          f"{gpus}); allowed: at most {gpus} ranks per machine, or device=cpu")


# ----- timing every rank in step -----------------------------------------------------------------

def time_in_step(fn: Callable[[], object], device: torch.device, opts, group,
                 before: Callable[[], object] | None = None) -> Timing:
    """Median and IQR over samples of the slowest rank's time per call (see module doc); ``before`` runs
    ahead of every call, inside the timed block (as on CPU: ``measure.time_fn``)."""
    fn = with_before(fn, before)

    def timed(calls: int) -> float:
        dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        return (time.perf_counter() - start) / calls

    one = slowest(timed(1), device, group)  # a float: the slowest rank's first call
    samples = opts.min_samples if one * opts.min_samples <= opts.max_run_time else max(1, int(opts.max_run_time / one))
    calls = max(1, int(opts.min_run_time / samples / one))
    per_call = slowest([timed(calls) for _ in range(samples)], device, group)
    return _stats([t * 1e3 for t in per_call])


def slowest(values: list[float] | float, device: torch.device, group) -> Any:
    """The element-wise maximum over ranks (on the point's group: a failed point abandons it whole)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# ----- the team: who measures, who writes --------------------------------------------------------

def control_timeout_s(s: Settings) -> float:
    """How long the control group waits for every rank's record of one point: bounded, never a hang."""
    return s.dist_timeout_s + 4 * s.measure.max_run_time + CONTROL_SLACK_S


class Team:
    """This process's part in a sequence-parallel run. Rank 0 runs the harness loop and calls
    ``measure`` for each point (run.run_point's measurement step); every other rank ``serve``s."""

    def __init__(self, rv: Rendezvous, settings: Settings, attn: SequenceParallel, device: torch.device) -> None:
        self.rv, self.attn, self.device = rv, attn, device
        self.backend = dist_backend(device)
        # No fidelity: its float64 reference needs the whole sequence in one process (the tests check
        # ring and ulysses against it instead).
        self.settings = dataclasses.replace(settings, fidelity=dataclasses.replace(settings.fidelity, enabled=False))
        self.clean = False  # every rank left its loop by the stop command
        # Why the control group broke (a rank's process ended: killed, out of memory): the run stops. No
        # point can run after it, and none is recorded for it but the one it broke in.
        self.lost: str | None = None

    @property
    def rank(self) -> int:
        return self.rv.rank

    def serve(self) -> None:
        from .run import RunFailed

        try:
            while True:
                command = [None]
                dist.broadcast_object_list(command, src=0)
                if command[0] is None:
                    self.stop()
                    return
                dist.gather_object(self.measure_rank(command[0]), None, dst=0)
        except RuntimeError as e:  # the control group's transfers (a point's own failures are recorded)
            raise RunFailed(f"rank {self.rank}: {lost_group(e)}") from None

    def stop(self) -> None:
        """Rank 0 says stop; every rank then meets at a barrier, so that no rank tears its connections
        down (destroy_process_group) while another still reads from them."""
        if self.rank == 0:
            dist.broadcast_object_list([None], src=0)
        dist.barrier()
        self.clean = True

    def measure(self, attn, s: Settings, seq_len: int, device: torch.device, rec: dict[str, Any],
                on_phase) -> dict[str, Any]:
        """Rank 0: every rank measures ``seq_len``; their records merged into ``rec`` (see merge)."""
        from .env import OtherLoad
        from .run import RunFailed

        try:
            dist.broadcast_object_list([seq_len], src=0)
        except RuntimeError as e:  # a rank left between points: nothing measured, nothing to record
            raise RunFailed(f"{lost_group(e)} before N={seq_len}") from None
        load, start = OtherLoad(), [time.monotonic()]

        def phase(name: str) -> None:  # others' load from the end of the warm-up, as in run.measure_quietest
            if name != "warm-up" and not load.started:
                load.start()
                start[0] = time.monotonic()
            on_phase(name)
        mine = self.measure_rank(seq_len, phase)
        busy, wall = load.stop(), time.monotonic() - start[0]
        records = [None] * self.rv.world_size
        try:
            dist.gather_object(mine, records, dst=0)
        except RuntimeError as e:  # a rank left during this point: the point's error, then the run stops
            self.lost = f"{lost_group(e)} at N={seq_len}"
            own = f" (rank 0: {mine['reason']})" if mine["status"] != "ok" else ""
            return {**rec, "status": "error", "reason": one_line(f"a rank left the group during the point{own}")[:500]}
        return merge(rec, records, self.backend, busy, wall, s)

    def measure_rank(self, seq_len: int, on_phase=lambda phase: None) -> dict[str, Any]:
        """This rank's measurement of one point on a fresh group; a failure is recorded, not raised."""
        from .run import failure

        s, attn, P = self.settings, self.attn, self.rv.world_size
        rec: dict[str, Any] = {"status": "ok"}
        cpu, marks, group = os.times(), {}, None

        def phase(name: str) -> None:  # bytes of the warm-up's calls, and CPU time after it: the first phase after it
            nonlocal cpu
            if name == "warm-up":
                marks["start"] = attn.bytes_sent
            elif "calls" not in marks and "start" in marks:
                marks["calls"] = attn.bytes_sent - marks["start"]
                cpu = os.times()
            on_phase(name)

        try:
            group = dist.new_group(backend=self.backend, timeout=timedelta(seconds=s.dist_timeout_s))
            attn.group = group
            measure_point(attn, batch_size=s.batch_at(seq_len), num_heads=s.num_heads, seq_len=seq_len,
                          head_dim=s.head_dim, dtype=s.torch_dtype, device=self.device, causal=s.causal,
                          seed=s.seed, opts=s.measure, record=rec, on_phase=phase,
                          shard=lambda t: shard(t, self.rank, P, attn.layout_name).contiguous(),
                          timer_fn=lambda fn, device, opts, before=None: time_in_step(fn, device, opts, group, before))
            dist.destroy_process_group(group)  # a failed point's group is abandoned instead
        except Exception as e:
            rec.update(failure(e))
        finally:
            attn.group = None
        now = os.times()
        calls = max(1, s.measure.warmup_iters)
        rec.update(bytes_sent=marks["calls"] // calls if "calls" in marks else None, hostname=socket.gethostname(),
                   own_cpu_s=now.user + now.system - cpu.user - cpu.system)
        return rec


def lost_group(e: Exception) -> str:
    """What a broken control group says: a rank's process ended (only a dead peer or a transfer past
    the control timeout breaks it; a point's own failures are recorded by its ranks)."""
    return one_line(f"the ranks' group broke, a rank's process having ended (killed, out of memory?) or "
                    f"stopped answering: {type(e).__name__}: {str(e).split('. ')[0]}")[:300]  # gloo's advice left out


TIMED = ("setup_s", "warmup_s", "fwd_ms", "fwd_iqr_ms", "fwd_samples", "bwd_ms", "bwd_iqr_ms", "bwd_samples",
         "fwd_bwd_ms", "fwd_bwd_iqr_ms", "fwd_bwd_samples")
SECONDARY = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


def merge(rec: dict[str, Any], records: list[dict[str, Any]], backend: str, busy: float | None, wall: float,
          s: Settings) -> dict[str, Any]:
    """One row from every rank's record: the times are already the slowest rank's (time_in_step), the
    warm-up the longest; each rank's peak and the largest; each rank's bytes sent. A failed point names
    the rank whose failure was first: one that raised, rather than one whose transfers then timed out."""
    from .measure import noise, noise_fields, spare_cores

    failed = [(i, r) for i, r in enumerate(records) if r["status"] != "ok"]
    peaks = [r.get("peak_mem_bytes") for r in records]
    rec.update(world_size=len(records), dist_backend=backend, bytes_sent_per_rank=[r["bytes_sent"] for r in records],
               peak_mem_per_rank_bytes=peaks if None not in peaks else None,
               peak_mem_bytes=max(peaks) if None not in peaks else None)
    if failed:
        i, r = min(failed, key=lambda f: any(w in (f[1]["reason"] or "").lower() for w in SECONDARY))
        rec.update(status=r["status"], reason=one_line(f"rank {i}: {r['reason']}")[:500])
        return rec
    rec.update({k: records[0].get(k) for k in TIMED})
    rec.update({k: max(r[k] for r in records) for k in ("setup_s", "warmup_s")})  # the slowest rank's
    if busy is not None:  # the other ranks on this machine are not "other processes"
        siblings = sum(r["own_cpu_s"] for r in records[1:] if r["hostname"] == records[0]["hostname"])
        rec["other_cpu_cores"] = max(0.0, busy - siblings / wall)
    local = sum(r["hostname"] == records[0]["hostname"] for r in records)  # ranks launching on this machine
    found = noise({**rec, "other_cpu_cores": rec.get("other_cpu_cores")}, s.measure,
                  spare_cores(rec["device"], launchers=local))
    rec.update(noise_fields(found, rec, s.measure), tries=1)
    return rec


@contextmanager
def team(cfg, settings: Settings, attn, device: torch.device) -> Iterator[Team | None]:
    """None for a single-process run. Otherwise this process's Team in a group of world_size ranks:
    joined from the launcher's environment, or made here with ranks 1..P-1 started as children."""
    P = attn.world_size
    if P == 1:
        yield None
        return
    rv, children = from_environment(), []
    local_ranks = ranks_here()
    if rv is None:  # start the other ranks here
        from omegaconf import DictConfig, OmegaConf

        rv, local_ranks = Rendezvous(0, P, "127.0.0.1", free_port(), 0), P
        config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
        context = mp.get_context("spawn")
        children = [context.Process(target=_child, args=(dataclasses.replace(rv, rank=r, local_rank=r), config),
                                    daemon=True) for r in range(1, P)]
        for c in children:
            c.start()
    threads = torch.get_num_threads()
    share_cores(local_ranks)
    if device.type == "cuda":
        device = torch.device("cuda", rv.local_rank)
        torch.cuda.set_device(device)
    member = Team(rv, settings, attn, device)
    try:
        init_group(rv, control_timeout_s(settings))
        yield member
        if rv.rank == 0:
            member.stop()
    finally:
        if member.clean:
            dist.destroy_process_group()
        for c in children:  # stopped, or (Ctrl-C, a failure on rank 0) ended here
            c.join(timeout=10 if member.clean else 0)
            if c.is_alive():
                c.terminate()
                c.join()
        if not member.clean and dist.is_initialized():  # a group left broken: a sweep's next job makes its own
            dist.destroy_process_group()
        torch.set_num_threads(threads)


def share_cores(local_ranks: int) -> None:
    """P processes on one machine share its cores: each takes its share of threads, not all of them."""
    if local_ranks > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))


def _child(rv: Rendezvous, config: dict[str, Any]) -> None:
    """A rank started by the harness: the same validated config, then serve rank 0 until it stops.
    Its failures are rank 0's to report (one row, or one line), so it prints nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to answer; it ends the children
    try:
        from .run import validate

        settings, attn, device = validate(config)
        share_cores(rv.world_size)
        if device.type == "cuda":
            device = torch.device("cuda", rv.local_rank)
            torch.cuda.set_device(device)
        member = Team(rv, settings, attn, device)
        init_group(rv, control_timeout_s(settings))
        member.serve()
        dist.destroy_process_group()
    except Exception:
        os._exit(1)
    # Done: leave without the interpreter's teardown, where gloo's threads were seen to abort a rank
    # that had finished ("terminate called without an active exception", SIGABRT).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
