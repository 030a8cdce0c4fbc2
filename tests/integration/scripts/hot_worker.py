"""One worker of tests/integration/test_hot_core.py: a deterministic job wired with elasticd.worker.hot.

The test process plays the daemons: it hosts the store, decides the membership after a failure (from the workers'
announcements and the processes it saw die) and kills workers. The worker trains, turns a failed step into an
announcement, waits for the decision, re-forms and heals; the group's rank 0 admits a warm joiner at a step
boundary that every member reaches with the same step count.

Keys under ``hot/`` of the test's TCPStore:
  e<n>/pg/...          the store of membership epoch n's process group
  e<n>/ann/<id>        a member of epoch n saw its step fail: {"step": committed steps}
  e<n>/decision        the test's decision for epoch n+1: {"ranks": {id: rank}, "world": size}, and optionally
                       "previous" (old rank of each new rank: a shrink in place, NCCL) and "source" (heal source)
  e<n>/admit           rank 0's admission of the joiner: {"at": step, "ranks": ..., "world": ..., "epoch": n}
  join/go, join/ready  the test lets the joiner announce itself; the joiner is imported and prepared
  join/admit           the admission again, for the joiner (which does not know n)
  progress/<id>        {"step", "world", "epoch"} after each committed step

``--backend nccl`` (bench/gpu_check.py; unverified, no GPU where it was written) trains on ``cuda:LOCAL_RANK``; a
failure announcement then also says whether this member can shrink the group in place (``can_shrink``).
"""

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedDataParallelKwargs
from torch import nn

from elasticd.worker.batching import plan_batches
from elasticd.worker.hot import (
    FailedStepGuard,
    GroupHolder,
    Reformer,
    ResilientAllReduce,
    StepHealth,
    expect_world,
    heal,
    start_private_world,
)
from elasticd.worker.sampler import ElasticSampler
from elasticd.worker.state import TrainingState

