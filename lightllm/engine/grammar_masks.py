"""Grammar masks of a step's logits rows: computed on llguidance's thread pool into reused host bitmasks, copied to
the device without a host sync, applied by one kernel (`apply_token_bitmask`).

`mask_windows` masks at once (the synchronous step and speculative windows). `MaskJob` splits the same work for
an overlapped step: its masks depend on the tokens of the step before, still on the device when the step is
queued. The job starts before the step's forward is launched, on a background thread that first runs what moves
the matchers to the step (`before`: read the tokens of the step before as soon as the device has them, advance
the matchers over them) and then fills the masks, so the chain from one step's draw to the next step's masks
never waits for the step's thread, which meanwhile launches the forward and emits the tokens. On a GPU the masked
draw is queued before the masks exist, behind a device wait on a counter the job writes when it is done
(`kernels/host_flag.py`): the host goes on to queue the next step's forward, and the device runs the draw the
moment the masks are in. On a CPU (or a GPU where the wait is not available) the draw is queued after the job is
done. The job's thread releases the device without the step's thread: a host call that waits for the device
meanwhile (an allocation that has to grow the caching allocator's pool) only waits for the masks, since torch
releases the GIL inside its operators; the step waits for the job itself (`wait`, which releases the GIL) before
it reads the draw back.

The host bitmask has one row per logits row (a row without a grammar, or before its grammar starts, keeps every
bit set); a pinned buffer is rewritten only once the copy that read it has completed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lightllm.kernels.host_flag import HostFlag
from lightllm.kernels.token_bitmask import apply_token_bitmask

logger = logging.getLogger(__name__)
# (request, first logits row, window width, drafts)
Window = tuple


class HostBitmasks:
    """Host bitmasks reused across steps: one int32 [rows, words] buffer per power-of-two row bucket, pinned when
    the logits are on a GPU. A pinned buffer is rewritten only once the copy that read it has completed (its event,
    queried, never waited on); while it is still in flight the step takes a fresh buffer instead. Also the counter
    a device waits on for a `MaskJob`, and the thread that fills jobs' masks."""

    def __init__(self):
        # (bucket rows, words, pinned) -> [buffer, event of its last copy or None]
        self._buffers: dict[tuple[int, int, bool], list] = {}
        # the whole buffer of the last `take` (benchmarks and tests look at it)
        self.last: torch.Tensor | None = None
        self._flag: HostFlag | None = None
        self._worker: ThreadPoolExecutor | None = None
        # whether a device may wait on the counter: None until `device_wait_works` tried it
        self.device_wait: bool | None = None

    def take(self, rows: int, words: int, pinned: bool) -> tuple[torch.Tensor, list]:
        """A [rows, words] int32 view with every bit set (no constraint), and its buffer's entry (for `to_device`)."""
        key = (1 << max(rows - 1, 0).bit_length(), words, pinned)
        entry = self._buffers.get(key)
        if entry is None or (entry[1] is not None and not entry[1].query()):
            entry = [torch.empty(key[:2], dtype=torch.int32, pin_memory=pinned), None]
            self._buffers[key] = entry
        self.last = entry[0]
        view = entry[0][:rows]
        view.fill_(-1)
        return view, entry

    def to_device(self, bitmask: torch.Tensor, entry: list, device: torch.device) -> torch.Tensor:
        """`bitmask` (a view from `take`) on `device`, copied behind the device's queued work."""
        if device.type != "cuda":
            return bitmask
        out = bitmask.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        entry[1] = event
        return out

    @property
    def flag(self) -> HostFlag:
        if self._flag is None:
            self._flag = HostFlag()
        return self._flag

    def worker(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._worker

    def device_wait_works(self, device: torch.device) -> bool:
        """Whether `device` can wait on the counter: tried once (a counter already at its target must pass, one
        released by another thread must hold the device until then); False on CPUs and wherever it fails."""
        if self.device_wait is None:
            self.device_wait = device.type == "cuda" and _try_device_wait(self.flag, device)
        return self.device_wait


def _try_device_wait(flag: HostFlag, device: torch.device) -> bool:
    import threading
    import time

    # a broken wait costs a few seconds here, not the default minute of spins
    spins = 1 << 22
    try:
        with torch.cuda.device(device):
            target = flag.next_target()
            flag.set(target)
            flag.wait_on_device(target, spins)
            torch.cuda.synchronize(device)
            target = flag.next_target()
            flag.wait_on_device(target, spins)
            done = torch.cuda.Event()
            done.record()
            release = threading.Timer(0.05, flag.set, args=(target,))
            release.start()
            time.sleep(0.01)
            # the device must still be held: the event behind the wait has not completed
            held = not done.query()
            done.synchronize()
            release.join()
            return held
    except Exception:
        return False


def fill_parallel(executor, bitmask: torch.Tensor, plain: list[tuple], drafted: list[tuple]) -> None:
    """Masks of many matchers at once on llguidance's thread pool (the GIL released): `plain` (matcher, row)
    one position each, `drafted` (matcher, first row, drafts) a window each, walked and rolled back in the pool.
    Rows after a draft the grammar refuses are left as they are: nothing past that draft can be accepted.
    (llguidance.torch wraps the same calls but imports torch.compile, seconds of start-up in the engine.)"""
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    if plain:
        executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
    if drafted:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), row_bytes, bitmask.shape[0])


