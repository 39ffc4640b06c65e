"""Admission and prefill planning in the gateway (no server): FCFS within the pair's limits, chunked prompts."""
from __future__ import annotations

import pytest

from ddtree_serve.decoding.config import GPU_BATCH_BUDGETS, SamplingParams, default_batch_budgets
from gateway.scheduler import (AdmissionLimits, PairQueue, batch_budget_ceiling, parse_batch_budgets,
                               plan_prefill_chunks, step_budgets)
from gateway.sequence import Sequence, Status


def seq(prompt_len: int, max_tokens: int = 8, prefilled: int = 0) -> Sequence:
    s = Sequence(request_id="r", prompt_ids=list(range(prompt_len)), max_tokens=max_tokens, sampling=SamplingParams(),
                 mode="ddtree", budget=0, stop_token_ids=frozenset(), detokenizer=None)
    s.prefilled = prefilled
    return s


def test_prefill_chunks_go_oldest_first_within_the_token_budget() -> None:
    a, b, c = seq(4), seq(12), seq(5)
    assert [(x, n) for x, n in plan_prefill_chunks([a, b, c], 10)] == [(a, 4), (b, 6)]


def test_a_partly_prefilled_prompt_continues_before_newer_ones() -> None:
    b, c = seq(12, prefilled=6), seq(5)
    assert plan_prefill_chunks([b, c], 10) == [(b, 6), (c, 4)]


def test_a_prompt_longer_than_the_budget_takes_a_budget_per_step() -> None:
    long = seq(25)
    steps = []
    while not long.prefill_done:
        [(s, n)] = plan_prefill_chunks([long], 8)
        steps.append(n)
        long.prefilled += n
    assert steps == [8, 8, 8, 1]


def test_no_budget_means_whole_prompts() -> None:
    a, b = seq(300), seq(7, prefilled=2)
    assert plan_prefill_chunks([a, b], 0) == [(a, 300), (b, 5)]


def test_admission_is_fcfs_within_slots_and_reserved_tokens() -> None:
    queue = PairQueue(AdmissionLimits(max_running=3, max_reserved_tokens=40))
    first, second, big, small = seq(10, 10), seq(5, 5), seq(20, 10), seq(1, 1)
    queue.waiting.extend([first, second, big, small])
    # 20 + 10 reserved; `big` needs 30 more: it waits, and `small` may not overtake it
    assert queue.admit() == [first, second]
    assert [s.status for s in (first, second, big, small)] == [Status.RUNNING, Status.RUNNING, Status.WAITING,
                                                                 Status.WAITING]
    queue.running.remove(first)
    assert queue.admit() == [big]


def test_budgets_stay_as_asked_while_the_steps_trees_fit_the_cap() -> None:
    asked = {"a": 64, "b": 16}
    assert step_budgets(asked, other_nodes=3, max_verify_nodes=3 + 65 + 17) == asked
    assert step_budgets(asked, other_nodes=100, max_verify_nodes=0) == asked   # 0: no cap


def test_past_the_cap_every_tree_gets_an_equal_share_rounded_down_to_a_power_of_four() -> None:
    eight = {str(i): 64 for i in range(8)}
    assert set(step_budgets(eight, 0, 256).values()) == {16}    # share 31 -> 16 (a 17-node bucket, not 65)
    assert set(step_budgets(dict(list(eight.items())[:3]), 0, 256).values()) == {64}   # 195 nodes fit
    assert step_budgets({"a": 64, "b": 2}, 0, 40) == {"a": 16, "b": 2}   # never above what was asked


def test_the_share_never_drops_below_one_node_per_tree() -> None:
    assert set(step_budgets({str(i): 64 for i in range(64)}, 10, 64).values()) == {1}


def test_budget_ceilings_by_batch_size_parse_from_the_command_line_form() -> None:
    assert parse_batch_budgets("4:16,16:4") == ((4, 16), (16, 4))
    assert parse_batch_budgets("none") == ()
    for bad in ("4", "4:x", "16:4,4:16", "0:16", "4:0", "4:16,4:8", ""):
        with pytest.raises(ValueError):
            parse_batch_budgets(bad)


def test_the_ceiling_of_a_batch_is_the_last_one_it_has_reached() -> None:
    table = ((4, 16), (16, 4))
    assert [batch_budget_ceiling(table, b) for b in (1, 3, 4, 15, 16, 64)] == [None, None, 16, 16, 4, 4]
    assert batch_budget_ceiling((), 64) is None


def test_a_gpu_target_caps_wide_batches_by_default_and_a_cpu_one_does_not() -> None:
    assert default_batch_budgets("cuda:0") == default_batch_budgets("cuda") == GPU_BATCH_BUDGETS
    assert batch_budget_ceiling(GPU_BATCH_BUDGETS, 1) is None and batch_budget_ceiling(GPU_BATCH_BUDGETS, 8) == 16
    assert default_batch_budgets("cpu") == ()


def test_under_the_priority_policy_the_lowest_value_is_admitted_first_and_ties_keep_arrival_order() -> None:
    queue = PairQueue(AdmissionLimits(max_running=3, max_reserved_tokens=10_000), policy="priority")
    arrivals = [seq(4), seq(4), seq(4), seq(4)]
    for s, priority in zip(arrivals, (5, 0, 5, -1)):
        s.priority = priority
        queue.enqueue(s)
    assert queue.admit() == [arrivals[3], arrivals[1], arrivals[0]]
    assert list(queue.waiting) == [arrivals[2]]


