"""Flow control by band and tenant (issue 33): a request is judged against what is ahead of IT on each replica.

The engine prefills higher bands first and preempts a lower band for a running slot, so an interactive request is
admitted to a replica whose queued prefill and slots are all batch; and within a band a tenant fills only its
share of a replica's dispatch window, so a flood never holds the other tenants' requests behind it.
"""
from __future__ import annotations

from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued, admits
from stallfree.operator.router.pick import Choice, ReplicaView, pick_slo_aware
from stallfree.operator.router.prefill_clock import PrefillClock
from stallfree.operator.router.replicas import Replica

BATCH, INTERACTIVE = -1, 10


def view(name: str, by_class: dict[tuple[int, str], int], outstanding: dict[int, int] | None = None,
         rate: float = 1.0, seqs: int | None = 8) -> ReplicaView:
    held = outstanding or {}
    return ReplicaView(name, queued_prefill_tokens=sum(by_class.values()), prefill_tokens_per_ms=rate, step_ms=10.0,
                       outstanding=sum(held.values()), max_num_seqs=seqs, queued_by_class=by_class,
                       outstanding_by_priority=held)


def first(item, candidates) -> Choice:
    return pick_slo_aware(candidates, item.prompt_tokens)


def test_an_interactive_request_is_admitted_to_a_replica_whose_queued_prefill_is_all_batch():
    config = FlowConfig(dispatch_wait_ms=100.0)
    flooded = view("a", {(BATCH, ""): 5000})
    assert admits(flooded, config, INTERACTIVE)
    assert not admits(flooded, config, BATCH)  # the batch behind it still waits
    assert not admits(flooded, config)  # a request of no band sees everything
    mixed = view("a", {(BATCH, ""): 5000, (INTERACTIVE, ""): 150})
    assert not admits(mixed, config, INTERACTIVE)  # its own band's queued prefill is over the window


def test_running_slots_held_by_a_lower_band_do_not_block_a_higher_one():
    config = FlowConfig()
    full_of_batch = view("a", {}, outstanding={BATCH: 8}, seqs=8)
    assert admits(full_of_batch, config, INTERACTIVE)
    assert not admits(full_of_batch, config, BATCH)
    assert not admits(view("a", {}, outstanding={BATCH: 2, INTERACTIVE: 6, 20: 0}, seqs=8), config, BATCH)


def test_the_queue_sends_the_interactive_request_past_the_batch_backlog():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=100.0))
    queue.push(Queued(0, 0.0, 400, priority=BATCH))
    queue.push(Queued(1, 1.0, 300, priority=INTERACTIVE))
    sent = queue.dispatch([view("a", {(BATCH, ""): 3000}, outstanding={BATCH: 8})], first)
    assert [item.key for item, _ in sent] == [1]
    assert [q.key for q in queue] == [0]


def test_the_prefill_clock_puts_a_higher_band_ahead_of_the_lower_ones_pending():
    clock = PrefillClock()
    clock.dispatched("b1", 1000, 1000.0, 0.0, priority=BATCH)
    clock.dispatched("b2", 1000, 1000.0, 0.0, priority=BATCH)
    end = clock.dispatched("i", 500, 1000.0, 0.0, priority=INTERACTIVE, tenant="t")
    assert abs(end - 0.5) < 1e-9  # prefilled first, not after the two seconds of batch
    by_class = clock.queued_by_class(1000.0, 0.0)
    assert by_class == {(BATCH, ""): 2000, (INTERACTIVE, "t"): 500}
    assert clock.queued_tokens(1000.0, 0.0) == 2500
    assert abs(clock.busy_until_s - 2.5) < 1e-9


def test_the_replica_view_splits_its_queued_prefill_and_slots_by_band():
    replica = Replica("a", "http://a")
    replica.clock.dispatched(1, 4000, 1e9, 0.0, priority=BATCH)  # the rate only matters for the view's own
    replica.outstanding = 1
    replica.held[1] = BATCH
    seen = replica.view(0.0)
    assert seen.queued_by_class and set(seen.queued_by_class) == {(BATCH, "")}
    assert seen.outstanding_by_priority == {BATCH: 1}
    assert seen.seen_by(INTERACTIVE).queued_prefill_tokens == 0 and seen.seen_by(INTERACTIVE).outstanding == 0


