"""The progress of ``relaymoe data`` over input bytes: a tqdm bar, or a line every 10 s."""

from __future__ import annotations

import sys
import time


class Progress:
    """A tqdm bar over input bytes when tqdm is installed and stderr is a terminal, else a
    line every 10 s (logs of batch jobs)."""

    def __init__(self, total: int, initial: int, *, enabled: bool):
        self.total, self.base, self.enabled = total, initial, enabled
        self.bar = None
        self.t_last = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        if tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=initial, unit="B", unit_scale=True,
                            desc="tokenising")  # fmt: skip
        elif initial:
            print(f"[relaymoe data] resuming: {initial / 2**20:.1f} of {total / 2**20:.1f} MiB "
                  "already tokenised", file=sys.stderr)  # fmt: skip

    def update(self, done_now: int) -> None:
        if not self.enabled:
            return
        done = self.base + done_now
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
        elif time.monotonic() - self.t_last >= 10:
            self.t_last = time.monotonic()
            pct = 100 * done / self.total if self.total else 100.0
            print(f"[relaymoe data] {done / 2**20:.1f} / {self.total / 2**20:.1f} MiB "
                  f"({pct:.0f}%)", file=sys.stderr)  # fmt: skip

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
