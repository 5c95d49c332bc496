"""A step's block tables kept on the device and sent as they change (``ov_kvcrush/gpu/table_mirror.py``,
``snapkv.cl``'s ``set_elements``): a run of steps as a decode's tables change (a block taken by a
row, one given back, the 2-bit tables' chunk, nothing at all, a sequence leaving the step, the
width growing), each read back from the device after its update. Oracle: the tables the step
asked for; and the bytes the pool counts against what each change needs. Run in the
``gpu_worker`` (Intel's OpenCL CPU runtime)."""

from __future__ import annotations

import numpy as np

LAYERS, ROWS, WIDTH = 3, 8, 32


def _steps(rng: np.random.Generator) -> list[tuple[str, dict[str, np.ndarray]]]:
    """The tables of each step, named for how they changed from the step before."""
    tables = rng.integers(0, 500, (LAYERS, ROWS, WIDTH)).astype(np.int32)
    qtables = rng.integers(0, 90, (LAYERS, ROWS, 16)).astype(np.int32)
    steps = [("first", {"kvc_tables": tables.copy(), "kvc_qtables": qtables.copy()})]
    tables[:, 2, 7] = 501  # a block taken by one sequence's rows in every layer
    steps.append(("a block taken", {"kvc_tables": tables.copy(), "kvc_qtables": qtables.copy()}))
    steps.append(("nothing", {"kvc_tables": tables.copy(), "kvc_qtables": qtables.copy()}))
    tables[1, 5, 3:] = 0  # blocks given back
    qtables[0, :, 9] = 91  # a chunk flushed in each row of a layer
    steps.append(("blocks given back, a chunk flushed", {"kvc_tables": tables.copy(), "kvc_qtables": qtables.copy()}))
    tables[:, :-2] = tables[:, 2:]  # the first sequence left: every row after it moves up
    steps.append(("a sequence left", {"kvc_tables": tables.copy(), "kvc_qtables": qtables.copy()}))
    wider = np.zeros((LAYERS, ROWS, WIDTH + 16), np.int32)
    wider[:, :, :WIDTH] = tables
    wider[:, 0, WIDTH] = 502
    steps.append(("wider", {"kvc_tables": wider, "kvc_qtables": qtables.copy()}))
    steps.append(("full-precision tables alone", {"kvc_tables": wider.copy()}))
    return steps


def _mirror_steps() -> list[tuple[dict[str, np.ndarray], int]]:
    """Per step: each table as read back from the device after the update, and the bytes sent."""
    from ov_kvcrush.gpu.layout import PoolShape
    from ov_kvcrush.gpu.pool import DevicePool
    from ov_kvcrush.gpu.table_mirror import TableMirror

    pool = DevicePool(PoolShape("f32", 16, 32, 1), 4)
    mirror = TableMirror(pool)
    out = []
    for _, tables in _steps(np.random.default_rng(5)):
        before = sum(pool.crossings[pool.phase].to_device.values())
        views = mirror.update(tables)
        read = {name: pool.dev.to_host(views[name], np.int32, t.shape) for name, t in tables.items()}
        out.append((read, sum(pool.crossings[pool.phase].to_device.values()) - before))
    return out


def test_the_device_holds_each_steps_tables_and_only_changes_cross(gpu_worker):
    """After every update the device's tables equal the step's; a step that changed a few words
    sends 8 bytes a word (an index and a value), one that changed none sends nothing, and one whose
    shape changed or most of whose words moved sends the whole."""
    got = gpu_worker.submit(_mirror_steps).result(timeout=600)
    steps = _steps(np.random.default_rng(5))
    previous: dict[str, np.ndarray] = {}
    for (how, tables), (read, sent) in zip(steps, got, strict=True):
        for name, table in tables.items():
            np.testing.assert_array_equal(read[name], table, err_msg=f"{how}: {name}")
        whole = sum(t.nbytes for t in tables.values())
        same_shapes = previous.keys() == tables.keys() and all(previous[n].shape == t.shape for n, t in tables.items())
        if not same_shapes:
            assert sent >= whole, (how, sent, whole)
        else:
            changed = sum(int((previous[n] != t).sum()) for n, t in tables.items())
            assert sent <= whole + 4096, (how, sent)  # the whole (and the views' alignment) at most
            if how == "a sequence left":  # most words moved: the pairs past half the whole, so the whole
                assert 16 * changed >= whole and sent >= whole, (how, sent, changed)
            else:  # a few words, or none: an index and a value each
                assert sent == 8 * changed, (how, sent, changed)
        previous = tables
