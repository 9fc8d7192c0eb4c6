"""Training on a GPU (`--device cuda`): the paths that broke only there (docs/results.md, "The CUDA path on a lent GPU"). Each test skips where
no CUDA device is visible, so CI's CPU machines skip them; `benchmarks/device_cuda.sh` runs them on a lent GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the train extra (pip install -e '.[train]')")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

from tafl.training.config import load_config  # noqa: E402
from tests.conftest import CONFIGS, SMOKE_GTAFL  # noqa: E402


def test_gtafl_chooses_its_operating_point_on_the_gpu(tmp_path):
    """The experts' vote on validation ran on CPU tensors with the vote weights on the GPU."""
    from tafl.training.simulator import train

    cfg = load_config(CONFIGS / "smoke.yaml", {**SMOKE_GTAFL, "device": "cuda", "decision": "validation"})
    report = train(cfg, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "final.pt").is_file()
    assert 0 <= report["average_accuracy"] <= 1


def test_dp_sgd_adds_its_noise_on_the_gpu():
    """Opacus draws its noise on the parameters' device: a CPU generator was refused there."""
    from tafl.training.local import dp_local_sgd, generator_on
    from tafl.training.models import ModelConfig, build_model

    cpu_gen = torch.Generator().manual_seed(0)
    assert generator_on(cpu_gen, torch.device("cpu")) is cpu_gen
    assert generator_on(cpu_gen, torch.device("cuda")).device.type == "cuda"
    model = build_model(ModelConfig("resnet8", 4, 1, 8, 0.25, norm="group")).cuda()
    before = [p.detach().clone() for p in model.parameters()]
    images = torch.randint(0, 255, (16, 8, 8, 1), dtype=torch.uint8)
    out = dp_local_sgd(model, images, torch.randint(0, 4, (16,)),
                       normalize=lambda b: (b.permute(0, 3, 1, 2).float() / 255.0).cuda(), epochs=1, batch_size=4, lr=0.1,
                       momentum=0.0, weight_decay=0.0, augment=False, gen=torch.Generator(), noise_gen=cpu_gen,
                       noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.5)
    assert out["steps"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