FEATURES, HIDDEN, OUTPUTS = 16, 32, 8
DATASET = 1200
STORE_TIMEOUT = timedelta(seconds=60)
GROUP_TIMEOUT = timedelta(seconds=60)


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(DATASET, FEATURES, generator=g)
    w = torch.randn(FEATURES, OUTPUTS, generator=g)
    return x, torch.sin(x @ w)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS)
    )


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.id = args.id
        self.out = Path(args.out)
        self.base = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=STORE_TIMEOUT)
        self.events: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.epoch = 0
        gpu = args.backend == "nccl"
        self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(self.device)
        device_id = self.device if gpu else None
        if args.joiner:
            start_private_world(backend=args.backend, timeout=GROUP_TIMEOUT, device_id=device_id)
            self.rank, self.world = 0, 1
        else:
            self.rank, self.world = args.rank, args.world
            store = dist.PrefixStore("hot/e0/pg", self.base)
            dist.init_process_group(
                args.backend,
                store=store,
                rank=self.rank,
                world_size=self.world,
                timeout=GROUP_TIMEOUT,
                device_id=device_id,
            )
        # small buckets: several of them, laid out differently by a fresh reducer and a rebuilt one
        ddp = DistributedDataParallelKwargs(bucket_cap_mb=args.bucket_kb / 1024)
        self.accelerator = Accelerator(cpu=not gpu, kwargs_handlers=[ddp])
        if gpu and self.world == 1:
            expect_world(2)  # else accelerate does not wrap a world of one (a joiner, a lone member) in DDP on a GPU
        model = build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.scheduler.split_batches = True  # once per optimizer step whatever the world size (as run.py does)
        self.health, self.holder = StepHealth(), GroupHolder()
        # a client of its own: a TCPStore client serialises its calls, and the hook asks from its watcher thread
        self.notice_store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=STORE_TIMEOUT)
        self.hook = ResilientAllReduce(
            self.holder,
            self.health,
            timeout=timedelta(seconds=args.bucket_timeout_s),
            notice=self.failure_notice,
            notice_interval=timedelta(milliseconds=20),  # a store round trip: polled, nothing nudges the hook
            poll=True if args.poll else None,
        )
        self.hook.register(self.model)
        self.guard = FailedStepGuard(self.health)
        self.guard.install(self.optimizer)
        self.reformer = Reformer(self.accelerator, self.model, self.holder, timeout=GROUP_TIMEOUT)
        self.state = TrainingState()
        self.x, self.y = (t.to(self.device) for t in dataset())
        self.admitted = False  # the expected joiner is in
        self.first_after_change = False
        self.changes = 0  # membership changes this worker went through
        self.last_change = 0  # the step count at the last one
        self.ranks: dict[str, int] = {} if args.joiner else {m: r for r, m in enumerate(args.members.split(","))}
        self.set_plan()
        self.event("ready")

    # -- helpers ---------------------------------------------------------------------------------------------------

    def event(self, name: str, **fields: Any) -> None:
        self.events.append(
            {"event": name, "t": time.monotonic(), "step": self.state.step, "world": self.world, **fields}
        )

    def failure_notice(self) -> str | None:
        key = f"hot/e{self.epoch}/notice"
        return self.notice_store.get(key).decode() if self.notice_store.check([key]) else None

    def key(self, name: str) -> str:
        return f"hot/e{self.epoch}/{name}"

    def get_json(self, key: str) -> Any:
        return json.loads(self.base.get(key))

    def set_plan(self) -> None:
        self.plan = plan_batches(self.args.global_batch, self.args.micro, self.world)
        self.accelerator.gradient_accumulation_steps = self.plan.accumulation
        self.sampler = ElasticSampler(DATASET, self.plan, self.rank, shuffle=True, seed=0)

    def reform_and_heal(
        self, ranks: dict[str, int], world: int, why: str, previous: list[int] | None = None, source: int = 0
    ) -> None:
        rank = ranks[self.id]
        self.epoch += 1
        self.rank, self.world = rank, world
        self.ranks = dict(ranks)
        plan = plan_batches(self.args.global_batch, self.args.micro, world)
        store = dist.PrefixStore(self.key("pg"), self.base)
        formation = self.reformer.reform(store, rank, world, plan, previous_ranks=previous)
        self.event("reformed", why=why, seconds=formation.seconds, method=formation.method)
        self.state, report = heal(source, self.model, self.optimizer, self.scheduler, self.state)
        self.event("healed", why=why, bytes_sent=report.sent, payload=report.received, seconds=report.seconds)
        self.set_plan()
        self.first_after_change = True
        self.changes += 1
        self.last_change = self.state.step

    # -- the loop --------------------------------------------------------------------------------------------------

    def run(self) -> None:
        if self.args.joiner:
            self.join()
        while True:
            self.at_boundary()
            a = self.args
            if self.state.step >= max(a.steps, self.last_change + a.after) and self.changes >= a.expect_changes:
                break
            self.one_step()

    def one_step(self) -> None:
        """One optimizer step; when it fails, announce, wait for the decision, re-form and heal."""
        step_slice = next(iter(self.sampler.steps(self.state.data, epochs=1000)))
        number = self.state.step + 1
        micro_batches = step_slice.micro_batches
        for i, micro in enumerate(micro_batches):
            index = torch.tensor(micro.indices)
            with self.accelerator.accumulate(self.model):
                loss = nn.functional.mse_loss(self.model(self.x[index]), self.y[index])
                if self.args.die_at == number and i == len(micro_batches) - 1:
                    self.base.set(f"hot/died/{self.id}", str(time.monotonic()))
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others wait in this step's all-reduce
                self.accelerator.backward(loss)
                if self.args.lag_at == number and i == len(micro_batches) - 1:
                    # this member alone drops a step whose all-reduce succeeded everywhere (as when a peer dies
                    # between two members' last receives): it falls one step behind the others
                    self.health.fail(f"injected: {self.id} drops step {number}")
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # a step's time is when the GPU finished it
        if self.args.step_sleep_ms:
            time.sleep(self.args.step_sleep_ms / 1000)
        failure = self.guard.take()
        if failure is None:
            self.state = self.state.advanced(step_slice.next_position())
            lr = self.scheduler.get_last_lr()[0]
            # what accelerate tells the script about the world, through both of its shared states
            seen = [self.accelerator.num_processes, self.accelerator.process_index]
            seen += [
                PartialState().num_processes,
                PartialState().process_index,
                self.accelerator.gradient_accumulation_steps,
            ]
            record = {"step": self.state.step, "world": self.world, "rank": self.rank, "position": step_slice.position}
            self.steps.append({**record, "lr": lr, "accelerate": seen, "t": time.monotonic()})
            if self.first_after_change:
                self.event("first_step")
                self.first_after_change = False
            self.base.set(f"hot/progress/{self.id}", json.dumps({"step": self.state.step, "world": self.world}))
            return
        self.event("failed", reason=failure.reason, attempted=number)
        if not self.notice_store.check([self.key("notice")]):
            self.base.set(self.key("notice"), f"{self.id}: {failure.reason}")  # releases members still waiting
        announcement = {"step": self.state.step, "rank": self.rank, "can_shrink": self.reformer.can_shrink()}
        self.base.set(self.key(f"ann/{self.id}"), json.dumps(announcement))
        decision_key = self.key("decision")
        self.base.wait([decision_key], STORE_TIMEOUT)
        decision = self.get_json(decision_key)
        self.event("decided")
        if self.id not in decision["ranks"]:
            self.finish(excluded=True)
        previous, source = decision.get("previous"), decision.get("source", 0)
        self.reform_and_heal(decision["ranks"], decision["world"], "failure", previous, source)

    def at_boundary(self) -> None:
        """Admit the joiner at a step boundary that every member reaches with the same step count."""
        if not self.args.expect_joiner or self.admitted:
            return
        admit_key = self.key("admit")
        if self.rank == 0 and not self.base.check([admit_key]):
            cap = self.state.step >= self.args.join_cap
            if cap:
                self.base.wait(["hot/join/ready"], STORE_TIMEOUT)
            if self.base.check(["hot/join/ready"]):
                joiner = self.base.get("hot/join/ready").decode()
                # Two steps ahead: a member can be at most one step behind rank 0 here (it cannot finish the next
                # step without rank 0), so every member reads the key before it reaches that boundary. At the cap
                # the others wait for the key at this very boundary.
                at = self.state.step if cap else self.state.step + 2
                ranks = {**self.ranks, joiner: self.world}
                admit = {"at": at, "ranks": ranks, "world": self.world + 1, "epoch": self.epoch}
                self.base.set(admit_key, json.dumps(admit))
                self.base.set("hot/join/admit", json.dumps(admit))
        elif self.state.step >= self.args.join_cap:
            self.base.wait([admit_key], STORE_TIMEOUT)
        if not self.base.check([admit_key]):
            return
        admit = self.get_json(admit_key)
        if self.state.step != admit["at"]:
            return
        self.event("admitting")
        self.admitted = True
        self.reform_and_heal(admit["ranks"], admit["world"], "join")

    def join(self) -> None:
        self.base.set(f"hot/join/prepared/{self.id}", "1")
        self.base.wait(["hot/join/go"], STORE_TIMEOUT)
        self.event("announced")
        self.base.set("hot/join/ready", self.id)
        self.base.wait(["hot/join/admit"], STORE_TIMEOUT)
        admit = self.get_json("hot/join/admit")
        self.epoch = admit["epoch"]
        self.admitted = True
        self.reform_and_heal(admit["ranks"], admit["world"], "join")

    def finish(self, excluded: bool = False) -> None:
        result = {
            "id": self.id,
            "events": self.events,
            "steps": self.steps,
            "excluded": excluded,
            "skipped": self.guard.skipped,
        }
        torch.save(
            {k: v.detach().clone() for k, v in self.model.module.state_dict().items()}, self.out / f"{self.id}.pt"
        )
        (self.out / f"{self.id}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        sys.stderr.flush()
        # an abandoned collective in an old group would hold a normal exit until that group's timeout
        os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--id", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--members", default="", help="ids of the first group's members, in rank order")
    p.add_argument("--joiner", action="store_true")
    p.add_argument("--steps", type=int, default=30, help="train at least this many steps")
    p.add_argument("--after", type=int, default=0, help="and this many after the last membership change")
    p.add_argument("--expect-changes", type=int, default=0, help="keep training until this many changes happened")
    p.add_argument("--expect-joiner", action="store_true")
    p.add_argument("--join-cap", type=int, default=10**9, help="wait for the joiner at this step at the latest")
    p.add_argument("--die-at", type=int, default=0, help="SIGKILL itself in the backward pass of this step")
    p.add_argument("--lag-at", type=int, default=0, help="treat this step as failed here alone")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--bucket-kb", type=float, default=2.0)
    p.add_argument("--bucket-timeout-s", type=float, default=30.0)
    p.add_argument("--step-sleep-ms", type=float, default=0.0)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="nccl: train on cuda:LOCAL_RANK")
    p.add_argument("--poll", action="store_true", help="the hook polls every bucket (as it does on a GPU)")
    args = p.parse_args()
    torch.set_num_threads(1)
    worker = Worker(args)
    worker.run()
    worker.finish()


if __name__ == "__main__":
    main()
