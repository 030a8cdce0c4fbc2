"""``python -m elasticd.demo`` (``scripts/demo``): elasticity in about a minute, on this machine.

An embedded etcd (127.0.0.1, a login only this user has), then N real ``elasticd start`` nodes of one run training
``examples/train.py`` (one gloo worker each). When the job is a quarter through, one node is killed with SIGKILL
(daemon and worker); once the others train at the smaller size, a new node is started and joins. A live view shows
progress, world size and what happened; the end is a summary. Off a terminal (or with ``--json``) every moment and
the summary are JSON lines. Started again with the same run id, the run has finished already, and the demo says so
and how to train again. While it runs, ``elasticd status --watch`` in another terminal finds its etcd.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

from rich.console import Console

from elasticd import options as o
from elasticd.demo.nodes import LocalNodes, NodePlan
from elasticd.demo.story import Demo, DemoFailed
from elasticd.demo.view import JsonView, LiveView
from elasticd.endpoints import parse_endpoints
from elasticd.errors import EXIT_GAVE_UP, EXIT_INTERRUPTED, EXIT_OK, ElasticdError
from elasticd.etcd import local_runs
from elasticd.etcd.client import EtcdClient
from elasticd.etcd.server import EmbeddedEtcd
from elasticd.keys import RunKeys
from elasticd.lineage import Lineage

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"
STEPS_PER_EPOCH = 100  # examples/train.py's 4,800 samples at a global batch of 48


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--run-id", default="demo", help="the run's name in etcd and under --checkpoint-dir")
    p.add_argument("--nodes", type=int, default=3, help="nodes at the start (2 to 6); one more joins")
    p.add_argument("--epochs", type=int, default=4, help=f"epochs of {STEPS_PER_EPOCH} steps")
    p.add_argument("--sleep", type=float, default=0.08, help="extra seconds per step (stands in for compute)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--checkpoint-every-steps", type=int, default=50)
    p.add_argument("--logs", type=Path, default=None, help="the nodes' logs (default: demo-logs/<run-id>)")
    p.add_argument("--json", action="store_true", help="JSON lines even on a terminal")
    p.add_argument("--script", type=Path, default=EXAMPLE, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    problems = [
        (not 2 <= args.nodes <= 6, "--nodes: 2 to 6 (all on this machine)"),
        (args.epochs < 2, "--epochs: at least 2 (a kill and a join need time to happen)"),
        (not 0 <= args.sleep <= 5, "--sleep: 0 to 5 seconds"),
        (args.checkpoint_every_steps < 1, "--checkpoint-every-steps: at least 1"),
        (not args.script.is_file(), f"the training script {args.script} is missing (run from a clone)"),
    ]
    for bad, message in problems:
        if bad:
            p.error(message)
    try:
        o.RUN_ID.value(args.run_id)
    except ElasticdError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    total = args.epochs * STEPS_PER_EPOCH
    as_json = args.json or not sys.stdout.isatty()
    logs = args.logs or Path("demo-logs") / args.run_id
    with ExitStack() as stack:
        etcd = stack.enter_context(EmbeddedEtcd(auth=True))
        _publish(stack, etcd, args.run_id)
        plan = NodePlan(
            endpoint=etcd.endpoint,
            access=etcd.access,
            run_id=args.run_id,
            min_nodes=args.nodes - 1,
            max_nodes=args.nodes,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every_steps=args.checkpoint_every_steps,
            script=(str(args.script), "--epochs", str(args.epochs), "--sleep", str(args.sleep)),
        )
        nodes = LocalNodes(plan, logs)
        nodes.clear_logs()
        stack.callback(nodes.close)
        client = EtcdClient.connect(parse_endpoints(etcd.endpoint), **etcd.access.connect_kwargs())
        stack.callback(client.close)
        title = f"elasticd demo: run {args.run_id!r} on {args.nodes} local nodes (also: elasticd status --watch)"
        view: JsonView | LiveView = JsonView(0.0) if as_json else LiveView(Console(), title)
        stack.callback(view.close)
        demo = Demo(nodes, Lineage(client, RunKeys(args.run_id)), total, args.nodes, total // 4, view)
        if isinstance(view, JsonView):
            view.start = demo.start
        try:
            summary = demo.play()
        except DemoFailed as exc:
            view.close()
            print(f"demo failed: {exc}; the nodes' logs are in {logs}", file=sys.stderr)
            return EXIT_GAVE_UP
        except KeyboardInterrupt:
            view.close()
            print(f"interrupted: the nodes were stopped; their logs are in {logs}", file=sys.stderr)
            return EXIT_INTERRUPTED
        view.summary(summary)
        if summary["finished_already"]:
            print(f"start another: scripts/demo --run-id {args.run_id}-2", file=sys.stderr)
            return EXIT_OK
        clean = all(code in (0, "killed") for code in summary["exit_codes"].values())
        return EXIT_OK if clean and len(summary["changes"]) == 2 else EXIT_GAVE_UP
    return EXIT_OK


def _publish(stack: ExitStack, etcd: EmbeddedEtcd, run_id: str) -> None:
    """``elasticd status``/``stop`` without ``--etcd`` find the demo's etcd (``etcd/local_runs.py``)."""
    access = etcd.access
    try:
        record = local_runs.publish(
            local_runs.LocalRun(run_id, etcd.endpoint, access.user, access.password_file, os.getpid(), "demo")
        )
    except (OSError, local_runs.LocalRunsError):
        return  # status then needs the etcd options; the title names the endpoint
    stack.callback(local_runs.withdraw, record)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