def _fill_windows(windows: list[Window], bitmask: torch.Tensor) -> None:
    """Each constrained window's masks into `bitmask`: windows where the grammar starts inside are walked here,
    the others on llguidance's pool."""
    constrained = [(req.grammar, start, drafts) for req, start, _, drafts in windows if req.grammar is not None]
    if not constrained:
        return
    plain, drafted = [], []
    for grammar, start, drafts in constrained:
        if grammar.starts_inside(drafts):
            # the grammar starts inside this window (a reasoning block ends): walked here, position by position
            grammar.fill_window(bitmask, start, drafts)
        elif grammar.active:
            (drafted if drafts else plain).append((grammar.matcher, start, *([drafts] if drafts else [])))
        else:
            # a reasoning block the grammar waits behind: free, but it may not end the output
            grammar.hold_stop(bitmask, start, len(drafts) + 1)
    fill_parallel(constrained[0][0].executor, bitmask, plain, drafted)


def _host_masks_of(windows: list[Window]) -> HostBitmasks | None:
    for req, *_ in windows:
        if req.grammar is not None:
            return req.grammar.host_masks
    return None


def mask_windows(windows: list[Window], logits: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, V] with every constrained position of every window (request, first row, width, drafts)
    masked to -inf outside its grammar (a new tensor); the same tensor when no window has a grammar. No host sync:
    the masks go to the device through pinned buffers, behind whatever the device is running."""
    host_masks = _host_masks_of(windows)
    if host_masks is None:
        return logits
    bitmask, entry = host_masks.take(logits.shape[0], (logits.shape[1] + 31) // 32, logits.is_cuda)
    _fill_windows(windows, bitmask)
    return apply_token_bitmask(logits, host_masks.to_device(bitmask, entry, logits.device))


class MaskJob:
    """The masks of an overlapped step's windows, filled once the matchers hold the tokens of the step before (see
    the module's docstring). Call `apply` (masked logits), `start` (with what brings the matchers to this step as
    `before`, run first on the mask thread, or once they are there) and `wait` (before the matchers are touched
    again), in an order `deferred` allows: on a device that waits for the job, `apply` may come first; otherwise it
    must come after `wait`."""

    def __init__(self, host_masks: HostBitmasks, windows: list[Window], rows: int, vocab: int, device: torch.device):
        self.host_masks, self.windows = host_masks, windows
        self.bitmask, self._entry = host_masks.take(rows, (vocab + 31) // 32, device.type == "cuda")
        self.deferred = host_masks.device_wait_works(device)
        self._target = host_masks.flag.next_target() if self.deferred else None
        self._future: Future | None = None
        # the outcome of `before`, set on the mask thread ahead of the masks
        self._before: Future | None = None
        self._done = False

    @classmethod
    def of(cls, windows: list[Window], rows: int, vocab: int, device: torch.device) -> MaskJob | None:
        """A job for the windows of a step's [rows, vocab] logits on `device`, or None when none has a grammar."""
        host_masks = _host_masks_of(windows)
        return None if host_masks is None else cls(host_masks, windows, rows, vocab, device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits masked by this job's masks: on a deferred job, queued behind the device's wait for them."""
        if logits.shape[0] != self.bitmask.shape[0] or (logits.shape[1] + 31) // 32 != self.bitmask.shape[1]:
            raise ValueError(f"logits {tuple(logits.shape)} do not fit the job's masks {tuple(self.bitmask.shape)}")
        if self.deferred:
            self.host_masks.flag.wait_on_device(self._target)
        elif not self._done:
            raise RuntimeError("the masks are applied before they were computed")
        return apply_token_bitmask(logits, self.host_masks.to_device(self.bitmask, self._entry, logits.device))

    def start(self, before: Callable[[], object] | None = None) -> None:
        """Fill the masks in the background, after `before()` on the same thread when given (what moves the matchers
        to this step: the tokens of the step before, read as soon as the device has them; its result is
        `before_result()`). A deferred job releases the device's wait when done; the rows of requests finished by
        now keep every bit set (their token is dropped). Idempotent."""
        if self._future is not None:
            return
        windows = [w for w in self.windows if not w[0].is_finished]
        try:
            # a matcher still compiling in the background is waited for here, not on the mask thread
            for req, *_ in windows:
                if req.grammar is not None and req.grammar.active:
                    _ = req.grammar.matcher
        except BaseException:
            self._release()
            raise
        if before is not None:
            self._before = Future()
        self._future = self.host_masks.worker().submit(self._fill, windows, before)

    def start_or_release(self) -> None:
        """`start` if it never was; when that fails, the device's wait is released and the error logged (the
        caller is on its way out with an error of its own, or the step's draw fails at `wait`)."""
        if self._future is not None:
            return
        try:
            self.start()
        except Exception as exc:
            logger.exception("grammar masks could not be started")
            self._future = Future()
            self._future.set_exception(exc)

    @property
    def runs_before(self) -> bool:
        """Whether the job was started with a `before` (whose result `before_result` gives)."""
        return self._before is not None

    def before_result(self):
        """What `before` returned, once it has (the masks may still be filling); raises what it raised."""
        return self._before.result()

    def _fill(self, windows: list[Window], before: Callable[[], object] | None) -> None:
        try:
            if before is not None:
                try:
                    self._before.set_result(before())
                except BaseException as exc:
                    self._before.set_exception(exc)
                    raise
            _fill_windows(windows, self.bitmask)
        finally:
            self._release()

    def _release(self) -> None:
        self._done = True
        if self.deferred:
            self.host_masks.flag.set(self._target)

    def wait(self) -> None:
        """Until the masks are filled (the job's error, if it failed). Starts it first if it never was."""
        self.start()
        self._future.result()
