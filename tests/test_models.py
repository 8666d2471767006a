import pytest
import torch
from torch import nn

from sparsetrain.models import MODELS, build_model, param_groups_for_weight_decay


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_registry_names():
    assert set(MODELS) == {"resnet18", "resnet20"}
    with pytest.raises(ValueError, match="resnet18"):
        build_model("resnet1000", 3, 10)


def test_resnet18_has_the_papers_parameter_count():
    assert n_params(build_model("resnet18", 3, 10)) == 11_173_962


def test_resnet20_has_he_et_al_parameter_count():
    # Option-A (parameter-free) shortcuts: 0.27M, as in He et al. 2016, Table 6.
    model = build_model("resnet20", 3, 10)
    assert n_params(model) == 269_722
    assert not any(m.kernel_size == (1, 1) for m in model.modules() if isinstance(m, nn.Conv2d))


def test_resnet18_is_the_cifar_variant():
    model = build_model("resnet18", 3, 10)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    stem = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert stem.kernel_size == (3, 3) and stem.stride == (1, 1)
    projections = [
        m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1)
    ]
    assert len(projections) == 3


@pytest.mark.parametrize("name", ["resnet18", "resnet20"])
@pytest.mark.parametrize("channels,size,classes", [(3, 32, 10), (1, 28, 10), (3, 32, 7)])
def test_forward_shapes(name, channels, size, classes):
    torch.manual_seed(0)
    model = build_model(name, channels, classes)
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, classes)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_initialisation():
    torch.manual_seed(0)
    model = build_model("resnet18", 3, 10)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)
    # Kaiming normal, fan_out: std = sqrt(2 / (out_channels * k * k)).
    conv = model.stages[3][1].conv2  # 512 x 512 x 3 x 3: enough samples for a tight estimate
    expected = (2.0 / (512 * 9)) ** 0.5
    assert conv.weight.std().item() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("name,n_decayed", [("resnet20", 20), ("resnet18", 21)])
def test_weight_decay_groups(name, n_decayed):
    model = build_model(name, 3, 10)
    decay, no_decay = param_groups_for_weight_decay(model, 5e-4)
    assert decay["weight_decay"] == 5e-4 and no_decay["weight_decay"] == 0.0
    decay_ids = {id(p) for p in decay["params"]}
    no_decay_ids = {id(p) for p in no_decay["params"]}
    assert not decay_ids & no_decay_ids
    assert decay_ids | no_decay_ids == {id(p) for p in model.parameters()}
    assert len(decay["params"]) == n_decayed  # convs + the classifier weight
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert id(m.weight) in no_decay_ids and id(m.bias) in no_decay_ids
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            assert id(m.weight) in decay_ids
    assert id(model.fc.bias) in no_decay_ids
    torch.optim.SGD([decay, no_decay], lr=0.1, momentum=0.9, nesterov=True)  # accepted as groups


def test_weight_decay_groups_conv_bias_and_frozen():
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, bias=True), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 2)
    )
    model[3].weight.requires_grad_(False)
    decay, no_decay = param_groups_for_weight_decay(model, 0.1)
    assert [id(p) for p in decay["params"]] == [id(model[0].weight)]
    assert {id(p) for p in no_decay["params"]} == {
        id(model[0].bias),
        id(model[1].weight),
        id(model[1].bias),
        id(model[3].bias),
    }
