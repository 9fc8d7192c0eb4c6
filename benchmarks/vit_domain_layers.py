"""Whether the ViT's in-domain detector gains from earlier blocks (issue 53), offline on the three ViT-DAFL runs of
benchmarks/domain_detection.py (benchmarks/out/domain_dafl_derma_s{1,2,3}): per block, the class token and mean patch
token of that block's output (block 3's is what `Classifier.domain_features` scores), each a class-conditional
Gaussian on the pooled training features (the sites' sums give exactly this), its log distance standardised on the
validation split; then the sum and the maximum over the last two blocks and over all four. Threshold: 95 % of the
validation split; far sets as in the training report, with ../shared/data/dicom.

    python benchmarks/vit_domain_layers.py   # prints one line per seed and score: refused, then per set (AUROC, FPR95);
    # writes benchmarks/results/vit_domain_layers.json
"""
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tafl.training.checkpoint import load_checkpoint
from tafl.training.config import RunConfig
from tafl.training.data import load_dataset
from tafl.training.models import ModelConfig, build_model
from tafl.training.detector import fit_gaussian, distances
from tafl.training.ood import far_sets, detection
from tafl.imaging import Preprocess
torch.set_num_threads(1)
allres = {}
for s in (1, 2, 3):
    run = REPO / "benchmarks" / "out" / f"domain_dafl_derma_s{s}"
    ck = load_checkpoint(run / "final.pt"); cfg = RunConfig.from_dict(ck["run_config"]); ds = load_dataset(cfg)
    m = build_model(ModelConfig.from_dict(ck["model_config"])); m.load_state_dict(ck["state"]["weights"]); m.eval()
    pre = Preprocess.from_dict(ck["preprocess"])
    mean = torch.tensor(pre.mean).view(1,-1,1,1).float(); std = torch.tensor(pre.std).view(1,-1,1,1).float()
    vit = m.extractor
    @torch.no_grad()
    def feats(u8):
        outs = []
        for i in range(0, len(u8), 256):
            x = (torch.from_numpy(u8[i:i+256]).permute(0,3,1,2).float()/255 - mean)/std
            t = vit.norm_pre(vit._pos_embed(vit.patch_embed(x)))
            per = []
            for b in vit.blocks:
                t = b(t); per.append(torch.cat([t[:, 0], t[:, 1:].mean(1)], 1).double())
            outs.append(per)
        return [torch.cat([o[k] for o in outs]).numpy() for k in range(len(vit.blocks))]
    sets = far_sets("dermamnist", pre.size, pre.channels, 0, [REPO.parent / "shared" / "data" / "dicom"])
    y = ds.train.labels; C = len(ds.class_names)
    Ftr, Fval, Fte = feats(ds.train.images), feats(ds.val.images), feats(ds.test.images)
    Ffar = {n: feats(im) for n, im in sets.items()}
    L = len(Ftr); res = {}
    per_layer = []
    for k in range(L):
        sums = np.zeros((C, Ftr[k].shape[1])); np.add.at(sums, y, Ftr[k])
        mu, cl, P = fit_gaussian(sums, Ftr[k].T @ Ftr[k], np.bincount(y, minlength=C).astype(float))
        dv = distances(Fval[k], mu, P); lv = np.log(dv)
        z = lambda F: (np.log(distances(F, mu, P)) - lv.mean()) / lv.std()
        per_layer.append((z(Fval[k]), z(Fte[k]), {n: z(F[k]) for n, F in Ffar.items()}))
    def evaluate(name, val, test, far):
        thr = np.quantile(val, 0.95); r = {"refused": round(float((test > thr).mean()), 3)}
        for n, f in far.items():
            d = detection(test, f, thr); r[n] = (round(d["auroc"], 3), round(d["fpr95"], 3))
        res[name] = r
    for k in range(L):
        evaluate(f"block{k}", *per_layer[k])
    for agg, fn in (("sum", lambda a: np.sum(a, 0)), ("max", lambda a: np.max(a, 0))):
        for ks in ((L-2, L-1), tuple(range(L))):
            evaluate(f"{agg}{ks}", fn([per_layer[k][0] for k in ks]), fn([per_layer[k][1] for k in ks]),
                     {n: fn([per_layer[k][2][n] for k in ks]) for n in Ffar})
    for k, v in res.items(): print(s, k, v, flush=True)
    allres[s] = res
import json  # noqa: E402
(REPO / "benchmarks" / "results" / "vit_domain_layers.json").write_text(json.dumps(allres, indent=1) + "\n")
