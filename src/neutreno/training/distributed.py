"""One process per device under ``torchrun``: rank, device, and the few collectives training needs.

``torchrun --nproc_per_node=N -m neutreno train ...`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
(and the rendezvous address); under it every process joins the process group, one process included,
so ``--nproc_per_node=1`` runs the same DDP and all-reduce path as N (on one GPU, the way to check
NCCL). Without them everything runs in this one process. The backend is nccl on CUDA and gloo on CPU.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class DistributedContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None = None  # the process group's ("nccl", "gloo"); None outside torchrun

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, shows progress and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """In a process group (under torchrun, of any size): DDP and the all-reduces run."""
        return self.world_size > 1 or self.backend is not None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``"auto"`` → this process's CUDA device when there is one, else the CPU; or the device named."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError):
            raise ValueError(f"device {name!r} is not a device (auto, cpu, cuda, cuda:1, …)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: neutreno runs on auto, cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {name!r} but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(
            f"device {device} does not exist: this machine has {count} CUDA device(s)"
            + (f" and this is local process {local_rank} (torchrun --nproc_per_node at most {count})"
               if local_rank else "")
        )  # fmt: skip
    return device


def setup_distributed(device_name: str = "auto") -> DistributedContext:
    """Join the torchrun process group if there is one (idempotent) and pick this process's device.

    Under torchrun (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set) the group is joined
    whatever its size."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    # what torchrun sets and env:// rendezvous reads; a stray WORLD_SIZE alone is not a launch
    launch = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
    launched = all(name in os.environ for name in launch)
    if world_size > 1 and not launched:  # (torch's error named a missing RANK, not the cause)
        missing = ", ".join(name for name in launch if name not in os.environ)
        raise ValueError(
            f"WORLD_SIZE={world_size} is set but not {missing}: run under torchrun, or unset WORLD_SIZE"
        )
    device = resolve_device(device_name, local_rank)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_processes > 1 and device.type == "cuda" and torch.device(device_name).index is not None:
        raise ValueError(  # every process would take that one GPU
            f"device {device_name!r} names one GPU for the {local_processes} processes torchrun started on "
            "this machine: give cuda or auto (each process takes the GPU of its LOCAL_RANK)"
        )
    if launched and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    backend = dist.get_backend() if dist.is_initialized() else None
    return DistributedContext(rank, world_size, local_rank, device, backend)


def all_reduce_sum(tensor: torch.Tensor, context: DistributedContext) -> torch.Tensor:
    """The sum of ``tensor`` over all processes (a no-op for one process)."""
    if context.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # SUM: gloo has no AVG
    return tensor


def all_gather_objects(value: object, context: DistributedContext) -> list:
    """Every process's ``value``, in rank order."""
    if not context.distributed:
        return [value]
    values = [None] * context.world_size
    dist.all_gather_object(values, value)
    return values


def barrier(context: DistributedContext) -> None:
    if context.distributed:
        dist.barrier()


def cleanup_distributed(synchronize: bool = False) -> None:
    """Leave the process group. With ``synchronize`` (after a successful run) every process first
    waits for the others: a gloo process that tears its group down while a peer still uses the
    connection can abort at exit ("terminate called without an active exception", SIGABRT), so a
    finished run would exit non-zero. Not on error paths, where a peer may never arrive."""
    if dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()
