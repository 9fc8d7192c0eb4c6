"""How a run's privacy guarantee reads in the report, the model card and the page (`privacy_summary`).

A leaf: pure text from the `privacy` object (tafl.training.privacy.privacy_section builds it), so the
packaging side (the card, generated from metadata.json alone) formats it without importing training."""

from __future__ import annotations

from typing import Any


def privacy_lines(p: dict[str, Any] | None) -> list[str]:
    """The card's and the report's privacy section: what leaves a site, and the guarantee on it."""
    if not p or p.get("mechanism") in (None, "none"):
        agg = "through SecAgg+ (the server saw sums over sites only)" if (p or {}).get("secure_aggregation") \
            else "in plaintext"
        return [f"No differential privacy: every site sent its model updates and statistics exactly, {agg}. "
                "Train with `--dp-epsilon` for a stated guarantee."]
    z = p.get("noise_multiplier") or {}
    lda = str(p.get("dp_sgd_trains") or "").startswith("nothing")  # method lda: releases only, no DP-SGD
    clip = p.get("clipping") or {}
    out = [f"**ε = {p['epsilon']:.3g}, δ = {p['delta']:.0e}** per {p['unit']} (target ε "
           f"{p.get('epsilon_target')}).", "",
           "| | |", "|---|---|", f"| mechanism | {p['mechanism']} |", f"| accountant | {p['accountant']} |",
           f"| noise multiplier (DP-SGD) | {z.get('min')}–{z.get('max')}; statistics × {p.get('stats_noise_ratio')} |"
           if not lda else
           f"| noise multiplier (the releases) | {z.get('min')}–{z.get('max')} |",
           f"| DP-SGD trains | {p.get('dp_sgd_trains') or 'the whole network'} |",
           f"| clipping | gradient norm {clip.get('gradient_norm')}, feature norm "
           f"{clip.get('feature_norm_per_sqrt_dim')}·√D (D the feature dimension) |"
           if not lda else
           f"| clipping | whitened feature norm {clip.get('feature_norm_per_sqrt_dim')}·√k (k the head basis's "
           "dimension) |",
           f"| secure aggregation | {'yes (SecAgg+)' if p.get('secure_aggregation') else 'no'} |"]
    if p.get("trust"):  # lda under SecAgg+: the noise is split over the sites of each sum
        out.append(f"| distributed noise | {p['trust']} |")
    if p.get("not_protected"):
        out += ["", "Not protected: " + "; ".join(p["not_protected"]) + "."]
    return out


def privacy_summary(p: dict[str, Any] | None) -> str:
    """One line for people (the service's page): the guarantee the training gave each site's images, or that there
    was none."""
    if not p or p.get("epsilon") is None:
        how = "summed by SecAgg+" if (p or {}).get("secure_aggregation") else "in plaintext"
        return f"no differential privacy (the sites sent exact updates and statistics, {how})"
    agg = ", sums via SecAgg+" if p.get("secure_aggregation") else ""
    return (f"ε = {p['epsilon']:.3g}, δ = {p['delta']:.0e} per {p.get('unit') or 'record'} "
            f"({p.get('accountant', '')}{agg})")
