"""BackgroundWriter: order kept, failed writes kept for the next flush, the oldest dropped past the limit."""

from __future__ import annotations

import threading

from fabric.trainer.loggers.background_writer import BackgroundWriter


class Store:
    """Takes values while it is up; raises while it is down."""

    def __init__(self) -> None:
        self.up = True
        self.values: list[int] = []
        self.errors: list[Exception] = []
        self.thread: str | None = None

    def write(self, values: list[int]) -> None:
        self.thread = threading.current_thread().name
        if not self.up:
            raise ConnectionError("the store is down")
        self.values.extend(values)


def test_values_are_written_in_order_in_chunks_on_the_writers_own_thread() -> None:
    store = Store()
    writer = BackgroundWriter(store.write, store.errors.append, chunk=2, limit=100, name="test-writer")
    writer.add(range(5))
    writer.flush()
    writer.wait()
    assert (store.values, store.thread, writer.pending) == ([0, 1, 2, 3, 4], "test-writer", 0)
    writer.close()


def test_what_a_down_store_did_not_take_is_written_at_the_next_flush_and_the_oldest_past_the_limit_dropped() -> None:
    store = Store()
    store.up = False
    writer = BackgroundWriter(store.write, store.errors.append, chunk=2, limit=3, name="test-writer")
    writer.add([1, 2])
    writer.flush()
    writer.wait()
    assert (writer.pending, [str(error) for error in store.errors]) == (2, ["the store is down"])
    writer.add([3, 4])  # 4 waiting, 3 kept
    assert (writer.pending, writer.dropped) == (3, 1)
    store.up = True
    writer.close()  # one more try, waited for
    assert (store.values, writer.pending, writer.error) == ([2, 3, 4], 0, None)
