"""What a decoding step costs, as the engine measures it: ``seconds = fixed + per_row * rows``,
fit online by least squares over recent steps (older steps weigh less). Pure: no torch.

A lone stream's step is mostly the fixed part (every weight read once); each row a step adds
costs ``per_row``, and a drafted position is one more row. So a draft position that is kept
with probability ``p`` pays in a step of ``n`` plain rows when ``p > n * per_row / (fixed +
n * per_row)``: the step's tokens per second rise (Speculator.prepare). Where the fit stands
depends on the CPU and its kernels: on a Xeon with AMX the checking rows cost little, and
speculation paid at 16 and 48 streams on copied text (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

DECAY = 0.98  # each step weighs 2% less than the one after it: ~50 steps in the fit
MIN_SPREAD = 0.25  # rows' weighted variance under which the slope is not read (kept as it was)


@dataclass(slots=True)
class StepCost:
    fixed: float | None = None  # seconds a step costs whatever its rows (None: not yet fit)
    per_row: float | None = None  # seconds each row adds
    _w: float = 0.0  # the decayed sums of weights, rows, seconds, rows², rows·seconds
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """A decoding step of ``rows`` rows (its sequences' tokens, drafts included) took
        ``seconds``."""
        self._w = DECAY * self._w + 1.0
        self._x = DECAY * self._x + rows
        self._y = DECAY * self._y + seconds
        self._xx = DECAY * self._xx + rows * rows
        self._xy = DECAY * self._xy + rows * seconds
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if spread < MIN_SPREAD:
            return
        slope = (self._xy / self._w - mean_x * mean_y) / spread
        intercept = mean_y - slope * mean_x
        if slope > 0 and intercept > 0:
            self.fixed, self.per_row = intercept, slope

    def least_acceptance(self, rows: int) -> float:
        """The share of its drafted positions a sequence must have kept lately for its drafts
        to pay in a step of ``rows`` plain rows (0 until the cost is fit: every one drafts)."""
        if self.fixed is None or self.per_row is None:
            return 0.0
        rows_cost = rows * self.per_row
        return rows_cost / (self.fixed + rows_cost)
