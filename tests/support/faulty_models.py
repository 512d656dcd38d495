"""Models that misbehave on purpose, loaded as `module:callable` user models to inject
failures into a plan: raise, NaN, out of memory, segfault, killed, hang."""

import os
import signal
import time

import torch
from torch import nn


class Faulty(nn.Module):
    def __init__(self, num_classes, in_shape, fault):
        super().__init__()
        self.fault = fault
        self.fc = nn.Linear(int(torch.tensor(in_shape).prod()), num_classes)

    def forward(self, x):
        if self.fault == "raise":
            raise RuntimeError("injected failure")
        if self.fault == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        if self.fault == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.fault == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "hang":
            time.sleep(3600)
        out = self.fc(x.flatten(1))
        return out * float("nan") if self.fault == "nan" else out


def _factory(fault):
    def make(num_classes, in_shape):
        return Faulty(num_classes, in_shape, fault)

    return make


raising, nan, oom, segfault, killed, hang = map(_factory, ["raise", "nan", "oom", "segfault", "killed", "hang"])


class OnRank(nn.Module):
    """Well-behaved except on one data-parallel rank (torchrun's RANK), where it kills or hangs."""

    def __init__(self, num_classes, in_shape, fault, rank):
        super().__init__()
        self.inner = Faulty(num_classes, in_shape, fault if os.environ.get("RANK") == str(rank) else "none")

    def forward(self, x):
        return self.inner(x)


def killed_rank1(num_classes, in_shape):
    return OnRank(num_classes, in_shape, "killed", 1)


def hang_rank1(num_classes, in_shape):
    return OnRank(num_classes, in_shape, "hang", 1)


def raising_rank1(num_classes, in_shape):
    return OnRank(num_classes, in_shape, "raise", 1)


def oom_rank1(num_classes, in_shape):
    return OnRank(num_classes, in_shape, "oom", 1)


class CrashesInTraining(nn.Module):
    """Well-behaved on the small batches of a timed cell; segfaults on a quality run's training batch (>= 32)."""

    def __init__(self, num_classes, in_shape):
        super().__init__()
        self.inner = Faulty(num_classes, in_shape, "none")

    def forward(self, x):
        if self.training and x.shape[0] >= 32:
            os.kill(os.getpid(), signal.SIGSEGV)
        return self.inner(x)


def segfault_in_training(num_classes, in_shape):
    return CrashesInTraining(num_classes, in_shape)


class RaisesInEval(nn.Module):
    """Trains fine; raises when evaluated (inference)."""

    def __init__(self, num_classes, in_shape):
        super().__init__()
        self.inner = Faulty(num_classes, in_shape, "none")

    def forward(self, x):
        if not self.training:
            raise RuntimeError("injected failure in eval")
        return self.inner(x)


def raising_in_eval(num_classes, in_shape):
    return RaisesInEval(num_classes, in_shape)


class OnRankWithSeed(nn.Module):
    """Raises on data-parallel rank 1 for the cell of seed 0 only (the seed is read from the weights' RNG:
    kdbench seeds the model with the cell's seed before building it)."""

    def __init__(self, num_classes, in_shape):
        super().__init__()
        seed0 = torch.initial_seed() == 0
        fault = "raise" if seed0 and os.environ.get("RANK") == "1" else "none"
        self.inner = Faulty(num_classes, in_shape, fault)

    def forward(self, x):
        return self.inner(x)


def raising_rank1_seed0(num_classes, in_shape):
    return OnRankWithSeed(num_classes, in_shape)


class ChattyJob:
    """A job (kdbench.run.jobs protocol) that logs every 10 ms and never finishes."""

    job_id, label, world_size, precision = "chatty", "chatty job", 1, None

    def planned(self):
        return [{"measurement": "distill_step", "batch_size": 1}]

    def columns(self, backend_name):
        return {}

    def run(self, ctx):
        import logging

        log = logging.getLogger("kdbench.tests.chatty")
        while True:
            log.info("still busy")
            time.sleep(0.01)


class DeviceError(nn.Module):
    """Raises what a poisoned CUDA context raises (an illegal memory access) in the distillation step."""

    def __init__(self, num_classes, in_shape):
        super().__init__()
        self.inner = Faulty(num_classes, in_shape, "none")

    def forward(self, x):
        if self.training:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.inner(x)


def device_error(num_classes, in_shape):
    return DeviceError(num_classes, in_shape)


class SpendsThenHangs:
    """A job (kdbench.run.jobs protocol) that counts time into the wall-time split, then never finishes."""

    job_id, label, world_size, precision = "spends", "spends then hangs", 1, None

    def planned(self):
        return [{"measurement": "distill_step", "batch_size": 1}]

    def columns(self, backend_name):
        return {}

    def run(self, ctx):
        from kdbench.measure import walltime

        walltime.add(walltime.MODELS, 1.5)
        walltime.add(walltime.WARMUP, 0.25)
        time.sleep(3600)


@torch.library.custom_op("kdbench_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    """An operator with no shape-only (fake) implementation: a fit's fake run cannot run it."""
    return x.clone()


class Opaque(nn.Module):
    def __init__(self, num_classes, in_shape):
        super().__init__()
        self.fc = nn.Linear(int(torch.Size(in_shape).numel()), num_classes)

    def forward(self, x):
        return self.fc(_opaque(x).flatten(1))


def opaque(num_classes, in_shape):
    return Opaque(num_classes, in_shape)


class SegfaultsInQuality(nn.Module):
    """ids -> logits over the 256 bytes; kills its process when it trains on quality-sized batches (>= 16)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 8)
        self.out = nn.Linear(8, 256)

    def forward(self, ids):
        if self.training and ids.shape[0] >= 16:
            os.kill(os.getpid(), signal.SIGSEGV)
        return self.out(self.emb(ids))


def segfaulting_lm():
    return SegfaultsInQuality()


class FrozenJob(ChattyJob):
    """A job (kdbench.run.jobs protocol) that logs one line, then stops its own process (SIGSTOP): a worker that
    goes silent, as one frozen or swapping past use does."""

    job_id, label = "frozen", "frozen job"

    def run(self, ctx):
        import logging
        import os
        import signal

        logging.getLogger("kdbench.tests.frozen").info("about to freeze")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSTOP)
