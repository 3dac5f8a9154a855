"""One island over several processes (torchrun): data-parallel inside the island, one link to the syncer.

    torchrun --nproc-per-node N [--nnodes M ...] -m yeto.backends.torch --syncer HOST:PORT --island-id I ...

Every rank holds the whole adapter and trains on its slice of each global batch; the LoRA gradients are summed
across ranks every inner step, token-weighted, so that a step of N ranks is one process's step over the whole batch.
Only rank 0 talks to the syncer: it runs the island's DiLoCo loop on a `RelayedIsland`, which broadcasts every call
that changes the island (a step, an adapter to load, the schedule's length) before making it, and the other ranks
make the same call in `follow()`. Ranks therefore decide nothing on their own clocks: they end every round when rank
0 does (time-window rounds included), and after every broadcast they check, by digest, that they hold the same
adapter.

A rank that dies takes the island down: torchrun stops the others, and a collective that waits on a dead or hung
rank fails after COLLECTIVE_TIMEOUT_S instead of hanging. The island comes back through the syncer's rejoin path
when torchrun (--max-restarts N; see `_attempt_store`) or the launch controller starts it again.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 300.0  # a rank silent this long (dead, hung) ends the island instead of hanging it
SHARDINGS = ("ddp", "fsdp")


@dataclass(frozen=True)
class RankGroup:
    """This process's place in its island's torchrun group."""

    rank: int
    world: int
    local_rank: int

    @staticmethod
    def from_env() -> Optional["RankGroup"]:
        """The group torchrun set up (WORLD_SIZE > 1), joined; None for a one-process island."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
            dist.init_process_group(backend, store=_attempt_store(rank, world, timeout), rank=rank, world_size=world,
                                    timeout=timeout)
        return RankGroup(dist.get_rank(), dist.get_world_size(), local_rank)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (small Python objects: commands, adapters of a few MB)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def sum_scalars(self, *values: float) -> list[float]:
        """Several numbers summed over the ranks in one collective."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.sum(t).tolist()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks in one flat collective (a rank whose micro-batches held no
        loss-bearing token contributes zeros)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.sum(torch.cat([g.reshape(-1) for g in grads]))
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g).to(p.dtype)
            offset += g.numel()

    def all(self, flag: bool) -> bool:
        """True on every rank only if `flag` is true on every rank."""
        return bool(self.sum(torch.tensor([0 if flag else 1], device=self.device)).item() == 0)

    def align(self, params: list[torch.nn.Parameter]) -> None:
        """Rank 0's values on every rank (the adapter's initialization)."""
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)

    def check_same(self, state: dict[str, np.ndarray], what: str) -> None:
        """Every rank holds this very state (compared by digest); a rank that differs ends the island."""
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(state[k]).tobytes() for k in sorted(state))).hexdigest()
        digests: list[Optional[str]] = [None] * self.world
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise RuntimeError(f"the island's ranks hold different adapters after {what}: "
                               f"{[d[:12] if d else d for d in digests]}")

    @property
    def device(self) -> torch.device:
        return torch.device(f"cuda:{self.local_rank}") if dist.get_backend() == "nccl" else torch.device("cpu")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The group's key-value store, with this restart attempt's keys apart from the last one's.

    torchrun's workers share the agent's store across restarts (the c10d and static rendezvous both), and the
    default env:// init reads the ranks' addresses from it without a per-attempt prefix: a restarted rank can read
    the dead attempt's address of rank 0 and fail to connect (gloo: "connectFullMesh ... Connection refused").
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    return dist.PrefixStore(f"yeto/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shard_base(model: torch.nn.Module, base: torch.nn.Module, lora: list[torch.nn.Parameter]) -> str:
    """FSDP2 over the frozen base: each transformer block (the classes the model names in `_no_split_modules`) is
    sharded across the ranks and gathered block by block in the forward and backward; the LoRA parameters stay
    whole on every rank (ignored by FSDP), so the adapter, its gradient sum and the wire view are a one-process
    island's."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(base, "_no_split_modules", None) or [])
    ignored = set(lora)
    sharded = [m for m in model.modules() if type(m).__name__ in blocks]
    if not sharded:
        raise RuntimeError(f"--shard fsdp: {type(base).__name__} names no transformer block class to shard by")
    for block in sharded:  # (the embeddings, final norm and LM head stay whole: the loss calls them directly)
        fully_shard(block, ignored_params=ignored)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in frozen)
    total = sum(p.numel() for p in frozen)
    return (f"fsdp: {len(sharded)} blocks sharded over {dist.get_world_size()} ranks; this rank holds "
            f"{held / 1e6:.2f}M of the base's {total / 1e6:.2f}M values")


