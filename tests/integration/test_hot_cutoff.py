"""A failed step's backward pass stops at the next parameter, on real DDP models reduced by the resilient hook.

The accelerator is the one method of accelerate's that the cutoff wraps (``cutoff_model.py``), so that the backward
the script calls is the one cut. Two ranks are two processes over one gloo group (``scripts/cutoff_ranks.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port
from tests.integration.cutoff_model import LAYERS, Rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = Path(__file__).parent / "scripts" / "cutoff_ranks.py"


def test_a_failed_steps_backward_stops_at_the_first_parameter_and_the_next_step_is_whole(world_of_one: None) -> None:
    rank = Rank()
    assert rank.step(1) == 2 * LAYERS  # healthy: every weight and bias

    rank.health.fail("a peer died")
    assert rank.step(2) == 1  # the last layer's first parameter, then the cut: the call returned as usual
    assert (rank.cutoff.cuts, rank.cutoff.uncut) == (1, 0)

    assert rank.health.consume() is not None  # the step boundary
    assert rank.step(3) == 2 * LAYERS
    assert rank.cutoff.cuts == 1


def test_a_failure_notice_from_elsewhere_fails_this_step_and_cuts_it(world_of_one: None) -> None:
    rank = Rank(notice="node n2's lease gone")
    assert rank.step(1) == 1
    assert rank.aborted == ["failure notice: node n2's lease gone"]
    assert rank.health.failed


def test_a_backward_the_script_calls_itself_is_never_cut(world_of_one: None) -> None:
    rank = Rank()
    rank.health.fail("a peer died")
    rank.model(torch.ones(2, 16)).sum().backward()  # not accelerate's: no cut, the hook completes every bucket
    assert all(p.grad is not None for p in rank.model.parameters())
    assert rank.cutoff.cuts == 0


@pytest.mark.parametrize("option", [None, "find_unused_parameters", "static_graph", "gradient_as_bucket_view"])
def test_ddp_trains_on_after_a_cut_backward_and_its_ranks_agree(option: str | None) -> None:
    port, flags = str(free_port()), [option] if option else []
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), port, str(rank), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for process in ranks:
            out, err = process.communicate(timeout=60)
            assert process.returncode == 0, err.decode()
            outputs.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    for output in outputs:
        assert output["counts"] == [2 * LAYERS, 1, 2 * LAYERS, 2 * LAYERS], output["counts"]
        assert output["cuts"] == 1
    # the steps after the cut were reduced across the ranks: both hold the same averaged gradients
    first, second = (torch.tensor(o["gradients"]) for o in outputs)
    assert torch.allclose(first, second), (first - second).abs().max()
