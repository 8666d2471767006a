"""conf/declared/local2.yaml (local SGD against top-k and signSGD, tuned): what its runs need, before
they run. No runs: the declaration, the script's point files and the composed configs."""

import re
from pathlib import Path

import yaml

from sparsetrain.analysis.declared import load

ROOT = Path(__file__).resolve().parents[1]
DECL = ROOT / "conf" / "declared" / "local2.yaml"


def _point_files() -> dict[str, str]:
    """scripts/local2.sh's map from a declared point to its conf/point file."""
    text = (ROOT / "scripts" / "local2.sh").read_text()
    body = re.search(r"POINT_FILE=\((.*?)\)", text, re.S).group(1)
    return dict(re.findall(r"\[(\w+)\]=(\w+)", body))


def test_every_point_is_tuned_on_the_same_grid_with_two_seeds():
    decl, doc = load(DECL), yaml.safe_load(DECL.read_text())
    grid = doc["tuning"]["grid"]
    assert set(grid) == set(decl.points)
    assert len({(tuple(rates), warmup) for rates, warmup in grid.values()}) == 1, "one grid for every point"
    assert doc["tuning"]["seeds"] == [200, 201] and not set(doc["tuning"]["seeds"]) & set(decl.seeds)
    pairs = [frozenset(c.label.split(" vs ")) for f in decl.findings for c in f.comparisons]
    assert len(pairs) == len(set(pairs)), "a pair in two families"


def test_each_point_file_composes_to_the_declared_point():
    from hydra import compose, initialize_config_dir

    from sparsetrain import config

    decl = load(DECL)
    files = _point_files()
    assert set(files) == set(decl.points)
    config.register()
    with initialize_config_dir(str(config.CONF_DIR), version_base=None):
        for point, want in decl.points.items():
            cfg = compose("config", overrides=["experiment=local2_tune", f"point={files[point]}",
                                               "optim.lr=0.1", "optim.warmup_epochs=0.3", "train.epochs=4"])
            assert cfg.train.epochs == decl.budgets[0] and cfg.data.val_size > 0, point
            scheme = "none" if want["scheme"] == "dense" else want["scheme"]
            assert cfg.scheme.name == scheme, (point, cfg.scheme.name)
            if "ratio" in want:
                assert cfg.ratio == want["ratio"], point
            if "sync" in want:
                period = int(re.search(r"period=(\d+)", want["sync"]).group(1))
                assert cfg.scheme.sync.period == period, point
