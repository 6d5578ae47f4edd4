"""Dynamic loss scaling for fp16 training (Megatron's DynamicGradScaler, the same rules).

fp16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by `scale` before the
backward (so are all gradients), the fp32 main gradients are divided by it before the update. An inf/NaN in the
gradients means the scale is too large: the step is skipped (an expected event, not a divergence) and after
`hysteresis` such steps the scale is multiplied by `backoff`; after `growth_interval` clean steps in a row it is
multiplied by `growth`. bf16 has fp32's exponent range and needs none of this (scale 1).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DynamicLossScaler:
    scale: float = 2.0 ** 16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    clean_steps: int = 0     # clean steps since the last change
    overflows_left: int = 2  # overflows still tolerated before backing off

    def __post_init__(self):
        self.overflows_left = min(self.overflows_left, self.hysteresis)

    def update(self, overflow: bool) -> None:
        """After a step: `overflow` when its gradients held an inf or NaN (the step was skipped)."""
        if overflow:
            self.clean_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> "DynamicLossScaler":
        return cls(**state)
