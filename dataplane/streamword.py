"""An order word: a 32-bit word on the GPU that one process's stream writes and another's waits for.

A call's copies must start after the engine's work that wrote (store) or last read (retrieve)
its buffer. An interprocess CUDA event orders them, but on an H100 a freshly recorded one was
seen complete by the data plane's process about 0.27 ms after its record, even on an idle stream;
the same call ordered by a word of memory that the engine's stream writes
(``cuStreamWriteValue32``) and the data plane's stream waits for (``cuStreamWaitValue32``) cost
24 us (``benchmarks/bench_callfloor.py --values``; docs/benchmarks.md, "A call's floor").

The word is the engine's: an allocation of its own on the buffer's GPU (``allocate``; a
process opens an IPC handle once, so words never share an allocation), shared by CUDA IPC at
registration (``Registration.order_word``). The engine's stream writes a rising count into it
after its work; a call names the count (``order``) and the data plane's stream waits until
``(int32)(word - order) >= 0`` (``CU_STREAM_WAIT_VALUE_GEQ``: the count may wrap). Writing it
has the driver's default memory barrier: the stream's earlier writes are visible first.

The other way round, the int32 after the order word (one allocation of two words) is the
instance's ready word (``Registration.ready_word``): the data plane's stream writes a rising count
into it after each group of a layer-wise retrieve, and the engine's stream waits for the count
that the group's progress frame names, instead of for an interprocess event.

Only the driver (``libcuda.so.1``) through ctypes: the engine's client loads this module too
and stays light (no cupy, no numba).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

MASK = 0xFFFFFFFF
WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ
WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: with a memory barrier


@functools.cache
def _driver() -> tuple[Callable[..., int], ...] | None:
    """The driver's stream write and wait of a 32-bit word, and its allocation calls; None
    without them."""
    u64, c_int = ctypes.c_uint64, ctypes.c_int
    sigs = {"cuStreamWriteValue32_v2": [ctypes.c_void_p, u64, ctypes.c_uint32, ctypes.c_uint],
            "cuStreamWaitValue32_v2": [ctypes.c_void_p, u64, ctypes.c_uint32, ctypes.c_uint],
            "cuMemAlloc_v2": [ctypes.POINTER(u64), ctypes.c_size_t],
            "cuMemsetD32_v2": [u64, ctypes.c_uint, ctypes.c_size_t],
            "cuCtxSynchronize": [],
            "cuIpcGetMemHandle": [ctypes.c_char_p, u64],
            "cuMemFree_v2": [u64]}
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fns = tuple(lib[name] for name in sigs)
    except (OSError, AttributeError):
        return None
    for f, args in zip(fns, sigs.values()):
        f.argtypes, f.restype = args, c_int
    return fns


def available() -> bool:
    """Whether this machine's driver has the stream word operations."""
    return _driver() is not None


def later(a: int, b: int) -> bool:
    """Whether count ``a`` comes after ``b`` (32-bit counts that wrap)."""
    return 0 < (a - b) & MASK < 1 << 31


def write(stream: int, address: int, value: int) -> None:
    """Queue on ``stream`` (a ``CUstream`` handle) the write of ``value`` to the word at
    ``address`` (a device address), after the stream's earlier work.

    Raises:
        RuntimeError: the driver refused it (its CUDA error number in the message).
    """
    _call(0, stream, address, value & MASK, WRITE_DEFAULT)


def wait(stream: int, address: int, value: int) -> None:
    """Make ``stream`` wait until the word at ``address`` reaches ``value`` (wrapping).

    Raises:
        RuntimeError: the driver refused it (its CUDA error number in the message).
    """
    _call(1, stream, address, value & MASK, WAIT_GEQ)


def allocate(words: int = 1) -> tuple[int, bytes]:
    """``words`` adjacent words in an allocation of their own on the current device (the
    calling thread's context), set to 0 and complete: (the first's device address, the
    allocation's 64-byte IPC handle). ``free`` gives it back.

    Raises:
        RuntimeError: the driver refused a step.
    """
    address = ctypes.c_uint64(0)
    _call(2, ctypes.byref(address), 4 * words)
    handle = ctypes.create_string_buffer(64)
    try:
        _call(3, address.value, 0, words)
        _call(4)  # the zero is in place before any other process can read it
        _call(5, handle, address.value)
    except BaseException:
        free(address.value)
        raise
    return address.value, handle.raw


def free(address: int) -> None:
    """Give back a word of ``allocate`` (errors ignored: the process may be exiting)."""
    fns = _driver()
    if fns is not None and address:
        fns[6](address)


_NAMES = ("cuStreamWriteValue32", "cuStreamWaitValue32", "cuMemAlloc", "cuMemsetD32",
          "cuCtxSynchronize", "cuIpcGetMemHandle")


def _call(which: int, *args: object) -> None:
    fns = _driver()
    if fns is None:
        raise RuntimeError("this driver has no stream memory operations (cuStreamWaitValue32)")
    rc = fns[which](*args)
    if rc != 0:
        raise RuntimeError(f"{_NAMES[which]} failed with CUDA error {rc}")


__all__ = ["MASK", "allocate", "available", "free", "later", "wait", "write"]
