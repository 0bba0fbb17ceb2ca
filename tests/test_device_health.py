"""The device-health state machine on its own: plain objects, no threads, no clock."""

from __future__ import annotations

import pytest

from batchserve.devices.health import (
    FAILING_BLAME,
    MAX_FAILURES_KEPT,
    MAX_PROBE_DELAY_S,
    Backoff,
    DeviceHealth,
    DeviceState,
    Health,
    Verdict,
    Who,
)


def who(name: str) -> Who:
    return ("tenant", name, False)


def in_service(count: int) -> tuple[Health, list[DeviceHealth]]:
    health, devices = Health(), [DeviceHealth() for _ in range(count)]
    health.count(devices)
    return health, devices


def test_two_failed_first_tries_in_a_row_make_a_device_suspect():
    health, [device] = in_service(1)
    assert health.call_failed(device, {who("a")}, first_try=True) is Verdict.INPUTS
    assert device.state is DeviceState.IDLE
    assert health.call_failed(device, {who("b")}, first_try=True) is Verdict.SUSPECT
    assert device.state is DeviceState.SUSPECT
    assert health.healthy == 1  # a suspect still counts: its probe is one short call


def test_a_first_try_failed_elsewhere_breaks_the_streak():
    """Under a flood of poison every device fails: then no device is to blame."""
    health, [one, other] = in_service(2)
    health.call_failed(one, {who("a")}, first_try=True)
    health.call_failed(other, {who("b")}, first_try=True)
    assert health.call_failed(one, {who("c")}, first_try=True) is Verdict.INPUTS
    assert one.state is DeviceState.IDLE


def test_failed_rescues_do_not_count_towards_suspicion():
    health, [device] = in_service(1)
    health.call_failed(device, {who("a")}, first_try=True)
    for name in "bcd":  # rescues fail again where their poison is
        assert health.call_failed(device, {who(name)}, first_try=False) is Verdict.INPUTS
    assert device.state is DeviceState.IDLE


def test_a_suspect_that_answers_its_probe_takes_work_again_with_a_clean_streak():
    health, [device] = in_service(1)
    health.call_failed(device, {who("a")}, first_try=True)
    health.call_failed(device, {who("b")}, first_try=True)
    health.cleared(device)
    assert (device.state, device.failed_first_tries) == (DeviceState.IDLE, 0)
    assert health.call_failed(device, {who("c")}, first_try=True) is Verdict.INPUTS


def test_a_suspect_whose_probe_fails_is_taken_out():
    health, [device] = in_service(1)
    health.call_failed(device, {who("a")}, first_try=True)
    health.call_failed(device, {who("b")}, first_try=True)
    health.probe_hung(device)
    assert device.state is DeviceState.HUNG
    health.probe_returned(device)
    assert device.state is DeviceState.RECOVERING
    health.suspect_failed_probe(device)
    health.mark_failing(device)
    assert (device.state, health.healthy) == (DeviceState.FAILING, 0)


def test_calls_whose_inputs_succeed_elsewhere_blame_the_device_until_it_fails():
    health, [device] = in_service(1)
    for index in range(FAILING_BLAME):
        health.call_failed(device, {who(f"r{index}")}, first_try=False)
        assert health.exonerate(device, {who(f"r{index}")}) is (index + 1 >= FAILING_BLAME)
    assert (device.blame, device.failures) == (FAILING_BLAME, [])
    assert health.call_failed(device, {who("next")}, first_try=False) is Verdict.FAILING
    assert health.mark_failing(device) == FAILING_BLAME
    assert (device.state, device.blame, device.failures) == (DeviceState.FAILING, 0, [])
    assert health.healthy == 0


def test_blame_needs_every_input_of_a_failed_call_answered_elsewhere():
    health, [device] = in_service(1)
    health.call_failed(device, {who("a"), who("b")}, first_try=False)
    assert not health.exonerate(device, {who("a")})
    assert (device.blame, device.failures) == (0, [{who("b")}])
    health.exonerate(device, {who("b")})
    assert (device.blame, device.failures) == (1, [])


def test_a_busy_device_to_blame_is_taken_out_only_once_idle():
    health, [device] = in_service(1)
    device.blame = FAILING_BLAME - 1
    health.call_failed(device, {who("a")}, first_try=False)
    device.state = DeviceState.BUSY  # the pool's move: a batch started meanwhile
    assert not health.exonerate(device, {who("a")})
    assert device.blame == FAILING_BLAME  # its next failed call says FAILING


def test_a_poison_input_clears_the_calls_it_was_in_on_every_device():
    health, [one, other] = in_service(2)
    health.call_failed(one, {who("poison"), who("a")}, first_try=False)
    health.call_failed(other, {who("poison")}, first_try=False)
    health.call_failed(other, {who("b")}, first_try=False)
    health.poison_found([one, other], who("poison"))
    assert (one.failures, other.failures) == ([], [{who("b")}])


def test_failures_kept_are_bounded():
    health, [device] = in_service(1)
    for index in range(MAX_FAILURES_KEPT + 10):
        health.call_failed(device, {who(str(index))}, first_try=False)
    assert len(device.failures) == MAX_FAILURES_KEPT
    assert device.failures[-1] == {who(str(MAX_FAILURES_KEPT + 9))}


def test_a_success_ends_every_streak():
    health, [device] = in_service(1)
    health.call_failed(device, {who("a")}, first_try=True)
    device.blame = 1
    health.call_succeeded(device)
    assert (device.failures, device.blame, device.failed_first_tries) == ([], 0, 0)


def test_a_hung_call_takes_the_device_out_until_it_rejoins():
    health, [device, _] = in_service(2)
    health.hung(device)
    assert (device.state, health.healthy) == (DeviceState.HUNG, 1)
    health.hung_call_returned(device)
    assert device.state is DeviceState.RECOVERING
    health.rejoin(device)
    assert (device.state, health.healthy) == (DeviceState.IDLE, 2)


def test_a_failing_device_restarts_out_of_service_and_rejoins():
    health, [device] = in_service(1)
    health.mark_failing(device)
    health.restarting(device)
    assert (device.state, health.healthy) == (DeviceState.FAILING, 0)
    health.rejoin(device)
    assert (device.state, health.healthy) == (DeviceState.IDLE, 1)


def test_dead_devices_are_not_counted_in_service():
    health, devices = Health(), [DeviceHealth(), DeviceHealth(), DeviceHealth()]
    health.dead(devices[0])
    devices[1].state = DeviceState.SUSPECT
    health.count(devices)
    assert health.healthy == 2


def test_backoff_doubles_from_now_up_to_its_limit():
    backoff = Backoff(1.0, max_s=5.0)
    assert [backoff.next_at(now) for now in (100.0, 200.0, 300.0, 400.0, 500.0)] == [
        101.0,
        202.0,
        304.0,
        405.0,
        505.0,
    ]
    assert Backoff(0.5).next_at(0.0) == pytest.approx(0.5)
    probes = Backoff(20.0)  # by default up to MAX_PROBE_DELAY_S
    assert [probes.next_at(0.0), probes.next_at(0.0)] == [20.0, MAX_PROBE_DELAY_S]
