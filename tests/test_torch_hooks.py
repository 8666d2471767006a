"""torch's DDP hooks are chosen through a registry (issue 62): conf/schemes.yaml's ``torch_hook``
says which schemes run one, ``train.ddp_exchange.TORCH_HOOKS`` which hook; a scheme marked
``torch_hook`` without a registered hook is refused in one line naming what is registered."""

from __future__ import annotations

import pytest

from sparsetrain import scheme_catalog
from sparsetrain.errors import ConfigError
from sparsetrain.results import TORCH_HOOK_SCHEMES
from sparsetrain.train import ddp_exchange


def test_the_registry_covers_exactly_the_schemes_conf_marks_torch_hook():
    assert TORCH_HOOK_SCHEMES == scheme_catalog.with_property("torch_hook")
    assert set(ddp_exchange.TORCH_HOOKS) == set(TORCH_HOOK_SCHEMES)
    for name in TORCH_HOOK_SCHEMES:
        assert ddp_exchange.torch_hook_for(name) is ddp_exchange.TORCH_HOOKS[name]
    # PowerSGD's hook starts a collective from a future callback: one bucket on gloo
    assert [n for n, h in ddp_exchange.TORCH_HOOKS.items() if h.one_bucket_on_gloo] == ["torch_powersgd"]


@pytest.mark.parametrize("name", ["none", "topk", "powersgd", "localsgd", "my_own"])
def test_a_scheme_not_marked_torch_hook_runs_sparsetrains_hook(name):
    assert ddp_exchange.torch_hook_for(name) is None


def test_a_scheme_marked_torch_hook_without_a_registered_hook_is_refused(monkeypatch):
    monkeypatch.setattr(ddp_exchange, "TORCH_HOOK_SCHEMES", (*TORCH_HOOK_SCHEMES, "int8"))
    with pytest.raises(ConfigError) as err:
        ddp_exchange.torch_hook_for("int8")
    msg = str(err.value)
    assert "\n" not in msg and "scheme='int8'" in msg and "torch_hook" in msg
    assert all(name in msg for name in ("torch_powersgd", "fp16", "bf16"))


def test_the_factories_set_the_sizes_torch_sends():
    class Exchange:
        numel = 100
        density = 1.0

    ex = Exchange()
    hook, state = ddp_exchange.TORCH_HOOKS["bf16"].build(ex, None, None, [(10, 10)], 4)
    assert hook is ddp_exchange.default_hooks.bf16_compress_hook and state is None
    assert ex.bytes_sent_per_step == 200 and ex.density == 1.0
