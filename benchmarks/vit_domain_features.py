"""Which ViT features the in-domain detector should score (issue 53), offline on the three ViT-DAFL runs of
benchmarks/domain_detection.py (benchmarks/out/domain_dafl_derma_s{1,2,3}, trained before the change): the class
token after the final LayerNorm ("post", what the detector first used), the class token before it ("pre"), and the
class token with the mean patch token before it ("premean", what `Classifier.domain_features` now gives). The
Gaussian is fitted on the pooled training features (the sites' sums give exactly this), the threshold keeps 95 % of
the validation split; far sets as in the training report, with ../shared/data/dicom.

    python benchmarks/vit_domain_features.py   # prints one JSON line per seed: refused, then per set (AUROC, FPR95, accepted)
"""
import json

import numpy as np
import torch
from pathlib import Path
from tafl.training.checkpoint import load_checkpoint
from tafl.training.config import RunConfig
from tafl.training.data import load_dataset
from tafl.training.models import ModelConfig, build_model
from tafl.training.detector import fit_gaussian, distances
from tafl.training.ood import far_sets, detection
from tafl.imaging import Preprocess
torch.set_num_threads(1)
for s in (1, 2, 3):
    run = Path(f"benchmarks/out/domain_dafl_derma_s{s}")
    ck = load_checkpoint(run / "final.pt")
    cfg = RunConfig.from_dict(ck["run_config"])
    ds = load_dataset(cfg)
    m = build_model(ModelConfig.from_dict(ck["model_config"])); m.load_state_dict(ck["state"]["weights"]); m.eval()
    pre = Preprocess.from_dict(ck["preprocess"])
    mean = torch.tensor(pre.mean).view(1,-1,1,1).float(); std = torch.tensor(pre.std).view(1,-1,1,1).float()
    vit = m.extractor
    @torch.no_grad()
    def feats(u8, kind):
        out = []
        for i in range(0, len(u8), 256):
            x = (torch.from_numpy(u8[i:i+256]).permute(0,3,1,2).float()/255 - mean)/std
            t = vit.norm_pre(vit._pos_embed(vit.patch_embed(x)))
            t = vit.blocks(t)
            if kind == "post": f = vit.norm(t)[:, 0]
            elif kind == "pre": f = t[:, 0]
            elif kind == "premean": f = torch.cat([t[:, 0], t[:, 1:].mean(1)], 1)
            out.append(f.double())
        return torch.cat(out).numpy()
    sets = far_sets("dermamnist", pre.size, pre.channels, 0, [Path(__file__).resolve().parents[2] / "shared" / "data" / "dicom"])
    res = {}
    for kind in ("post", "pre", "premean"):
        F = feats(ds.train.images, kind); y = ds.train.labels; C = len(ds.class_names)
        sums = np.zeros((C, F.shape[1])); np.add.at(sums, y, F)
        mu, cl, P = fit_gaussian(sums, F.T @ F, np.bincount(y, minlength=C).astype(float))
        val = distances(feats(ds.val.images, kind), mu, P); thr = np.quantile(val, 0.95)
        test = distances(feats(ds.test.images, kind), mu, P)
        r = {"refused": round(float((test > thr).mean()), 3)}
        for name, im in sets.items():
            d = detection(test, distances(feats(im, kind), mu, P), thr)
            r[name] = (round(d["auroc"], 3), round(d["fpr95"], 3), round(d["accepted"], 3))
        res[kind] = r
    print(s, json.dumps(res), flush=True)
