"""The roofline: hardware and model profiles and the step-time model built on them. The
reference backend times its steps with it; the gateway's predictor and autoscaler, and the
simulator, price work with the same model. It imports no other package of ours."""