class RelayedIsland:
    """Rank 0's island: every call that changes the island is first broadcast to the other ranks."""

    def __init__(self, island: Any, group: RankGroup):
        self.island, self.group = island, group
        self.backend = island.backend
        self.relay_s = 0.0  # time spent relaying calls and adapters to the other ranks (and checking them)

    def _relay(self, command: dict[str, Any]) -> None:
        t = time.perf_counter()
        self.group.share(command)
        self.relay_s += time.perf_counter() - t

    def step(self) -> dict[str, Any]:
        self._relay({"op": "step"})
        return self.island.step()

    def load_adapter_state(self, state: dict[str, np.ndarray]) -> None:
        self._relay({"op": "load", "state": state})
        self.island.load_adapter_state(state)
        t = time.perf_counter()
        self.group.check_same(self.island.adapter_state(), "a broadcast")
        self.relay_s += time.perf_counter() - t

    def set_total_steps(self, total: int) -> None:
        self._relay({"op": "total", "total": total})
        self.island.set_total_steps(total)

    def use_shard(self, index: int, count: int) -> None:
        if self.island.shard != (index, count):
            self._relay({"op": "shard", "shard": [index, count]})
            self.island.use_shard(index, count)

    def load_training_state(self, state: Any, adapter: bool = True) -> None:
        """Every rank resumes from rank 0's saved state (the ranks' adapters, moments and batch order are one)."""
        self._relay({"op": "resume", "state": state, "adapter": adapter})
        self.island.load_training_state(state, adapter)

    def evaluate(self) -> Optional[float]:
        self._relay({"op": "eval"})  # (a sharded base's forward needs every rank)
        return self.island.evaluate()

    def generate(self, prompts: list[Any], max_new_tokens: int) -> list[str]:
        """Every rank generates the same answers (greedy: the same prompts give the same tokens, so the ranks take
        the same forward passes: a sharded base's need every rank); rank 0's are the island's."""
        self._relay({"op": "generate", "prompts": prompts, "max_new_tokens": max_new_tokens})
        return self.island.generate(prompts, max_new_tokens)

    def finish(self) -> None:
        """Release the other ranks (the run is over, or rank 0 is leaving it)."""
        self._relay({"op": "exit"})

    def __getattr__(self, name: str) -> Any:  # adapter_state, adapter_config, record, evaluate...: read-only
        return getattr(self.island, name)


def follow(island: Any, group: RankGroup) -> None:
    """A rank other than 0: make each call rank 0 relays, until it says exit."""
    while True:
        command = group.share()
        op = command["op"]
        if op == "step":
            island.step()
        elif op == "load":
            island.load_adapter_state(command["state"])
            group.check_same(island.adapter_state(), "a broadcast")
        elif op == "total":
            island.set_total_steps(command["total"])
        elif op == "resume":
            island.load_training_state(command["state"], command["adapter"])
        elif op == "shard":
            island.use_shard(*command["shard"])
        elif op == "eval":
            island.evaluate()
        elif op == "generate":
            island.generate(command["prompts"], command["max_new_tokens"])
        elif op == "exit":
            return
        else:
            raise RuntimeError(f"unknown relayed call {op!r} from rank 0")
