"""elasticd/worker/faults.py: sample-id NaN faults follow the data, step faults the step, heal faults the heal."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from elasticd.worker.batch_tensors import has_floating, poison
from elasticd.worker.faults import FaultInjector, InjectedFault, parse_faults


def test_nan_samples_parse_into_indices_and_an_epoch() -> None:
    (fault,) = parse_faults("nan@samples=17+203+411,epoch=1")
    assert fault.kind == "nan" and fault.samples == frozenset({17, 203, 411}) and fault.epoch == 1
    assert fault.extra == {}


def test_a_sample_fault_poisons_only_micro_batches_holding_those_samples_in_its_epoch() -> None:
    faults = FaultInjector(parse_faults("nan@samples=17+203,epoch=1"), rank=0)
    assert faults.poisons_samples
    assert faults.nan_samples(1, [4, 17, 9])
    assert not faults.nan_samples(1, [4, 5, 9])
    assert not faults.nan_samples(2, [17])  # the same sample in another epoch is clean
    assert not any(faults.nan_at(step) for step in range(1, 100))  # never by step number


def test_without_an_epoch_the_samples_are_bad_in_every_epoch_and_step_faults_are_unchanged() -> None:
    faults = FaultInjector(parse_faults("nan@samples=5;nan@step=40"), rank=0)
    assert faults.nan_samples(0, [5]) and faults.nan_samples(7, [5])
    assert faults.nan_at(40) and not faults.nan_at(41)
    assert not FaultInjector(parse_faults("nan@step=40-"), rank=0).poisons_samples


def test_a_heal_kill_fires_only_in_its_heal_never_after_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    killed: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(sig))
    faults = FaultInjector(parse_faults("kill@heal=2"), rank=0)
    for step in range(1, 50):
        faults.after_step(step)
    faults.before_heal_piece(1)
    assert killed == []
    faults.before_heal_piece(2)
    assert killed == [signal.SIGKILL]


def test_a_heal_failure_raises_only_in_its_heal() -> None:
    faults = FaultInjector(parse_faults("fail@heal=2"), rank=0)
    faults.before_heal_piece(1)
    with pytest.raises(InjectedFault, match="fail@heal=2"):
        faults.before_heal_piece(2)


def test_a_device_error_fires_on_its_rank_and_step_only_and_raises_the_devices_own_error() -> None:
    injector = FaultInjector(parse_faults("device_error@step=8,rank=1"), rank=1)
    cpu = torch.device("cpu")
    injector.before_step(7, cpu)
    injector.before_step(8)  # no device given (a caller that trains nowhere in particular): nothing to break
    with pytest.raises(IndexError, match="out of bounds"):  # the CPU's error for CUDA's device-side assert
        injector.before_step(8, cpu)


def test_only_a_batch_with_a_floating_tensor_can_be_poisoned() -> None:
    ids = {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([0])}  # a transformers batch: nothing to NaN
    assert not has_floating(ids)
    assert poison(ids)["input_ids"].tolist() == [[1, 2]]
    assert has_floating({"x": torch.zeros(1), "id": torch.tensor(3)})
    assert has_floating([torch.tensor([1]), (torch.zeros(2),)])


def test_an_unpoisonable_batch_is_told_once_and_a_floating_one_never() -> None:
    injector = FaultInjector(parse_faults("nan@step=4-"), rank=0)
    assert not injector.first_unpoisonable({"x": torch.zeros(2)})
    ids = {"input_ids": torch.tensor([[1, 2]])}
    assert injector.first_unpoisonable(ids)
    assert not injector.first_unpoisonable(ids)  # said once per run, not at every step of a persistent fault