def test_a_flooding_tenant_is_sent_below_its_band_and_does_not_hold_back_the_other_tenants():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=400.0))
    queue.push(Queued(0, 0.0, 100, tenant="t1"))
    queue.push(Queued(1, 0.0, 100, tenant="t2"))
    for key in range(2, 40):
        queue.push(Queued(key, 0.0, 100, tenant="flood"))
    # The flood offered 3,800 of 4,000 tokens, over twice its fair share (1,333): one below the band.
    sent = queue.dispatch([view("a", {})], first)
    by_tenant: dict[tuple[str, int], int] = {}
    for item, _ in sent:
        by_tenant[(item.tenant, item.sent_priority)] = by_tenant.get((item.tenant, item.sent_priority), 0) + 1
    assert by_tenant == {("t1", 0): 1, ("t2", 0): 1, ("flood", -1): 3}  # the window's 400 ms: 5 prompts in all
    # The flood's queued prefill fills the replica's window, yet another tenant's request goes at once: in the
    # engine it is ahead of the flood's (a higher priority), so nothing of the flood is ahead of it.
    queue.push(Queued(100, 1.0, 100, tenant="t1"))
    sent = queue.dispatch([view("a", {(0, "t2"): 100, (-1, "flood"): 2000})], first)
    assert [(item.key, item.sent_priority) for item, _ in sent] == [(100, 0)]


def test_tenants_offering_alike_are_never_demoted():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=400.0))
    for key in range(12):
        queue.push(Queued(key, key * 0.1, 100 + 10 * (key % 3), tenant=f"t{key % 4}"))
    sent = queue.dispatch([view("a", {}), view("b", {})], first)
    assert sent and all(item.sent_priority == 0 for item, _ in sent)


def test_one_tenant_keeps_the_whole_window_as_before():
    queue: FlowQueue[int] = FlowQueue(FlowConfig(dispatch_wait_ms=400.0))
    for key in range(10):
        queue.push(Queued(key, 0.0, 100))
    assert len(queue.dispatch([view("a", {})], first)) == 5  # 0, 100, ... 400 ms queued: admitted while <= 400


def test_a_flooding_tenant_fills_its_share_of_the_queue_and_the_others_still_find_room():
    queue: FlowQueue[str] = FlowQueue(FlowConfig(max_queued=12))
    for i in range(3):  # four tenants sending lately: each may hold 12 // 4 = 3 requests here
        assert queue.push(Queued(f"t{i}", float(i), 100, tenant=f"t{i}"))
    flood = [queue.push(Queued(f"f{i}", 3.0 + i, 100, tenant="flood")) for i in range(10)]
    assert flood == [True] * 3 + [False] * 7  # refused at its share, not at the queue's bound
    assert len(queue) == 6 and queue.rejected == 7
    assert queue.push(Queued("t0-again", 20.0, 100, tenant="t0"))  # the others still get in
    assert not queue.push(Queued("f-late", 22.0, 100, tenant="flood"))
    assert queue.cancel("f0")  # one of its own left: its share has room again
    assert queue.push(Queued("f-later", 23.0, 100, tenant="flood"))
    # A band is a flow of its own too: a higher band's request is not refused behind a lower band's flood (and
    # with five flows sending, each holds at most 12 // 5 = 2).
    assert queue.push(Queued("urgent", 24.0, 100, priority=INTERACTIVE, tenant="flood"))
    assert not queue.push(Queued("f-then", 25.0, 100, tenant="flood"))
    assert queue.dispatch([view("a", {}, seqs=None)], first)
    assert queue.push(Queued("f-after", 30.0, 100, tenant="flood"))  # dispatched ones no longer count


def test_one_flow_may_fill_the_whole_queue():
    queue: FlowQueue[str] = FlowQueue(FlowConfig(max_queued=5))
    assert [queue.push(Queued(f"r{i}", float(i), 100)) for i in range(6)] == [True] * 5 + [False]
    assert queue.share(Queued("x", 7.0, 1)) == 5
