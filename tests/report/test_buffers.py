import jax
import jax.numpy as jnp
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.report.buffers import compile_with_buffers


def test_reads_the_values_live_at_the_temp_peak():
    def f(x):
        y = x @ x.T
        return (jnp.sort(y, axis=1) * y).sum()

    lowered = jax.jit(f).lower(jnp.ones((64, 32), jnp.float32))
    compiled, ba = compile_with_buffers(lowered)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert ba.temp_bytes == temp
    live = ba.live_temps()
    # The live values cover the heap up to its fragmentation, each byte counted once.
    assert sum(v.size for v in live) == ba.peak_bytes <= temp
    # A hand count: at the peak, y = x @ x.T and its sorted copy, f32[64, 64] each (a
    # sort is an op of its own, which the product with y reads alongside y; jax 0.12's
    # XLA:CPU fuses an element-wise op with the sum reading it, leaving no such value).
    assert sorted((v.shape, v.size, v.op_name.split("/")[-1]) for v in live) == [
        ("f32[64,64]", 64 * 64 * 4, "dot_general"),
        ("f32[64,64]", 64 * 64 * 4, "sort"),
    ]
    assert all(v.start <= ba.peak_time <= v.end for v in live)
    arguments = [v for v in ba.values if v.kind == "parameter"]
    assert sum(v.size for v in arguments) == compiled.memory_analysis().argument_size_in_bytes


def _temp(i, offset, size, start, end, phi=False):
    """A temp value of ``size`` bytes at ``offset``, live from ``start`` to ``end``."""
    from shardkit.report.buffers import Value

    return Value(
        id=i,
        instruction=f"v{i}",
        index="{}",
        size=size,
        offset=offset,
        shape="f32[1]",
        kind="temp",
        phi=phi,
        start=start,
        end=end,
    )


def test_values_sharing_heap_space_are_counted_once():
    from shardkit.report.buffers import BufferAssignment

    def value(i, offset, size, phi=False):
        return _temp(i, offset, size, 0, 1, phi=phi)

    # A loop's carried value (phi) in the same bytes as the value it carries: 0-100,
    # and a value overlapping half of it: 50-150. Live bytes: 150, the phi's own: none.
    ba = BufferAssignment(
        values=(value(0, 0, 100, phi=True), value(1, 0, 100), value(2, 50, 100)),
        temp_bytes=160,
        sequence=("a", "b"),
        peak_time=0,
        peak_bytes=150,
    )
    assert {v.id: v.size for v in ba.live_temps()} == {1: 100, 2: 50}


def _brute_force_peak(temps, length):
    """The definition: score every program point, the earliest of the most bytes."""
    best_t, best = 0, 0
    for t in range(length):
        bytes_ = set()
        for v in temps:
            if v.start is not None and v.start <= t <= v.end:
                bytes_ |= set(range(v.offset, v.offset + v.size))
        if len(bytes_) > best:
            best_t, best = t, len(bytes_)
    return best_t, best


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 40),  # offset
            st.integers(1, 30),  # size
            st.one_of(st.none(), st.integers(0, 25)),  # start (None: no live range)
            st.integers(0, 10),  # length of the range
        ),
        max_size=14,
    ),
    st.integers(1, 30),
)
def test_the_peak_is_the_earliest_point_covering_the_most_bytes(specs, length):
    from shardkit.report.buffers import _peak

    temps = [
        _temp(i, offset, size, start, None if start is None else start + span)
        for i, (offset, size, start, span) in enumerate(specs)
    ]
    assert _peak(temps, length) == _brute_force_peak(temps, length)
