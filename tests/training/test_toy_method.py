"""A new method is one file: the toy method below (its own settings, its two steps, its registration) is defined in
this test file alone, and trains a smoke run through the same drivers, flags and checks as the built-in methods."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from tafl.errors import ConfigError  # noqa: E402
from tafl.training.aggregate import check_results  # noqa: E402
from tafl.training.config import RunConfig, flat_keys, load_config  # noqa: E402
from tafl.training.contract import (ClientResult, GlobalState, Method, MethodConfig, method_names,  # noqa: E402
                                    register_method, unregister_method)
from tafl.training.methods.base import ClassifierMethod  # noqa: E402
from tests.conftest import CONFIGS  # noqa: E402


@dataclass
class ToyConfig(MethodConfig):
    """toy"""

    toy_step: float = 0.5  # how far the server moves from the round's global weights toward the clients' mean

    def check(self, run) -> None:
        if not 0 < self.toy_step <= 1:
            raise self.bad("toy_step", "must be in (0, 1]")


class Toy(ClassifierMethod):
    """FedAvg with a server step size: w ← w + toy_step·(mean of the clients' w − w). At toy_step 1 it is FedAvg."""

    name = "toy"
    opts_type = ToyConfig
    opts: ToyConfig

    def client_update(self, payload, data, round_cfg):
        if round_cfg.get("calibrate"):
            return self.calibration.update(payload, data, round_cfg)
        self.model.load_state_dict(payload)
        gen = self.generator(round_cfg["round"], data.client_id)
        metrics = self.recipe.train(data.images[data.indices], data.local_labels, data, round_cfg["round"], gen)
        return ClientResult(data.client_id, len(data), self.local_update(), {}, metrics)

    def server_update(self, state, results, round_):
        good = check_results(self.scoped(state.weights), results)
        mean = self.aggregate_update(state, good)
        step = self.opts.toy_step
        weights = {k: v + step * (mean[k] - v) if v.is_floating_point() and step != 1 else mean[k]
                   for k, v in state.weights.items()}
        return GlobalState(weights, state.extras, dict(state.meta, round=round_, dropped=[]))


@pytest.fixture
def toy():
    register_method("toy", config=ToyConfig)(Toy)  # what `@register_method("toy", config=ToyConfig)` does
    try:
        yield Toy
    finally:
        unregister_method("toy")
    assert "toy" not in method_names() and "toy_step" not in flat_keys()


def test_the_contract_asks_a_method_for_at_most_eight_steps():
    assert len(Method.__abstractmethods__) <= 8
    assert Toy.__abstractmethods__ == frozenset()  # the toy's two steps complete ClassifierMethod's six


def test_a_registered_method_brings_its_settings_flags_and_rules(toy):
    cfg = RunConfig.from_dict({"method": "toy", "toy_step": 0.25}).validate()
    assert cfg.settings() == ToyConfig(0.25) and cfg.toy_step == 0.25 and cfg.to_dict()["toy_step"] == 0.25
    with pytest.raises(ConfigError, match=r"config 'toy_step' = 2.0: must be in \(0, 1\]"):
        RunConfig.from_dict({"method": "toy", "toy_step": 2.0}).validate()
    from tafl.cli import build_parser

    train = next(a for a in build_parser()._actions if a.dest == "verb").choices["train"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in train._action_groups}
    assert groups["settings of method toy (ignored by the other methods)"] == ["toy_step"]
    assert "toy" in next(a for a in train._actions if a.dest == "method").choices


@pytest.mark.slow
def test_a_toy_method_defined_in_a_test_trains_a_smoke_run(toy, tmp_path):
    """Two rounds through the simulator: at toy_step 1 the toy is FedAvg to the last digit (the same local training
    and aggregation, composed from the same parts); at 0.5 the server's step is half as long."""
    reports, weights = {}, {}
    for name, over in (("fedavg", {}), ("toy1", {"method": "toy", "toy_step": 1.0}),
                       ("toy_half", {"method": "toy", "toy_step": 0.5})):
        from tafl.training.checkpoint import load_checkpoint
        from tafl.training.simulator import train

        train(load_config(CONFIGS / "smoke.yaml", over), tmp_path / name, progress=False)
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
        weights[name] = load_checkpoint(tmp_path / name / "final.pt")["state"]["weights"]
    assert reports["toy1"]["method"] == "toy" and reports["toy1"]["config"]["toy_step"] == 1.0
    assert all(torch.equal(weights["fedavg"][k], weights["toy1"][k]) for k in weights["fedavg"])
    assert reports["toy1"]["average_accuracy"] == reports["fedavg"]["average_accuracy"]
    assert not all(torch.equal(weights["fedavg"][k], weights["toy_half"][k]) for k in weights["fedavg"])
    assert 0 <= reports["toy_half"]["average_accuracy"] <= 1
