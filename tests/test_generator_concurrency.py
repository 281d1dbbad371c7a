"""One generation at a time per SpeculativeGenerator: a second stream, thread or re-entrant call
is refused and the running one is left intact."""

from __future__ import annotations

import pytest

from _engine_helpers import small_generator


def test_interleaved_streams_refuse_the_second_and_leave_the_first_intact():
    gen = small_generator()
    ref = gen.generate([1, 2, 3], max_new_tokens=12, seed=0).token_ids.tolist()
    a = gen.stream([1, 2, 3], max_new_tokens=12, seed=0)
    it = iter(a)
    first = next(it)
    b = gen.stream([4, 5], max_new_tokens=12, seed=1)
    with pytest.raises(RuntimeError, match="already generating"):
        next(iter(b))
    rest = [t for chunk in it for t in chunk]
    assert first + rest == ref == a.result.token_ids.tolist()
    for _ in gen.stream([1, 2, 3], max_new_tokens=12):             # an abandoned stream frees it
        break
    assert gen.generate([1, 2, 3], max_new_tokens=12, seed=0).token_ids.tolist() == ref


def test_a_second_thread_is_refused_while_one_generates():
    import threading

    gen = small_generator()
    ref = gen.generate([1, 2, 3], max_new_tokens=12, seed=0).token_ids.tolist()
    started, tried = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hook(built, acc, step):
        if step == 0:
            started.set()
            assert tried.wait(60)

    def other():
        assert started.wait(60)
        try:
            gen.generate([4, 5], max_new_tokens=4)
        except RuntimeError as err:
            errors.append(err)
        finally:
            tried.set()

    thread = threading.Thread(target=other)
    thread.start()
    out = gen.generate([1, 2, 3], max_new_tokens=12, seed=0, on_step=hook).token_ids.tolist()
    thread.join(60)
    assert out == ref
    assert len(errors) == 1 and "already generating" in str(errors[0])
    with pytest.raises(RuntimeError, match="already generating"):   # re-entry from a hook too
        gen.generate([1, 2], max_new_tokens=4, on_step=lambda *a: gen.generate([1], max_new_tokens=1))
