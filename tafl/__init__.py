"""tafl: federated long-tailed medical-image classifiers robust to an unknown test-time class mix.

Components (docs/design.md, "Components and the direction of imports"): `tafl.training` (data, FL methods, simulator, evaluation),
`tafl.packaging` (ONNX model packages), `tafl.serving` (BentoML service), `tafl.clients`
(REST client, batch scoring, CLI helpers).
"""

__version__ = "0.1.0"
