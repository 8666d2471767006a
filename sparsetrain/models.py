"""Image classifiers used by the experiments, built by name.

- ``resnet18``: the paper's CIFAR variant of ResNet-18 (3x3 stride-1 stem, no max-pool, BasicBlock
  stages [2, 2, 2, 2] with widths 64/128/256/512, 1x1 conv + BN projection shortcuts). 11,173,962
  parameters for 3 input channels and 10 classes.
- ``resnet20``: He et al.'s CIFAR ResNet-20 (widths 16/32/64, three stages of three BasicBlocks,
  parameter-free "option A" shortcuts: stride-2 subsampling and zero-padded channels). 269,722
  parameters for 3 input channels and 10 classes; small enough for CPU work.

Both end in global average pooling, so they accept any input size that survives the downsampling
(32x32 CIFAR, 28x28 Fashion-MNIST, ...). Input channels and classes come from the data set.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "build_model", "param_groups_for_weight_decay", "ResNet"]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection.

    ``shortcut`` picks how the residual is matched when the shape changes: ``"projection"`` (1x1 conv
    + BN, ResNet-18) or ``"pad"`` (subsample and zero-pad channels, He et al.'s CIFAR option A).
    """

    def __init__(self, in_planes: int, planes: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride = stride
        self.option_a = False
        self.pad_channels = 0
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            if shortcut == "projection":
                self.shortcut = nn.Sequential(
                    nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                    nn.BatchNorm2d(planes),
                )
            elif shortcut == "pad":
                self.option_a = True
                self.pad_channels = planes - in_planes
                if self.pad_channels < 0:
                    raise ValueError("option-A shortcut cannot reduce channels")
            else:
                raise ValueError(f"unknown shortcut {shortcut!r}")

    def _residual(self, x: torch.Tensor) -> torch.Tensor:
        if self.option_a:
            # Option A: keep every stride-th pixel, add zero channels split evenly on both sides.
            x = x[:, :, :: self.stride, :: self.stride]
            half = self.pad_channels // 2
            return F.pad(x, (0, 0, 0, 0, half, self.pad_channels - half))
        return self.shortcut(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self._residual(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: 3x3 stride-1 stem, BasicBlock stages, global average pool, linear."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        widths: tuple[int, ...],
        blocks_per_stage: tuple[int, ...],
        shortcut: str,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(inplace=True),
        )
        stages = []
        in_planes = widths[0]
        for i, (width, n_blocks) in enumerate(zip(widths, blocks_per_stage, strict=True)):
            blocks = []
            for j in range(n_blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(BasicBlock(in_planes, width, stride, shortcut))
                in_planes = width
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            # nn.Linear keeps PyTorch's default (kaiming-uniform weight, uniform bias).

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet18(in_channels: int, num_classes: int) -> ResNet:
    return ResNet(in_channels, num_classes, (64, 128, 256, 512), (2, 2, 2, 2), "projection")


def resnet20(in_channels: int, num_classes: int) -> ResNet:
    return ResNet(in_channels, num_classes, (16, 32, 64), (3, 3, 3), "pad")


_REGISTRY: dict[str, Callable[[int, int], nn.Module]] = {
    "resnet18": resnet18,
    "resnet20": resnet20,
}
MODELS: tuple[str, ...] = tuple(_REGISTRY)


def build_model(name: str, in_channels: int, num_classes: int) -> nn.Module:
    """Build the model registered as ``name`` for the given input channels and classes."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}") from None
    return factory(in_channels, num_classes)


_DECAYED_MODULES = (nn.modules.conv._ConvNd, nn.Linear)


def param_groups_for_weight_decay(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two SGD parameter groups: conv/linear weights get ``weight_decay``; batch-norm parameters
    and every bias get none. Frozen parameters (``requires_grad=False``) are left out."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, _DECAYED_MODULES) and name == "weight":
                decay.append(p)
            else:
                no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
