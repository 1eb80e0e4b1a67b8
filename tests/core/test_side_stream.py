"""Work a running command hands to its queue's side stream (`CommandBuffer._beside`): the
commands marked ``beside`` run without waiting for it, every other command and the end of
the run wait for it, the tensors it reads are held until then, and a capture records it."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams need a GPU")

_SLOW = 200_000_000  # GPU cycles of `torch.cuda._sleep`: ~0.1 s, far longer than a launch


def _queue(device: str) -> m.CommandQueue:
    return m.Device(device).new_command_queue()


def test_on_the_cpu_side_work_runs_at_once() -> None:
    cb = _queue("cpu").command_buffer()
    out = torch.zeros(3)
    order: list[str] = []

    def first() -> None:
        cb._beside(lambda: (order.append("side"), out.add_(2)), (out,))
        order.append("first")

    cb.record("first", first)
    cb._record_beside("second", lambda: order.append("second"))
    cb.commit()
    cb.wait_until_completed()
    assert order == ["side", "first", "second"]
    assert torch.equal(out, torch.full((3,), 2.0))
    assert cb._side is None


@cuda
def test_a_command_not_marked_beside_waits_for_the_side_work() -> None:
    q = _queue("cuda")
    x = torch.arange(1.0, 5.0, device="cuda")
    y = torch.zeros(4, device="cuda")
    seen = torch.zeros(4, device="cuda")

    def slow_write() -> None:
        torch.cuda._sleep(_SLOW)  # the side stream is busy long after the host moved on
        y.copy_(x * 3)

    cb = q.command_buffer()
    cb.record("hand over", lambda: cb._beside(slow_write, (x, y)))
    cb.record("read", lambda: seen.copy_(y))  # not beside: ordered after the side work
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(seen, x * 3)


@cuda
def test_a_command_marked_beside_runs_while_the_side_work_runs() -> None:
    q = _queue("cuda")
    flag = torch.zeros(1, device="cuda")
    seen = torch.full((1,), -1.0, device="cuda")

    def slow_set() -> None:
        torch.cuda._sleep(_SLOW)
        flag.fill_(1.0)

    cb = q.command_buffer()
    cb.record("hand over", lambda: cb._beside(slow_set, (flag,)))
    # beside: not ordered after the side work, so it reads the flag before the sleep ends
    cb._record_beside("read early", lambda: seen.copy_(flag))
    cb.record("join", lambda: None)
    cb.commit()
    cb.wait_until_completed()
    assert seen.item() == 0.0
    assert flag.item() == 1.0  # and the buffer's completion covers the side work


@cuda
def test_the_end_of_the_run_waits_for_the_side_work() -> None:
    q = _queue("cuda")
    out = torch.zeros(1, device="cuda")

    def slow_set() -> None:
        torch.cuda._sleep(_SLOW)
        out.fill_(7.0)

    cb = q.command_buffer()
    cb.record("hand over", lambda: cb._beside(slow_set, (out,)))
    cb.commit()
    assert cb._side is None  # joined by the run's end: the completion event comes after it
    cb.wait_until_completed()
    assert out.item() == 7.0


@cuda
def test_the_side_work_of_a_later_command_waits_for_the_earlier_side_work() -> None:
    """One piece of side work at a time: handing over a second joins the first (the memory
    it held may then be reused on the queue's stream)."""
    q = _queue("cuda")
    out = torch.zeros(1, device="cuda")

    def slow_set() -> None:
        torch.cuda._sleep(_SLOW)
        out.fill_(2.0)

    def double() -> None:
        out.mul_(3.0)

    cb = q.command_buffer()
    cb.record("first", lambda: cb._beside(slow_set, (out,)))
    cb._record_beside("second", lambda: cb._beside(double, (out,)))
    cb.commit()
    cb.wait_until_completed()
    assert out.item() == 6.0


@cuda
def test_the_tensors_side_work_reads_are_held_until_it_is_joined() -> None:
    """The command that made ``t`` lets go of it; without ``keep`` the caching allocator would
    hand its block to the next allocation on the queue's stream (the 7s) while the side
    stream still sleeps before reading it."""
    q = _queue("cuda")
    n = 1 << 20
    out = torch.zeros(n, device="cuda")
    expect: list[torch.Tensor] = []
    cb = q.command_buffer()

    def hand_over() -> None:
        t = torch.randn(n, device="cuda")
        expect.append(t.clone())

        def slow_copy() -> None:
            torch.cuda._sleep(_SLOW)
            out.copy_(t)

        cb._beside(slow_copy, (t,))

    cb.record("hand over", hand_over)
    cb._record_beside("allocate", lambda: expect.append(torch.full((n,), 7.0, device="cuda")))
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(out, expect[0])
    assert cb._side is None


@cuda
def test_a_captured_buffer_replays_its_side_work() -> None:
    q = _queue("cuda")
    src = torch.arange(4.0, device="cuda")
    side_out = torch.zeros(4, device="cuda")
    main_out = torch.zeros(4, device="cuda")

    def build() -> m.CommandBuffer:
        cb = q.command_buffer()

        def slow_double() -> None:
            torch.cuda._sleep(_SLOW)  # "after" must wait for this inside the recording too
            side_out.copy_(src * 2)

        def hand_over() -> None:
            cb._beside(slow_double, (src,))

        cb.record("hand over", hand_over)
        cb._record_beside("beside", lambda: main_out.copy_(src + 1))
        cb.record("after", lambda: main_out.add_(side_out))
        return cb

    eager = build()
    eager.commit()
    eager.wait_until_completed()
    expected = main_out.clone()
    captured = build().capture()
    src.copy_(torch.tensor([5.0, -1.0, 0.5, 2.0], device="cuda"))
    captured.replay()
    captured.wait_until_completed()
    assert torch.equal(main_out, src + 1 + src * 2)
    assert not torch.equal(main_out, expected)


@cuda
@pytest.mark.parametrize("captured", [False, True])
def test_side_work_that_raises_is_joined_and_reported(captured: bool) -> None:
    """The fork is recorded before the work runs: the run joins it all the same, the buffer
    reports the work's error, and the queue records or runs the next buffer as usual."""
    q = _queue("cuda")
    out = torch.zeros(1, device="cuda")

    def build(fail: bool) -> m.CommandBuffer:
        cb = q.command_buffer()

        def work() -> None:
            torch.cuda._sleep(1000)  # launched on the side stream before the failure
            if fail:
                raise RuntimeError("the side work failed")
            out.fill_(5.0)

        cb.record("hand over", lambda: cb._beside(work, ()))
        cb.record("after", lambda: out.add_(1.0))
        return cb

    bad = build(True)
    with pytest.raises(RuntimeError, match="the side work failed"):
        if captured:
            bad.capture()
        else:
            bad.commit()
            bad.wait_until_completed()
    assert bad._side is None
    good = build(False)
    if captured:
        step = good.capture()
        step.replay()
        step.wait_until_completed()
    else:
        good.commit()
        good.wait_until_completed()
    assert out.item() == 6.0
