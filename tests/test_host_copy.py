"""plumbing.host_copy: host copies equal to the tensors; CPU tensors pass through untouched."""
from __future__ import annotations

import torch

from ddtree_serve.plumbing.host_copy import start_host_copy, to_host


def test_cpu_tensors_come_back_as_they_are():
    a, b = torch.arange(6).view(2, 3), torch.randn(4, dtype=torch.bfloat16)
    got = to_host(a, b)
    assert got[0] is a and got[1] is b


def test_no_tensors_is_an_empty_tuple():
    assert to_host() == ()


def test_a_started_copy_of_cpu_tensors_has_nothing_to_wait_for():
    a = torch.arange(3)
    pending = start_host_copy(a)
    assert pending.done == () and pending.wait()[0] is a