def test_fcfs_ignores_priorities_and_a_request_that_does_not_fit_holds_back_the_ones_behind_it() -> None:
    fcfs = PairQueue(AdmissionLimits(max_running=4, max_reserved_tokens=10_000))
    first, second = seq(4), seq(4)
    second.priority = -3
    fcfs.enqueue(first)
    fcfs.enqueue(second)
    assert fcfs.admit() == [first, second]
    tight = PairQueue(AdmissionLimits(max_running=4, max_reserved_tokens=100), policy="priority")
    big, small = seq(90, max_tokens=20), seq(4)
    big.priority, small.priority = 0, 1
    tight.enqueue(small)
    tight.enqueue(big)
    assert tight.admit() == [] and list(tight.waiting) == [big, small]   # no overtaking: the big one is not starved


def test_an_unknown_scheduling_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        PairQueue(AdmissionLimits(max_running=1, max_reserved_tokens=1), policy="lifo")


def running_queue(limits: AdmissionLimits, priorities: list[int], threshold: int | None = 0) -> PairQueue:
    """A priority queue whose running batch holds one 4-token sequence per priority, admitted in order."""
    queue = PairQueue(limits, policy="priority", preemption_threshold=threshold)
    for priority in priorities:
        s = seq(4)
        s.priority = priority
        queue.enqueue(s)
        queue.admit()
    return queue


def test_a_waiting_request_that_does_not_fit_preempts_the_lowest_priority_running_one() -> None:
    queue = running_queue(AdmissionLimits(max_running=3, max_reserved_tokens=10_000), [3, 7, 7])
    urgent = seq(4)
    urgent.priority = 0
    queue.enqueue(urgent)
    assert queue.preemption_victims() == [queue.running[2]]   # of the two at 7, the later arrival


def test_several_urgent_arrivals_preempt_in_one_step_up_to_the_first_that_cannot_be_made_to_fit() -> None:
    queue = running_queue(AdmissionLimits(max_running=2, max_reserved_tokens=10_000), [4, 6])
    for priority in (-1, -1, 0):
        s = seq(4)
        s.priority = priority
        queue.enqueue(s)
    # the two urgent ones take both slots; the third would have to preempt one of them (not lower by more than 0)
    assert queue.preemption_victims() == [queue.running[1], queue.running[0]]


def test_preemption_takes_as_many_as_the_tokens_need_and_none_if_that_is_not_enough() -> None:
    limits = AdmissionLimits(max_running=8, max_reserved_tokens=40)   # three running reserve 3 x 12
    queue = running_queue(limits, [1, 5, 6])
    big = seq(16, max_tokens=8)   # 24 tokens: two must go
    big.priority = 0
    queue.enqueue(big)
    assert queue.preemption_victims() == [queue.running[2], queue.running[1]]
    huge = running_queue(limits, [1, 5, 6])
    too_big = seq(30, max_tokens=8)   # 38: all three would have to go, and one of them is not lower by > 1
    too_big.priority = 0
    huge.preemption_threshold = 1
    huge.enqueue(too_big)
    assert huge.preemption_victims() == []


def test_no_preemption_when_the_head_fits_or_no_running_one_is_lower_by_more_than_the_threshold() -> None:
    limits = AdmissionLimits(max_running=2, max_reserved_tokens=10_000)
    room = running_queue(limits, [9])
    room.enqueue(seq(4))
    assert room.preemption_victims() == []   # a free slot: admitted without preempting
    close = running_queue(limits, [2, 3], threshold=3)
    close.enqueue(seq(4))
    assert close.preemption_victims() == []   # 3 - 0 is not more than 3
    off = running_queue(limits, [5, 5], threshold=None)
    off.enqueue(seq(4))
    assert off.preemption_victims() == []


def test_a_seeded_sample_is_never_preempted_but_a_seeded_greedy_one_is() -> None:
    queue = running_queue(AdmissionLimits(max_running=2, max_reserved_tokens=10_000), [5, 5])
    queue.running[0].sampling = SamplingParams(temperature=0.8, seed=7)
    queue.running[1].sampling = SamplingParams(temperature=0.8, seed=7)
    urgent = seq(4)
    queue.enqueue(urgent)
    assert queue.preemption_victims() == []
    queue.running[1].sampling = SamplingParams(temperature=0.0, seed=7)
    assert queue.preemption_victims() == [queue.running[1]]


def test_a_preempted_sequence_waits_ahead_of_later_arrivals_and_resumes_from_its_prompt_and_outputs() -> None:
    queue = running_queue(AdmissionLimits(max_running=1, max_reserved_tokens=10_000), [5])
    victim = queue.running[0]
    victim.prefilled, victim.context_len, victim.output_ids = 4, 6, [100, 101, 102]
    later = seq(4)
    later.priority = 5
    queue.enqueue(later)
    old_id = victim.seq_id
    queue.running.remove(victim)
    victim.preempt()
    queue.enqueue(victim)
    assert list(queue.waiting) == [victim, later]
    assert victim.status == Status.WAITING and victim.seq_id != old_id and victim.resumed == 3
    assert victim.prefill_ids == [0, 1, 2, 3, 100, 101, 102] and not victim.prefill_done
    assert plan_prefill_chunks([victim], 5) == [(victim, 5)]
    victim.prefilled = 5
    assert plan_prefill_chunks([victim], 5) == [(victim, 2)]


def test_preemption_needs_the_priority_policy() -> None:
    with pytest.raises(ValueError, match="preemption"):
        PairQueue(AdmissionLimits(max_running=1, max_reserved_tokens=1), preemption_threshold=0)
