"""Training: `train(TrainConfig) -> result` at any (tp, pp, dp), with AdamW (ZeRO-1 optional), warmup + cosine
LR, global-norm clipping, bf16 with fp32 master weights, atomic sharded checkpoints with exact resume, metrics.

    from tpzoo.train import TrainConfig, load_config, train
    result = train(load_config("scripts/configs/tiny-gpt-stdlib.toml", {"steps": 20}))

Modules: config (dataclasses, TOML, flags), loop (the trainer), optim (DistributedAdamW), lr (schedule),
checkpointing (save/resume), data (datasets and loaders), metrics (throughput, MFU, logs), generate (samples).
See docs/training.md.
"""
from .config import TrainConfig, describe_config, load_config
from .loop import train

__all__ = ["TrainConfig", "describe_config", "load_config", "train"]
