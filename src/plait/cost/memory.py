"""Memory of one rank's model state: parameters, gradients and optimizer state, with ZeRO.

Mixed-precision Adam follows Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models" (SC 2020): for Ψ parameters each rank holds 2Ψ bytes of
16-bit parameters, 2Ψ of 16-bit gradients and KΨ = 12Ψ of fp32 optimizer state (master
weights, momentum, variance). Over N data-parallel ranks: stage 0 keeps (2 + 2 + K)Ψ =
16Ψ; stage 1 shards the optimizer state, 4Ψ + 12Ψ/N; stage 2 also the gradients,
2Ψ + 14Ψ/N; stage 3 also the parameters, 16Ψ/N. fp32 training holds 4Ψ parameters, 4Ψ
gradients and 8Ψ of Adam moments (SGD with momentum: 4Ψ; mixed precision adds 4Ψ master
weights). Activations are the simulator's business (they depend on the schedule).

Offload (`plait.train.offload`) moves bytes off the device at the price of the host
link: activations swapped out in forward and back in backward (vDNN, Rhu et al. 2016)
leave on the device only the block being computed, and cost one crossing each way of
what the block saves; optimizer state swapped in for the step and out after it costs two
crossings of the state per step, and the device holds it only while the step's
activations are gone: the peak is params + grads + max(activations, optimizer state).

Limits: no fragmentation, no communication buffers (ZeRO's bucket sizes), no framework
workspace; real peaks run some percent higher. Transfers are charged in full to the
compute that waits for them (no overlap with the next layer, as vDNN's prefetch would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plait.cluster import Device, dtype_bytes

__all__ = [
    "ModelState",
    "Optimizer",
    "model_state_bytes",
    "offload_time",
    "optimizer_step_time",
    "swapped_optimizer_bytes",
]

Optimizer = Literal["adam", "sgd"]
_STATE_BYTES = {"adam": 8, "sgd": 4}  # fp32 moments per parameter


@dataclass(frozen=True)
class ModelState:
    """Bytes one rank holds for its parameters, their gradients and the optimizer state
    (which, in mixed precision, includes the fp32 master weights)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def _per_param(dtype: str, optimizer: Optimizer) -> tuple[int, int, int]:
    if optimizer not in _STATE_BYTES:
        raise ValueError(f"optimizer={optimizer!r} is unknown; use one of {sorted(_STATE_BYTES)}")
    width = dtype_bytes(dtype)
    master = 4 if width < 4 else 0  # mixed precision keeps fp32 master weights
    return width, width, master + _STATE_BYTES[optimizer]


def model_state_bytes(
    num_params: float,
    *,
    dtype: str = "bf16",
    zero_stage: int = 0,
    dp: int = 1,
    optimizer: Optimizer = "adam",
) -> ModelState:
    """Model-state bytes of a rank holding `num_params` parameters (its pipeline stages, its
    tensor-parallel shard) with ZeRO `zero_stage` sharding them over `dp` ranks: the
    formula for one group of replicas; a rank of a layout, whose experts are replicated
    on other ranks than the rest, is `plait.cost.expert_state_bytes`."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    if num_params < 0:
        raise ValueError(f"num_params={num_params} must be >= 0")
    p, g, k = _per_param(dtype, optimizer)
    return ModelState(
        params=num_params * p / (dp if zero_stage >= 3 else 1),
        grads=num_params * g / (dp if zero_stage >= 2 else 1),
        optimizer=num_params * k / (dp if zero_stage >= 1 else 1),
    )


def optimizer_step_time(
    num_params: float,
    device: Device,
    *,
    dtype: str = "bf16",
    zero_stage: int = 0,
    dp: int = 1,
    optimizer: Optimizer = "adam",
) -> float:
    """Seconds of the optimizer step, which is memory-bound: for every parameter it updates
    (its 1/dp shard under ZeRO >= 1) it reads the gradient and the optimizer state, writes
    the state back and writes the parameter: 28 bytes each for mixed-precision Adam, at the
    device's memory bandwidth."""
    p, g, k = _per_param(dtype, optimizer)
    updated = num_params / (dp if zero_stage >= 1 else 1)
    return updated * (p + g + 2 * k) / device.memory_bandwidth_Bps


def offload_time(num_bytes: float, device: Device) -> float:
    """Seconds to move `num_bytes` one way over `device`'s link to host memory."""
    if num_bytes < 0:
        raise ValueError(f"num_bytes={num_bytes} must be >= 0")
    return num_bytes / device.host_bandwidth_Bps


def swapped_optimizer_bytes(optimizer_bytes: float, working_bytes: float) -> float:
    """Device bytes that optimizer state swapped in for the step adds to a peak of
    `working_bytes` (activations and workspace of forward and backward, gone by the
    step): only what exceeds them, since the two are never on the device together."""
    return max(0.0, optimizer_bytes - working_bytes)
