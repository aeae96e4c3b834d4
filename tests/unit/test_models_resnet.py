"""The CIFAR ResNet-18: shapes, blocks, parameter count, backward."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from plait.blocks import as_blocks, equal_split, stage_modules
from plait.models import ResNet18


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Small convolutions on a shared 2-core machine are ~100× slower with 2 OpenMP threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_forward_shapes_and_ten_blocks() -> None:
    torch.manual_seed(0)
    model = ResNet18(num_classes=7, width=4)
    blocks = as_blocks(model)
    assert len(blocks) == 10
    x = torch.randn(2, 3, 32, 32)
    shapes = []
    out = x
    for block in blocks:
        out = block(out)
        shapes.append(tuple(out.shape))
    assert shapes == [
        (2, 4, 32, 32),  # stem
        (2, 4, 32, 32),
        (2, 4, 32, 32),
        (2, 8, 16, 16),
        (2, 8, 16, 16),
        (2, 16, 8, 8),
        (2, 16, 8, 8),
        (2, 32, 4, 4),
        (2, 32, 4, 4),
        (2, 7),  # head
    ]


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_blocks_and_stages_compose_to_the_model(norm: str) -> None:
    torch.manual_seed(0)
    model = ResNet18(num_classes=5, width=4, norm=norm)  # type: ignore[arg-type]
    model.eval()  # BatchNorm uses running statistics: both paths see the same ones
    x = torch.randn(3, 3, 32, 32)
    out: object = x
    for stage in stage_modules(as_blocks(model), equal_split(10, 4)):
        out = stage(out)
    torch.testing.assert_close(out, model(x))


def test_group_norm_is_microbatch_invariant_and_batch_norm_is_not() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    for norm, invariant in (("group", True), ("batch", False)):
        model = ResNet18(num_classes=5, width=4, norm=norm)  # type: ignore[arg-type]
        full = model(x)
        halves = torch.cat([model(x[:2]), model(x[2:])])
        assert torch.allclose(full, halves, atol=1e-5) is invariant, norm


def test_parameter_count_of_resnet18_for_cifar100() -> None:
    # Convs have no bias; every norm layer has 2 parameters per channel (weight, bias).
    # stem:    3·64·9 + 2·64                                            =      1,856
    # block(c_in -> c): 9·c_in·c + 9·c·c + 4c [+ c_in·c + 2c shortcut when c_in != c]
    # stage 1: 2 · (9·64·64·2 + 4·64)                                   =    147,968
    # stage 2: (9·64·128 + 9·128² + 4·128 + 64·128 + 2·128) + (18·128² + 4·128)
    #        = 230,144 + 295,424                                        =    525,568
    # stage 3: 919,040 + 1,180,672                                      =  2,099,712
    # stage 4: 3,673,088 + 4,720,640                                    =  8,393,728
    # head:    512·100 + 100                                            =     51,300
    # total                                                             = 11,220,132
    expected = 1_856 + 147_968 + 525_568 + 2_099_712 + 8_393_728 + 51_300
    assert expected == 11_220_132
    for norm in ("batch", "group"):
        model = ResNet18(norm=norm)
        assert model.num_params() == expected


def test_backward_reaches_every_parameter() -> None:
    torch.manual_seed(0)
    model = ResNet18(num_classes=5, width=4)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    ResNet18.loss(model(x), y).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_bad_options_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"norm='layer'.*'group'"):
        ResNet18(norm="layer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="width=0"):
        ResNet18(width=0)
